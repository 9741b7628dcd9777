"""Model hyperparameters: the one definition of what a valid SASRec or GRU4Rec config is.

Plain dataclasses (no torch, no pydantic), so both the models and the typed configuration
(``recsys.config``, which checks ``train.model.*`` when it is loaded) apply the same rules: a value
the config accepts is a value the model accepts.
"""
from __future__ import annotations

from dataclasses import dataclass

# upper limits: far beyond any useful model, low enough to catch a typo (an extra zero) early
MAX_DIM, MAX_HEADS, MAX_LEN = 4096, 64, 4096
MAX_LAYERS = {"SASRecConfig": 24, "GRU4RecConfig": 8}


def _check_ints(config: object, names: tuple[str, ...], limits: dict[str, int]) -> None:
    cls = type(config).__name__
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{cls}.{name} must be a positive integer, got {value!r}")
        if name in limits and value > limits[name]:
            raise ValueError(f"{cls}.{name} must be at most {limits[name]}, got {value!r}")


def _check_dropout(config: object) -> None:
    if not 0.0 <= float(config.dropout) < 1.0:
        raise ValueError(f"{type(config).__name__}.dropout must be in [0, 1), got {config.dropout!r}")


@dataclass(frozen=True)
class SASRecConfig:
    num_items: int          # vocabulary size, padding excluded: item indices are 1..num_items
    dim: int = 64
    layers: int = 2
    heads: int = 2
    max_len: int = 50       # most recent items the model reads
    dropout: float = 0.2

    def __post_init__(self) -> None:
        _check_ints(self, ("num_items", "dim", "layers", "heads", "max_len"),
                    {"dim": MAX_DIM, "layers": MAX_LAYERS["SASRecConfig"], "heads": MAX_HEADS, "max_len": MAX_LEN})
        if self.dim % self.heads:
            raise ValueError(f"SASRecConfig.dim ({self.dim}) must be a multiple of heads ({self.heads})")
        _check_dropout(self)


@dataclass(frozen=True)
class GRU4RecConfig:
    num_items: int          # vocabulary size, padding excluded: item indices are 1..num_items
    dim: int = 64
    layers: int = 1
    max_len: int = 50       # most recent items the model reads
    dropout: float = 0.2

    def __post_init__(self) -> None:
        _check_ints(self, ("num_items", "dim", "layers", "max_len"),
                    {"dim": MAX_DIM, "layers": MAX_LAYERS["GRU4RecConfig"], "max_len": MAX_LEN})
        _check_dropout(self)


# The model types by name: the one list the registry (``recsys.model.registry``), the typed
# configuration (``train.model.type`` and its sections) and ``evaluation.models`` are derived from.
MODEL_CONFIGS: dict[str, type] = {
    "sasrec": SASRecConfig,
    "gru4rec": GRU4RecConfig,
}
