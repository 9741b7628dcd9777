"""Typed configuration: the embedded default, a --conf file and --set overrides, validated once.

Entry points call :func:`load_config` exactly once and pass the resulting :class:`Config` (or the
section a function needs) down explicitly. Nothing else reads YAML or the environment for
settings, so a run is fully described by the resolved config that is logged with it. The few
environment variables the project honours are read here too (:func:`load_launch_settings`,
:func:`load_hooks`), once, by the entry points.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from recsys.errors import ConfigError
from recsys.model.configs import MODEL_CONFIGS
from recsys import redaction
from recsys.redaction import has_credentials, redact_text, redact_uri
from recsys.uris import is_local_path, local_path, validate_path

if TYPE_CHECKING:
    from recsys.hooks import Hooks


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _no_credentials(path: str) -> str:
    """A path is logged, recorded in MLflow (an artifact location in the tracking store's own tables), written
    into manifests and quoted by every library that fails to read it: it is no place for a secret."""
    if has_credentials(path):
        raise ValueError("a path must not carry credentials (it is logged, recorded in MLflow and written into "
                         "manifests): remove them and set storage.s3.credentials instead (default: the AWS chain "
                         "of environment, profile or instance role; env: AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY), or your store's own Hadoop settings for other schemes")
    return path


class PathsConfig(_Section):
    """Data roots every executor reaches (any URI Spark writes), and the driver's own scratch.

    ``work`` holds what executors write (a run's histories, staging): on a cluster a URI every
    executor and the driver reach. ``driver_scratch`` holds what only the driver uses (the model
    download, the remembered model resolution): always a local directory of the driver's.
    """

    events: str
    catalog: str
    output: str
    work: str
    driver_scratch: str

    @field_validator("events", "catalog", "output", "work", "driver_scratch")
    @classmethod
    def _path_is_sane(cls, value: str) -> str:
        # Relative paths are made absolute against the working directory of the process that reads
        # the config: the JVM (and executors) may run elsewhere, and must see the same paths.
        value = validate_path(value)
        _no_credentials(value)
        if is_local_path(value) and not value.startswith("file://"):
            return os.path.abspath(value)
        return value

    @field_validator("driver_scratch")
    @classmethod
    def _driver_scratch_is_local(cls, value: str) -> str:
        if not is_local_path(value):
            raise ValueError(f"driver_scratch must be a local directory of the driver's, got the URI {redact_uri(value)!r}; "
                             "executors never read it, so a local path (or file://) is enough")
        return value

    @property
    def driver_dir(self) -> Path:
        """``driver_scratch`` as a local path."""
        return local_path(self.driver_scratch)


class MlflowConfig(_Section):
    tracking_uri: str
    artifact_location: str | None
    experiment: str = Field(min_length=1)
    model_name: str = Field(min_length=1)
    alias: str = Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")

    @field_validator("artifact_location")
    @classmethod
    def _artifact_location_has_no_credentials(cls, value: str | None) -> str | None:
        return None if value is None else _no_credentials(value)


class HistoryConfig(_Section):
    window_days: int = Field(ge=1)
    max_items: int = Field(ge=1, le=100_000)
    event_types: tuple[str, ...]
    tie_break_seed: int


class CatalogConfig(_Section):
    max_age_days: int = Field(ge=0)


class ScoringConfig(_Section):
    top_n: int = Field(ge=1, le=10_000)
    chunk_size: int = Field(ge=1, le=1_000_000)
    device: str
    dtype: Literal["float32", "bfloat16", "float16", "int8"]
    arrow_batch_size: int = Field(ge=1, le=1_000_000)
    partitions: int = Field(ge=0)
    users_per_task: int = Field(ge=1)
    cache_size: int = Field(ge=1, le=64)
    item_tile: int = Field(ge=0)
    max_tile_mb: float = Field(ge=0)

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


CatalogValue = str | int | float | bool


def _catalog_rule(value: Any) -> dict[str, tuple[CatalogValue, ...]]:
    """``{column: [values]}`` of a catalog rule, checked before pydantic sees it: one clear line per mistake
    (a union type would answer a null value with one complaint per member)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"must map catalog columns to lists of values, e.g. {{category: [out_of_stock]}}, got {value!r}")
    rules = {}
    for column, values in value.items():
        if not isinstance(column, str) or not column.strip() or column != column.strip():
            raise ValueError(f"column name {column!r} must be a catalog column's name (no surrounding spaces)")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"{column}: give a non-empty list of values, e.g. {column}: [value], got {values!r}")
        bad = [v for v in values if v is None or not isinstance(v, (str, int, float, bool))]
        if bad:
            raise ValueError(f"{column}: values must be strings, numbers or booleans, got {bad[0]!r}")
        rules[column] = tuple(values)
    return rules


