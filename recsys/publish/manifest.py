"""``_manifest.json``, the document published with each partition: its record, its one reader and its one writer.

The manifest ties the data to its run (run id, model version, catalog snapshot, counts, config
digest, timings). The nightly stages assemble a :class:`Manifest` from their results
(:func:`recsys.pipelines.nightly_stages.manifest`); this module finishes it (format version, time,
package version, every string redacted), writes it into the partition (:func:`write`), reads it back
(:func:`read_at`, :func:`read`: the skip decision, the previous night, rollback, ``recsys runs``) and
rewrites it when the run's MLflow record failed after publishing. The copy logged to MLflow is the
same document (:meth:`Manifest.as_dict`).

Every manifest ever published still reads: the fields later formats added (``job_run``,
``publish_method`` and ``model.resolution`` with the date's lock; ``workers``; ``fallback`` with the
export; ``quality`` with the guard; ``rules`` with the operators' rules) are None when absent, and a document read and written again keeps
exactly its keys (absent ones stay absent, keys this version does not know are kept).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import pyarrow.fs as pafs

from recsys import __version__
from recsys import fs as rfs
from recsys.data.contracts import MANIFEST_NAME, SUCCESS_MARKER, partition_name
from recsys.redaction import redact_values

log = logging.getLogger(__name__)

NAME = MANIFEST_NAME
FORMAT_VERSION = 1


def _dict_without_none(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """The model version the night was scored with, and how the job found it."""

    uri: str | None = None
    name: str | None = None
    alias: str | None = None
    version: str | None = None
    source: str | None = None          # where its files came from (redacted)
    resolution: str | None = None      # "registry", or "remembered: <why>"; None in manifests before the date's lock

    def as_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "name": self.name, "alias": self.alias, "version": self.version,
                "source": self.source, **_dict_without_none(resolution=self.resolution)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelRef":
        version = data.get("version")
        return cls(uri=data.get("uri"), name=data.get("name"), alias=data.get("alias"),
                   version=None if version is None else str(version), source=data.get("source"),
                   resolution=data.get("resolution"))


@dataclass(frozen=True, kw_only=True)
class Counts:
    """Rows published and the counts behind them (None: not recorded in this manifest)."""

    rows: int | None = None
    users_in_window: int | None = None
    model_users: int | None = None
    fallback_users: int | None = None
    candidate_items: int | None = None
    events_read: int | None = None

    def as_dict(self) -> dict[str, int]:
        return _dict_without_none(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Counts":
        return cls(**{f.name: None if data.get(f.name) is None else int(data[f.name])
                      for f in dataclasses.fields(cls)})


@dataclass(frozen=True, kw_only=True)
class FallbackList:
    """The list users the model could not score got (``recsys export`` serves it to users without a row)."""

    name: str
    item_ids: tuple[int, ...]
    scores: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "item_ids": list(self.item_ids), "scores": list(self.scores)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FallbackList":
        return cls(name=str(data.get("name") or ""), item_ids=tuple(int(i) for i in data.get("item_ids") or ()),
                   scores=tuple(float(s) for s in data.get("scores") or ()))


@dataclass(frozen=True, kw_only=True)
class TrackingNote:
    """The MLflow store the run was recorded in, and why it was not (``error``; None: recorded)."""

    uri: str | None = None
    experiment: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "experiment": self.experiment, "error": self.error}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrackingNote":
        return cls(uri=data.get("uri"), experiment=data.get("experiment"), error=data.get("error"))


@dataclass(frozen=True, kw_only=True)
class NextNight:
    """What tomorrow's guard compares with, kept in tonight's manifest: the popularity ranking and the
    deciles of tonight's scores (None: no score was sampled)."""

    popularity_ranking: tuple[int, ...] = ()
    score_deciles: tuple[float, ...] | None = None
    score_decile_shares: tuple[float, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"popularity_ranking": list(self.popularity_ranking),
                **_dict_without_none(score_deciles=None if self.score_deciles is None else list(self.score_deciles),
                                     score_decile_shares=None if self.score_decile_shares is None
                                     else list(self.score_decile_shares))}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NextNight":
        def floats(key: str) -> tuple[float, ...] | None:
            return None if data.get(key) is None else tuple(float(x) for x in data[key])

        return cls(popularity_ranking=tuple(int(i) for i in data.get("popularity_ranking") or ()),
                   score_deciles=floats("score_deciles"), score_decile_shares=floats("score_decile_shares"))


@dataclass(frozen=True, kw_only=True)
class PreviousRef:
    """The published night tonight was compared with."""

    date: str
    run: str
    run_id: str | None
    rows: int
    model_version: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"date": self.date, "run": self.run, "run_id": self.run_id, "rows": self.rows,
                "model_version": self.model_version}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PreviousRef":
        version = data.get("model_version")
        return cls(date=str(data.get("date")), run=str(data.get("run") or ""), run_id=data.get("run_id"),
                   rows=int(data.get("rows") or 0), model_version=None if version is None else str(version))


