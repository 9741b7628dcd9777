"""How users are scored, as one value: read from ``scoring.*`` once and handed to everything that scores.

The nightly stage and the on-demand path put it in the worker's spec, the worker builds its scorer
and the scorer's cache key from it, and the benchmark scores with it: so a setting cannot reach one
of them and miss another (the bench once scored without the job's ``max_tile_mb``). Plain values
only (no configuration object): the core and the GPU benchmark run where there is no pydantic.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ScoringParams:
    """The scoring settings; the defaults are the embedded default configuration's (a test checks)."""

    top_n: int
    chunk_size: int = 4096           # users scored together on the device
    device: str = "auto"             # auto | cpu | cuda | cuda:N (resolved on each worker)
    dtype: str = "float32"           # float32 | bfloat16 | float16 | int8
    item_tile: int = 0               # items per tile; 0: as many as max_tile_mb allows
    max_tile_mb: float = 1024.0      # largest [chunk, tile] score matrix in MiB; 0: no limit
    cache_size: int = 2              # models (and scorers) kept per Python worker

    @classmethod
    def from_config(cls, scoring: Any) -> "ScoringParams":
        """From the ``scoring`` section of the configuration (:class:`recsys.config.ScoringConfig`), by name."""
        return cls(**{f.name: getattr(scoring, f.name) for f in fields(cls)})

    def scorer_settings(self) -> dict[str, Any]:
        """The keyword arguments of :class:`recsys.scoring.core.Scorer` these settings decide."""
        return {k: v for k, v in asdict(self).items() if k in ("top_n", "dtype", "item_tile", "max_tile_mb")}

    def scorer_key(self) -> tuple:
        """What, besides the model, device and candidates, makes a prepared scorer different."""
        return tuple(sorted(self.scorer_settings().items()))


FILLS = ("popularity", "none")


@dataclass(frozen=True)
class RuleParams:
    """The operators' rules the scorer applies to each list (``recommend.*``; docs/rules.md), as plain values.

    The other rules are data, not settings: the catalog rules shape the candidate set on the driver, and the
    per-user exclusions arrive with each user's history (``excluded_items``). The defaults are the embedded
    default configuration's (a test checks).
    """

    touched: bool = False            # mask every item the user had in the window, whatever the repeat blend says
    min_new_items: int = 0           # at least this many items new to the user per list, when that many exist
    fill: str = "popularity"         # popularity | none: what fills a list the rules left short

    def __post_init__(self) -> None:
        if self.fill not in FILLS:
            raise ValueError(f"fill must be one of {list(FILLS)}, got {self.fill!r}")
        if self.min_new_items < 0:
            raise ValueError(f"min_new_items must be 0 or more, got {self.min_new_items}")

    @classmethod
    def from_config(cls, recommend: Any) -> "RuleParams":
        """From the ``recommend`` section of the configuration (:class:`recsys.config.RecommendConfig`)."""
        return cls(touched=recommend.exclude.touched, min_new_items=recommend.min_new_items, fill=recommend.fill)

    def key(self) -> tuple:
        """What these rules add to a prepared scorer's cache key."""
        return tuple(sorted(asdict(self).items()))


DEFAULT_RULES = RuleParams()