class EventRule(_Section):
    """Items the user had an ``event_type`` event with, ``within_days`` days before the night or less."""

    event_type: str = Field(min_length=1)
    within_days: int = Field(ge=1, le=36_600)


class ExcludeConfig(_Section):
    touched: bool                                          # every item the user had in the window
    events: tuple[EventRule, ...]
    catalog: dict[str, tuple[CatalogValue, ...]]           # column -> values: never candidates

    @field_validator("catalog", mode="before")
    @classmethod
    def _catalog_rule(cls, value: Any) -> dict[str, tuple[CatalogValue, ...]]:
        return _catalog_rule(value)

    @field_validator("events")
    @classmethod
    def _each_type_once(cls, rules: tuple[EventRule, ...]) -> tuple[EventRule, ...]:
        types = [r.event_type for r in rules]
        twice = sorted({t for t in types if types.count(t) > 1})
        if twice:
            raise ValueError(f"event_type {twice[0]!r} is listed twice; keep one rule per event type (the longest "
                             "within_days)")
        return rules


class IncludeConfig(_Section):
    catalog: dict[str, tuple[CatalogValue, ...]]           # column -> values: the only candidates

    @field_validator("catalog", mode="before")
    @classmethod
    def _catalog_rule(cls, value: Any) -> dict[str, tuple[CatalogValue, ...]]:
        return _catalog_rule(value)


class RecommendConfig(_Section):
    """The rules operators set over every list (docs/rules.md): what is excluded per user and from the
    candidates, the least number of items new to the user, and what fills a list a rule left short."""

    exclude: ExcludeConfig
    include: IncludeConfig
    min_new_items: int = Field(ge=0, le=10_000)
    fill: Literal["popularity", "none"]

    @property
    def catalog_columns(self) -> tuple[str, ...]:
        """The catalog columns the rules read, each once."""
        return tuple(dict.fromkeys([*self.exclude.catalog, *self.include.catalog]))

    def summary(self) -> dict[str, Any]:
        """The rules as plain values, for the manifest and MLflow."""
        return self.model_dump(mode="json")


class _ModelSection(_Section):
    """Hyperparameters of one model type. The rules live in the model's config dataclass
    (:mod:`recsys.model.configs`), applied here when the config is loaded: one definition, checked
    before any data is read instead of when training starts."""

    _model_type: ClassVar[str]

    @model_validator(mode="after")
    def _valid_for_the_model(self):
        MODEL_CONFIGS[self._model_type](num_items=1, **self.model_dump())
        return self


class SASRecSection(_ModelSection):
    _model_type: ClassVar[str] = "sasrec"
    dim: int
    layers: int
    heads: int
    max_len: int
    dropout: float


class GRU4RecSection(_ModelSection):
    _model_type: ClassVar[str] = "gru4rec"
    dim: int
    layers: int
    max_len: int
    dropout: float


ModelType = Literal[tuple(MODEL_CONFIGS)]   # type: ignore[valid-type]  # the registered names


class ModelConfig(_Section):
    """``type`` picks the model ``recsys train`` trains; each type keeps its own typed section, so
    switching types is one key (``--set train.model.type=gru4rec``) and every section stays validated.
    ``recsys evaluate`` trains the types listed in ``evaluation.models`` from their sections."""

    type: ModelType
    sasrec: SASRecSection
    gru4rec: GRU4RecSection

    def section(self, model_type: str | None = None) -> _Section:
        """The settings of ``model_type`` (default: the selected type)."""
        return getattr(self, model_type or self.type)


def _blend_weights(weights: tuple[float, ...], below: float, zero: str, only_zero: str) -> tuple[float, ...]:
    """A grid of weights the repeat blend chooses among: distinct, from 0 (``zero``) up to ``below``."""
    if any(not 0 <= w < below for w in weights) or len(set(weights)) != len(weights):
        raise ValueError(f"must be distinct weights from 0 ({zero}) up to {below}, got {list(weights)}; "
                         f"[0] keeps new items {only_zero}")
    return weights


class ItemToItemConfig(_Section):
    """Item-to-item (EASE) scores beside the model's for new items (recsys.model.item_to_item), weighed by the blend."""

    weights: tuple[float, ...] = Field(min_length=1, max_length=10)
    max_items: int = Field(ge=2, le=20_000)
    l2: float = Field(gt=0)

    @field_validator("weights")
    @classmethod
    def _distinct_and_not_negative(cls, weights: tuple[float, ...]) -> tuple[float, ...]:
        return _blend_weights(weights, 10_000, "none", "ranked without item-to-item scores")