@dataclass(frozen=True, kw_only=True)
class Quality:
    """The guard's section: the previous night, the date of the lists whose realized hit rate was measured,
    the verdict (:meth:`recsys.pipelines.guard.Verdict.as_dict`), and what the next night compares with."""

    previous: PreviousRef | None = None
    realized_for: str | None = None
    guard: Mapping[str, Any] = field(default_factory=dict)
    for_next_night: NextNight = NextNight()

    def as_dict(self) -> dict[str, Any]:
        return {"previous": None if self.previous is None else self.previous.as_dict(),
                "realized_for": self.realized_for, "guard": dict(self.guard),
                "for_next_night": self.for_next_night.as_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Quality":
        previous = data.get("previous")
        return cls(previous=PreviousRef.from_dict(previous) if previous else None,
                   realized_for=data.get("realized_for"), guard=dict(data.get("guard") or {}),
                   for_next_night=NextNight.from_dict(data.get("for_next_night") or {}))


# the document's keys, in the order the job writes them (MLflow's copy keeps it; the partition's is sorted)
KEYS = ("format_version", "date", "run_id", "job_run", "publish_method", "published_at", "recsys_version", "model",
        "catalog_snapshot", "config_digest", "rules", "counts", "validation", "fallback", "metrics", "timings",
        "tracking", "workers", "quality")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """One published night's ``_manifest.json``.

    Built by the nightly job with every field set; read back from any earlier format with the fields
    that format lacked None (or empty). ``extra``: keys this version does not know, kept as they were.
    """

    format_version: int = FORMAT_VERSION
    date: dt.date | None = None
    run_id: str | None = None                  # the MLflow run; None: not recorded (MLflow unreachable)
    job_run: str | None = None                 # the attempt that published it (its run directory's key)
    publish_method: str | None = None
    published_at: str | None = None            # UTC, ISO 8601, seconds
    recsys_version: str | None = None
    model: ModelRef = ModelRef()
    catalog_snapshot: dt.date | None = None
    config_digest: str | None = None
    rules: Mapping[str, Any] | None = None     # the operators' rules in effect (RecommendConfig.summary)
    counts: Counts = Counts()
    validation: Mapping[str, int] = field(default_factory=dict)    # check name -> violations (all 0 when published)
    fallback: FallbackList | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    tracking: TrackingNote = TrackingNote()
    workers: tuple[Mapping[str, Any], ...] | None = None   # each Python worker: interpreter, GPUs, tasks, model loads
    quality: Quality | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)   # keys the document read lacked

    @property
    def run(self) -> str:
        """The attempt that published it (the MLflow run id in manifests written before run keys)."""
        return str(self.job_run or self.run_id or "")

    def as_dict(self) -> dict[str, Any]:
        """The JSON document (what :func:`to_text` writes and MLflow keeps)."""
        values = {
            "format_version": self.format_version,
            "date": None if self.date is None else str(self.date),
            "run_id": self.run_id,
            "job_run": self.job_run,
            "publish_method": self.publish_method,
            "published_at": self.published_at,
            "recsys_version": self.recsys_version,
            "model": self.model.as_dict(),
            "catalog_snapshot": None if self.catalog_snapshot is None else str(self.catalog_snapshot),
            "config_digest": self.config_digest,
            "rules": None if self.rules is None else dict(self.rules),
            "counts": self.counts.as_dict(),
            "validation": dict(self.validation),
            "fallback": None if self.fallback is None else self.fallback.as_dict(),
            "metrics": dict(self.metrics),
            "timings": dict(self.timings),
            "tracking": self.tracking.as_dict(),
            "workers": None if self.workers is None else [dict(w) for w in self.workers],
            "quality": None if self.quality is None else self.quality.as_dict(),
        }
        optional = {"job_run", "publish_method", "rules", "fallback", "workers", "quality"}   # added by later formats
        out = {k: v for k, v in values.items() if k not in self.absent and not (k in optional and v is None)}
        return {**out, **self.extra}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Manifest":
        """Any manifest the job ever wrote (raises ValueError for a document that is not one)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a manifest is a JSON object, not {type(data).__name__}")

        def day(key: str) -> dt.date | None:
            return None if data.get(key) is None else dt.date.fromisoformat(str(data[key]))

        def section(key: str) -> Mapping[str, Any]:
            value = data.get(key) or {}
            if not isinstance(value, Mapping):
                raise ValueError(f"the manifest's {key!r} is not an object")
            return value

        try:
            return cls(
                format_version=int(data.get("format_version", FORMAT_VERSION)),
                date=day("date"),
                run_id=data.get("run_id"),
                job_run=None if data.get("job_run") is None else str(data["job_run"]),
                publish_method=data.get("publish_method"),
                published_at=data.get("published_at"),
                recsys_version=data.get("recsys_version"),
                model=ModelRef.from_dict(section("model")),
                catalog_snapshot=day("catalog_snapshot"),
                config_digest=data.get("config_digest"),
                rules=None if data.get("rules") is None else dict(section("rules")),
                counts=Counts.from_dict(section("counts")),
                validation={str(k): int(v) for k, v in section("validation").items()},
                fallback=FallbackList.from_dict(data["fallback"]) if data.get("fallback") else None,
                metrics=dict(section("metrics")),
                timings=dict(section("timings")),
                tracking=TrackingNote.from_dict(section("tracking")),
                workers=None if data.get("workers") is None else tuple(dict(w) for w in data["workers"]),
                quality=Quality.from_dict(data["quality"]) if data.get("quality") else None,
                extra={k: v for k, v in data.items() if k not in KEYS},
                absent=frozenset(k for k in KEYS if k not in data),
            )
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a manifest: {exc}") from None

    def with_tracking_error(self, error: str) -> "Manifest":
        return dataclasses.replace(self, tracking=dataclasses.replace(self.tracking, error=error))


def finish(draft: Manifest) -> Manifest:
    """The document to publish: ``draft`` with the format's own fields (version, time, package version),
    every string redacted.

    Redacted here (not only the URIs known to hold credentials), so the copy next to the data and the
    one in MLflow are the same document and neither holds a secret.
    """
    stamped = dataclasses.replace(draft, format_version=FORMAT_VERSION, recsys_version=__version__,
                                  published_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    return Manifest.from_dict(redact_values(stamped.as_dict()))


# ------------------------------------------------------------------------------------------------
# the writer


def to_text(manifest: Manifest) -> str:
    return json.dumps(manifest.as_dict(), indent=2, sort_keys=True, default=str)


def path_in(partition_dir: str) -> str:
    """Where the manifest of a partition directory (a path or URI) lives."""
    return rfs.join(partition_dir, NAME)


def write(partition_dir: str, manifest: Manifest) -> None:
    """Write (or replace) the manifest of a partition directory in one atomic step."""
    fs, path = rfs.resolve(path_in(partition_dir))
    rfs.write_text_atomic(fs, path, to_text(manifest))


def mark_unrecorded(partition_dirs: Sequence[str], manifest: Manifest, error: str | None) -> Manifest:
    """Say in the published manifest that its MLflow run was not recorded, if it does not already;
    returns the manifest as it now reads.

    The manifest is written before publishing; a tracking store that fails after that (while the
    run's figures and plots are recorded) would otherwise leave a manifest saying nothing went
    wrong, while the exit code is 5 and the MLflow run stays RUNNING. Rewritten atomically
    (temporary file and rename on local and HDFS stores), in each of ``partition_dirs``: the run
    directory and the path view.
    """
    if manifest.tracking.error or not error:
        return manifest
    manifest = manifest.with_tracking_error(error)
    for partition_dir in partition_dirs:
        try:
            write(partition_dir, manifest)
        except OSError as exc:
            log.warning("could not note the tracking failure in %s: %s", path_in(partition_dir), exc)
    return manifest


# ------------------------------------------------------------------------------------------------
# the reader


def parse(text: str) -> Manifest:
    """A manifest's JSON text -> the record (ValueError: not valid JSON, or not a manifest)."""
    return Manifest.from_dict(json.loads(text))


def read_in(fs: pafs.FileSystem, directory: str) -> Manifest | None:
    """The manifest of a complete directory (``_SUCCESS`` and the manifest present) on ``fs``, else None.

    A directory without ``_SUCCESS`` (only possible on object stores, after a kill mid-copy) counts as
    not published; so does one whose manifest cannot be read as one (logged).
    """
    if not rfs.exists(fs, rfs.join(directory, SUCCESS_MARKER)) or not rfs.exists(fs, rfs.join(directory, NAME)):
        return None
    try:
        return parse(rfs.read_text(fs, rfs.join(directory, NAME)))
    except ValueError as exc:
        log.warning("the manifest of %s is not readable (%s); treating it as not published", directory, exc)
        return None


def read_at(location: str) -> Manifest | None:
    """The manifest of the directory ``location`` (a path or URI), None if it is not complete."""
    fs, path = rfs.resolve(location)
    return read_in(fs, path)


def read(output_root: str, date: dt.date) -> Manifest | None:
    """The manifest of the path view ``dt=<date>/``, or None if nothing complete is published there."""
    return read_at(rfs.join(output_root, partition_name(date)))