class RepeatsConfig(_Section):
    """The repeat blend training chooses (recsys.model.repeats): whether, and on which held-out days."""

    learn: bool
    validation_days: int = Field(ge=1, le=366)
    max_rows: int = Field(ge=100, le=10_000_000)
    popularity_weights: tuple[float, ...] = Field(min_length=1, max_length=10)
    objective: Literal["ndcg_at_10", "hr_at_10"]
    min_rows: int = Field(ge=0)
    item_to_item: ItemToItemConfig

    @field_validator("popularity_weights")
    @classmethod
    def _distinct_and_not_negative(cls, weights: tuple[float, ...]) -> tuple[float, ...]:
        return _blend_weights(weights, 1000, "no prior", "ranked by the model alone")


class TrainConfig(_Section):
    model: ModelConfig
    every_nights: int = Field(ge=1, le=366)
    epochs: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    learning_rate: float = Field(gt=0)
    weight_decay: float = Field(ge=0)
    patience: int = Field(ge=1)
    patience_windows: int | None = Field(ge=1)
    warmup_epochs: float = Field(ge=0)
    lr_decay: Literal["constant", "cosine"]
    window_offsets: Literal["fixed", "random"]
    batching: Literal["random", "by_length"]
    loss: Literal["full", "sampled"]
    negatives: int = Field(ge=1)
    precision: Literal["auto", "fp32", "bf16"]
    seed: int
    min_item_count: int = Field(ge=1)
    history_items: int = Field(ge=2, le=1_000_000)
    device: str
    refit: bool
    refit_epochs: int | None = Field(ge=1)
    warm_start: bool
    warm_epochs: int = Field(ge=1)
    warm_replay_share: float = Field(gt=0, le=1)
    full_every_nights: int = Field(ge=1, le=366)
    held_out_share: float = Field(gt=0, le=1)
    held_out_min_users: int = Field(ge=0)
    gate_tolerance: float = Field(ge=0)
    gate_min_users: int = Field(ge=1)
    processes: int = Field(ge=1, le=4096)
    shards: int = Field(ge=0, le=100_000)
    max_users: int | None = Field(ge=1)
    repeats: RepeatsConfig

    @property
    def shard_files(self) -> int:
        """Parquet files the training histories are written to: ``shards``, or 0 -> 4 per process, at least 8."""
        return self.shards or max(8, 4 * self.processes)

    @model_validator(mode="after")
    def _a_shard_per_process(self) -> "TrainConfig":
        if self.shards and self.shards < self.processes:
            raise ValueError(f"train.shards={self.shards} is fewer than train.processes={self.processes}: every "
                             "training process reads its own shard files; raise train.shards or set it to 0 (auto)")
        return self

    @model_validator(mode="after")
    def _warmup_within_epochs(self) -> "TrainConfig":
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"train.warmup_epochs={self.warmup_epochs} must be less than train.epochs={self.epochs}")
        return self

    @property
    def continue_epochs(self) -> int | None:
        """The continued refit's epochs: ``refit_epochs``, at most ``epochs`` (a short test run's 1 epoch
        caps it); None for a refit from scratch."""
        return None if self.refit_epochs is None else min(self.refit_epochs, self.epochs)

    @property
    def warm_fit_epochs(self) -> int:
        """A warm night's most epochs: ``warm_epochs``, at most ``epochs`` (the learning-rate horizon)."""
        return min(self.warm_epochs, self.epochs)


class ALSGridConfig(_Section):
    ranks: tuple[int, ...] = Field(min_length=1)
    reg_params: tuple[float, ...] = Field(min_length=1)
    alphas: tuple[float, ...] = Field(min_length=1)
    max_iter: int = Field(ge=1, le=100)
    seed: int
    blocks: int = Field(ge=1, le=10_000)

    @field_validator("ranks", "reg_params", "alphas")
    @classmethod
    def _positive(cls, values: tuple) -> tuple:
        if any(v <= 0 for v in values):
            raise ValueError(f"every value must be positive, got {list(values)}")
        return values


EVALUATION_MODELS = ("popularity", "als", *MODEL_CONFIGS)


class BacktestConfig(_Section):
    """``recsys backtest``: the baselines measured beside the job's own lists (docs/quality.md, "The backtest").

    Personal frequency weighs each of a user's past events by ``2 ** (-age_days / half_life_days)`` (age: from
    the event to the start of the night), so an item edited yesterday counts about as much as one edited
    twice a half-life ago. Recent popularity counts the users of each item in the ``popularity_days`` days
    before the night. ALS is Spark's implicit ALS on each user's event counts, one point (no grid: the
    backtest fits it every night).
    """

    half_life_days: float = Field(gt=0, le=3650)
    popularity_days: int = Field(ge=1, le=3650)
    als_rank: int = Field(ge=1, le=1024)
    als_reg_param: float = Field(gt=0)
    als_alpha: float = Field(gt=0)
    als_max_iter: int = Field(ge=1, le=100)
    als_blocks: int = Field(ge=1, le=10_000)
    max_bootstrap_pairs: int = Field(ge=100)   # (user, night) pairs the intervals draw from; beyond it a seeded
                                               # sample of whole users


class EvaluationConfig(_Section):
    ks: tuple[int, ...] = Field(min_length=1)
    models: tuple[str, ...] = Field(min_length=1)
    bootstrap_resamples: int = Field(ge=0, le=100_000)
    bootstrap_seed: int
    als: ALSGridConfig
    backtest: BacktestConfig

    @field_validator("ks")
    @classmethod
    def _ks_positive(cls, values: tuple[int, ...]) -> tuple[int, ...]:
        if any(k < 1 for k in values):
            raise ValueError(f"every k must be at least 1, got {list(values)}")
        return tuple(sorted(set(values)))

    @field_validator("models")
    @classmethod
    def _models_known(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [m for m in values if m not in EVALUATION_MODELS]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; choose from {list(EVALUATION_MODELS)}")
        if len(set(values)) != len(values):
            raise ValueError(f"models are listed twice in {list(values)}")
        return values


class SparkConfig(_Section):
    master: str
    remote: str | None
    app_name: str
    conf: dict[str, str]

    @field_validator("conf", mode="before")
    @classmethod
    def _stringify(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}
        return value


class ProgressConfig(_Section):
    interval_s: float = Field(ge=0)               # a progress line this often while a long stage runs; 0: none

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _redis_url(value: str, key: str) -> str:
    if not value.startswith(REDIS_SCHEMES):
        raise ValueError(f"{key} must be a Redis URL (redis://HOST:PORT/DB, rediss://... or unix:///path.sock), "
                         f"got {redact_uri(value)!r}")
    return value


class ExportConfig(_Section):
    """``recsys export`` and the nightly job's last stage: the published lists into Redis (docs/export.md)."""

    redis_url: str | None
    after_publish: bool
    prefix: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    keep_versions: int = Field(ge=1, le=100)
    batch_users: int = Field(ge=1, le=100_000)
    pipeline_users: int = Field(ge=1, le=1_000_000)
    timeout_s: float = Field(gt=0, le=3600)
    lock_ttl_s: float = Field(ge=5, le=86_400)

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else _redis_url(value, "export.redis_url")

    @model_validator(mode="after")
    def _after_publish_needs_a_store(self) -> "ExportConfig":
        if self.after_publish and not self.redis_url:
            raise ValueError("export.after_publish is true but export.redis_url is not set: name the Redis to export to")
        if self.pipeline_users < self.batch_users:
            raise ValueError(f"export.pipeline_users={self.pipeline_users} is smaller than export.batch_users="
                             f"{self.batch_users}: a round trip carries one or more commands of batch_users users")
        return self


# The figures the guard may judge (recsys.pipelines.guard): name -> (direction, what it is). "min": the
# night is worse the lower the figure; "max": the higher. docs/operations.md ("The guard") gives their
# ranges on real nights; the defaults in default.yaml are chosen from those.
GUARD_FIGURES: dict[str, tuple[Literal["min", "max"], str]] = {
    "jaccard_at_n_mean": ("min", "mean Jaccard overlap of each user's top-N list with the previous night's"),
    "jaccard_at_10_mean": ("min", "the same for the first 10 items"),
    "first_item_changed_share": ("max", "share of users in both nights whose first item changed"),
    "catalog_coverage_ratio": ("min", "catalog coverage tonight over the previous night's"),
    "head_slot_share": ("max", "share of all slots taken by the top_n most recommended items (1: one list for all)"),
    "top1pct_slot_share": ("max", "share of all slots taken by the 1% most recommended candidates"),
    "exposure_gini": ("max", "Gini coefficient of exposure over the candidates"),
    "fallback_share": ("max", "share of users given the popularity fallback"),
    "users_lost_share": ("max", "share of the previous night's users without a list tonight"),
    "users_gained_share": ("max", "share of tonight's users without a list the previous night"),
    "score_psi": ("max", "population stability index of the model's scores against the previous night's deciles"),
    "realized_hr_ratio_at_n": ("min", "the previous lists' realized HR@N over the popularity baseline's"),
    "realized_hr_ratio_at_10": ("min", "the same at 10"),
    "realized_hr_pfreq_ratio_at_n": ("min", "the previous lists' realized HR@N over the personal-frequency "
                                            "baseline's (each user's most touched items)"),
    "realized_hr_pfreq_ratio_at_10": ("min", "the same at 10"),
}
# figures that compare with the previous night: not judged on the first night
GUARD_NEEDS_PREVIOUS = frozenset(name for name in GUARD_FIGURES
                                 if name.startswith(("jaccard", "first_item", "catalog_coverage_ratio", "users_",
                                                     "score_psi", "realized")))


class GuardThreshold(_Section):
    """A figure's two levels: crossing ``warn`` publishes and tags the run, crossing ``fail`` refuses the
    night (exit 3). Either may be null (that level is off)."""

    warn: float | None = None
    fail: float | None = None


class GuardConfig(_Section):
    """The guard between validation and publishing (docs/operations.md, "The guard")."""

    compare: bool
    min_users: int = Field(ge=1)
    thresholds: dict[str, GuardThreshold]

    @field_validator("thresholds")
    @classmethod
    def _known_and_ordered(cls, value: dict[str, GuardThreshold]) -> dict[str, GuardThreshold]:
        unknown = sorted(set(value) - set(GUARD_FIGURES))
        if unknown:
            raise ValueError(f"unknown guard figure(s) {unknown}; choose from {sorted(GUARD_FIGURES)}")
        for name, t in value.items():
            if t.warn is None or t.fail is None:
                continue
            direction = GUARD_FIGURES[name][0]
            if (direction == "min" and t.warn < t.fail) or (direction == "max" and t.warn > t.fail):
                raise ValueError(f"{name}: warn={t.warn} is past fail={t.fail}; a night is worse the "
                                 f"{'lower' if direction == 'min' else 'higher'} {name} is, so warn must come first")
        return value


class ServeConfig(_Section):
    """``recsys backend`` and ``recsys serve`` (docs/on-demand.md, docs/export.md).

    ``store``: where lookups are answered from: ``embedded`` (the newest published partition under
    ``paths.output``, indexed in the frontend's memory), a Redis URL (the version its pointer names,
    keys under ``export.prefix``), or ``none`` (every request goes to the on-demand backend).
    """

    host: str
    port: int = Field(ge=0, le=65535)
    backend_dir: str
    backend_port: int = Field(ge=0, le=65535)
    max_wait_ms: int = Field(ge=0, le=60_000)
    max_batch_users: int = Field(ge=1, le=1_000_000)
    max_concurrent_jobs: int = Field(ge=1, le=64)
    max_queue_users: int = Field(ge=1)
    max_request_users: int = Field(ge=1)
    request_timeout_s: float = Field(gt=0, le=3600)
    backend_timeout_s: float = Field(gt=0, le=600)
    refresh_s: float = Field(ge=0, le=86_400)
    as_of: str | None
    store: str
    store_timeout_ms: int = Field(ge=1, le=60_000)

    @field_validator("store")
    @classmethod
    def _store_is_known(cls, value: str) -> str:
        return value if value in ("embedded", "none") else _redis_url(value, "serve.store (or embedded, none)")

    @field_validator("as_of", mode="before")
    @classmethod
    def _as_of_is_a_date(cls, value: Any) -> str | None:
        if value is not None:
            import datetime as dt

            if isinstance(value, dt.date):   # YAML reads an unquoted date as a date
                return value.isoformat()
            try:
                dt.date.fromisoformat(str(value))
            except ValueError:
                raise ValueError(f"as_of must be a date YYYY-MM-DD or null, got {value!r}") from None
            return str(value)
        return value

    @field_validator("backend_dir")
    @classmethod
    def _dir_is_sane(cls, value: str) -> str:
        return os.path.abspath(validate_path(value))


class MetastoreConfig(_Section):
    """The Hive metastore holding ``output.table`` (docs/configuration.md, "The output table").

    Unset ``url`` and ``uris``: embedded Derby under ``dir`` (one process at a time), or the Derby network
    server ``recsys metastore start`` runs on it. Sessions recsys starts get these settings; under
    spark-submit or Spark Connect the session's own catalog is used."""

    dir: str                              # embedded Derby's database, derby.log, the warehouse directory
    url: str | None                       # JDBC URL of the metastore database (Derby network server, Postgres)
    jars: tuple[str, ...]                 # that database's JDBC driver jars, put on the driver's class path
    uris: str | None                      # thrift://host:9083: a Hive metastore service (or Glue, docs/cluster.md)

    @field_validator("dir")
    @classmethod
    def _dir_is_sane(cls, value: str) -> str:
        return os.path.abspath(validate_path(value))


class OutputConfig(_Section):
    """How a night is published: its run directory, the table that points at it, what is kept."""

    table: str | None = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")
    keep_runs: int = Field(ge=1, le=1000)
    retention_days: int | None = Field(ge=1)
    metastore: MetastoreConfig


class S3Config(_Section):
    """One object-store setting for Spark's S3A (``spark.hadoop.fs.s3a.*``) and the driver's pyarrow
    file systems alike (:mod:`recsys.storage`)."""

    endpoint: str | None                  # http(s)://host:port of an S3-compatible store; None: AWS
    region: str | None
    path_style: bool                      # bucket in the path, not the host name (MinIO, moto, most on-prem stores)
    credentials: Literal["default", "env", "anonymous"]
    s3_as_s3a: bool                       # map s3:// to Hadoop's S3A (plain Spark knows no s3:// file system)

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_a_url(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[^/\s]+/?", value):
            raise ValueError(f"endpoint must look like http://host:port or https://host, got {redact_uri(value)!r}")
        return value.rstrip("/") if value else value


class StorageConfig(_Section):
    s3: S3Config


class Config(_Section):
    paths: PathsConfig
    mlflow: MlflowConfig
    history: HistoryConfig
    catalog: CatalogConfig
    scoring: ScoringConfig
    recommend: RecommendConfig
    train: TrainConfig
    evaluation: EvaluationConfig
    spark: SparkConfig
    progress: ProgressConfig
    serve: ServeConfig
    export: ExportConfig
    output: OutputConfig
    storage: StorageConfig
    guard: GuardConfig

    @model_validator(mode="after")
    def _rules_fit_the_job(self) -> "Config":
        """The rules against the sections they depend on: each mistake named in one line at start-up."""
        rules, history = self.recommend, self.history
        if rules.min_new_items > self.scoring.top_n:
            raise ValueError(f"recommend.min_new_items={rules.min_new_items} is more than scoring.top_n="
                             f"{self.scoring.top_n}: a list holds top_n items; lower min_new_items")
        for rule in rules.exclude.events:
            if rule.within_days > history.window_days:
                raise ValueError(f"recommend.exclude.events: {rule.event_type!r} within_days={rule.within_days} reaches "
                                 f"before the history window (history.window_days={history.window_days}), whose "
                                 "events are all the job reads; lower within_days or raise history.window_days")
            if history.event_types and rule.event_type not in history.event_types:
                raise ValueError(f"recommend.exclude.events: event_type {rule.event_type!r} is not among "
                                 f"history.event_types {list(history.event_types)}, so the job never reads those "
                                 "events; add it there or remove the rule")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def digest(self) -> str:
        """The first 16 hex digits of the SHA-256 of the sections ``paths``, ``mlflow``, ``history``,
        ``catalog``, ``scoring``, ``recommend``, ``train``, ``evaluation`` and ``spark``, every key with its
        resolved value (after the default, the --conf file and --set; paths made absolute; URIs as given,
        credentials included: only their hash leaves), as JSON with sorted keys and no spaces. The manifest records
        it, and a date already published with the same digest and model version is skipped: so a changed rule
        (``recommend``: what is excluded, included, filled) makes the next run of a published date recompute it.

        ``progress``, ``serve``, ``export``, ``output``, ``storage`` and ``guard`` are left out: how often the
        log says how far a run is, how the frontend queues and batches, where the lists are exported, which table
        points at a night, how the stores are reached and where the guard draws its lines change no published
        row, and a partition published before those sections existed must still be skipped as up to date.
        ``evaluation.backtest`` is left out for the same reason: it shapes only what the backtest measures
        beside the job. Nor does it cover what is not configuration: the environment (:class:`LaunchSettings`),
        the hooks, the model version (recorded next to it) or the input data.
        """
        data = self.to_dict()
        for section in ("progress", "serve", "export", "output", "storage", "guard"):
            data.pop(section, None)
        data["evaluation"].pop("backtest", None)
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def redacted_dict(self) -> dict[str, Any]:
        """The config as logged and stored: credentials in URIs removed."""
        data = self.to_dict()
        data["mlflow"]["tracking_uri"] = redact_uri(data["mlflow"]["tracking_uri"])
        if data["mlflow"]["artifact_location"]:
            data["mlflow"]["artifact_location"] = redact_uri(data["mlflow"]["artifact_location"])
        data["paths"] = {key: redact_uri(value) for key, value in data["paths"].items()}
        if data["spark"]["remote"]:
            data["spark"]["remote"] = redact_uri(data["spark"]["remote"])
        if data["export"]["redis_url"]:
            data["export"]["redis_url"] = redact_uri(data["export"]["redis_url"])
        data["serve"]["store"] = redact_uri(data["serve"]["store"])
        for key in ("url", "uris"):
            if data["output"]["metastore"][key]:
                data["output"]["metastore"][key] = redact_uri(data["output"]["metastore"][key])
        return data


# Environment variables the project honours, all read here and nowhere else (docs/configuration.md):
SPARK_REMOTE_ENV = "SPARK_REMOTE"                       # Spark Connect URL when spark.remote is unset
SHUFFLE_PARTITIONS_ENV = "RECSYS_SHUFFLE_PARTITIONS"    # spark.sql.shuffle.partitions of local sessions
CONNECT_WAIT_ENV = "RECSYS_CONNECT_WAIT_S"             # how long an unanswering Spark Connect server is waited for
LOG4J_CONF_ENV = "RECSYS_LOG4J_CONF"                   # the Spark JVM's log4j2 file (empty: Spark's own default)
# the checkout's log4j2 file, spark-submit.sh's default too (absent where the package runs from a zip or a wheel)
SHIPPED_LOG4J_CONF = Path(__file__).resolve().parent.parent / "conf" / "log4j2.properties"


class LaunchSettings(_Section):
    """How this process was launched: environment settings that shape the session, not the output.

    Kept out of :class:`Config` (and so out of its digest): where the job ran does not change what
    it publishes, and moving a job to Spark Connect must not make every date look changed.
    """

    spark_remote: str | None = None
    shuffle_partitions: int = Field(default=8, ge=1)
    connect_wait_s: float = Field(default=60.0, ge=0)
    log4j_conf: Path | None = None     # the log4j2 file of a Spark JVM this process starts (None: Spark's default)


def load_launch_settings(environ: Mapping[str, str] | None = None) -> LaunchSettings:
    """``SPARK_REMOTE``, ``RECSYS_SHUFFLE_PARTITIONS``, ``RECSYS_CONNECT_WAIT_S`` and ``RECSYS_LOG4J_CONF``
    from the environment, validated. ``RECSYS_LOG4J_CONF`` unset: the checkout's ``conf/log4j2.properties``
    where there is one (as ``spark-submit.sh``); empty: none (Spark's own default)."""
    env = os.environ if environ is None else environ
    log4j = env.get(LOG4J_CONF_ENV)
    if log4j is None:
        log4j_conf = SHIPPED_LOG4J_CONF if SHIPPED_LOG4J_CONF.is_file() else None
    elif not log4j.strip():
        log4j_conf = None
    elif Path(log4j).is_file():
        log4j_conf = Path(log4j).resolve()
    else:
        raise ConfigError(f"{LOG4J_CONF_ENV}={log4j!r} is not a file: name a log4j2 properties file, or set it empty "
                          f"for Spark's own logging")
    raw = env.get(SHUFFLE_PARTITIONS_ENV, "").strip()
    try:
        shuffle_partitions = int(raw) if raw else 8
    except ValueError:
        shuffle_partitions = 0
    wait = env.get(CONNECT_WAIT_ENV, "").strip()
    try:
        connect_wait_s = float(wait) if wait else 60.0
    except ValueError:
        raise ConfigError(f"{CONNECT_WAIT_ENV}={wait!r} must be a number of seconds (0 or more)") from None
    if shuffle_partitions < 1:
        raise ConfigError(f"{SHUFFLE_PARTITIONS_ENV}={raw!r} must be a positive integer")
    try:
        return LaunchSettings(spark_remote=env.get(SPARK_REMOTE_ENV, "").strip() or None,
                              shuffle_partitions=shuffle_partitions, connect_wait_s=connect_wait_s,
                              log4j_conf=log4j_conf)
    except ValidationError:
        raise ConfigError(f"{CONNECT_WAIT_ENV}={wait!r} must be a number of seconds (0 or more)") from None


def pack_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where packed environments are kept: ``RECSYS_PACK_CACHE``, else ``$XDG_CACHE_HOME/recsys/pack``
    (``~/.cache/recsys/pack``): outside the checkout, so every clone on the machine shares one archive."""
    env = os.environ if environ is None else environ
    if env.get("RECSYS_PACK_CACHE"):
        return Path(env["RECSYS_PACK_CACHE"])
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "recsys" / "pack"


def load_hooks(environ: Mapping[str, str] | None = None) -> "Hooks":
    """Test and game-day hooks from ``RECSYS_PAUSE_AT``, ``RECSYS_PAUSE_MAX_S`` and
    ``RECSYS_FAULT_INJECTION`` (docs/faults.md); all unset: no hooks. Called once, at the entry point."""
    from recsys.hooks import Hooks

    return Hooks.from_environ(os.environ if environ is None else environ)


def torchrun_place(environ: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process in a data-parallel group: the variables torchrun
    sets for the processes it starts (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; TorchDistributor starts
    them through torchrun), not settings. (0, 1, 0) in a process that torchrun did not start."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ConfigError(f"torchrun's RANK/WORLD_SIZE/LOCAL_RANK are not integers: {env.get('RANK')!r}, "
                          f"{env.get('WORLD_SIZE')!r}, {env.get('LOCAL_RANK')!r}") from None


def default_config_text() -> str:
    return resources.files("recsys").joinpath("default.yaml").read_text()


def load_config(conf_file: str | Path | None = None, overrides: Sequence[str] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """Merge the embedded default, an optional YAML file and ``key=value`` overrides, then validate.

    Before validation, every secret the merged settings and the environment hold is registered with
    :mod:`recsys.redaction`, so that no message from here on (this function's own errors included)
    quotes one. Raises ConfigError naming the offending key and value, so a scheduler log says what to fix.
    """
    data = yaml.safe_load(default_config_text())
    if conf_file is not None:
        path = Path(conf_file)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --conf")
        text = path.read_text()
        redaction.register(redaction.collect(text, {}))   # before parsing: a YAML error quotes the line
        try:
            user = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(redact_text(f"config file {str(path)!r} is not valid YAML: {exc}")) from None
        if not isinstance(user, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(user).__name__}")
        data = _deep_merge(data, user, prefix="")
    redaction.register(redaction.collect(list(overrides), {}))
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(data, key, value)
    redaction.register(redaction.collect(data, os.environ if environ is None else environ))
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc, data)) from None


# Keys that moved, with where they live now: named in the error instead of a bare "unknown key".
MOVED_KEYS = {f"train.model.{key}": f"train.model.<type>.{key}, e.g. train.model.sasrec.{key}"
              for key in ("dim", "layers", "heads", "max_len", "dropout")}


def _unknown_key(key: str, context: str) -> ConfigError:
    if key in MOVED_KEYS:
        return ConfigError(f"config key {key!r}{context} has moved to {MOVED_KEYS[key]} (docs/configuration.md)")
    return ConfigError(f"unknown config key {key!r}{context}; see docs/configuration.md")


# Sections whose keys are names the user chooses (validated by the section's model), not fixed keys.
OPEN_SECTIONS = frozenset({"guard.thresholds", "recommend.exclude.catalog", "recommend.include.catalog"})


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in over.items():
        dotted = f"{prefix}{key}"
        if key not in merged and prefix[:-1] in OPEN_SECTIONS:
            merged[key] = copy.deepcopy(value)
            continue
        if key not in merged:
            raise _unknown_key(dotted, "")
        if isinstance(merged[key], dict) and isinstance(value, Mapping) and dotted != "spark.conf":
            merged[key] = _deep_merge(merged[key], value, prefix=f"{dotted}.")
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(redact_text(f"override {item!r} must look like key=value, e.g. scoring.top_n=50"))
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, dict) and part not in node and ".".join(parts[:i]) in OPEN_SECTIONS:
            node[part] = {}
        if not isinstance(node, dict) or part not in node:
            raise _unknown_key(".".join(parts[: i + 1]), f" in --set {key}=...")
        node = node[part]
        if ".".join(parts[: i + 1]) == "spark.conf":  # free-form Spark settings
            node[".".join(parts[i + 1 :])] = value
            return
    opened = ".".join(parts[:-1]) in OPEN_SECTIONS or ".".join(parts[:-2]) in OPEN_SECTIONS
    if not isinstance(node, dict) or (parts[-1] not in node and not opened):
        raise _unknown_key(key, f" in --set {key}=...")
    node[parts[-1]] = value


def _describe_validation_error(exc: ValidationError, data: Mapping[str, Any]) -> str:
    problems = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")   # pydantic's prefix for a validator's ValueError
        # a check across sections (Config's own validator) names its keys itself; its input is the whole config
        problems.append(f"config key {key!r} = {err.get('input')!r}: {message}" if key else message)
    return redact_text("invalid configuration: " + "; ".join(problems) + " (fix it in the --conf file or with --set "
                       "KEY=VALUE)")
