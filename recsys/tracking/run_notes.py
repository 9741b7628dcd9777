"""What makes a nightly MLflow run readable on its own: a note, its inputs as datasets, and a link from the model.

- **The note** (MLflow's run description, the ``mlflow.note.content`` tag) says in a sentence or
  two what the run did, so the runs list and the run page answer "what happened that night"
  without opening metrics.
- **Datasets** (``mlflow.log_input``): the events window and the catalog snapshot, each with its
  source (the partitions' location) and a digest of the files read (paths, sizes, modification
  times), so two runs can be told to have read the same inputs or not, without reading the data.
- **The model version's link back**: a tag ``recsys.used_by.<date>`` = run id on the model
  version, so the registry page of a version lists the nights that scored with it (a rerun of a
  date replaces that date's tag, so the tags stay one per date).

Every call goes through :class:`recsys.tracking.store.RunRecorder`, so a tracking store that fails
here degrades the run to exit code 5 like any other recording failure, never fails the job.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from recsys import fs as rfs
from recsys.config import HistoryConfig, PathsConfig
from recsys.data.contracts import partition_name
from recsys.errors import first_line
from recsys.tracking import tags
from recsys.redaction import redact_text, redact_uri

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Inputs:
    """Where a run's inputs live: what its MLflow datasets describe."""

    events_root: str
    catalog_root: str
    window_days: int

    @classmethod
    def of(cls, paths: PathsConfig, history: HistoryConfig) -> "Inputs":
        return cls(paths.events, paths.catalog, history.window_days)


@dataclass(frozen=True)
class TrainingSummary:
    """What a training run's note says: what was trained on how much, how well, and the gate's decision."""

    model_type: str
    users: int
    items: int                        # in the vocabulary
    metrics: Mapping[str, float]
    model_name: str
    version: str
    decision: str
    kind: str = "full"                # full | warm (recsys.pipelines.train.TrainingPlan)
    kind_reason: str = ""             # why that kind


def note(manifest: Mapping[str, Any], metrics: Mapping[str, float]) -> str:
    """A sentence or two summarising a published run, for MLflow's run description."""
    counts = manifest.get("counts", {})
    model = manifest.get("model", {})
    timings = manifest.get("timings", {})
    slowest = max(timings.items(), key=lambda kv: kv[1], default=None)
    users_per_s = metrics.get("users_per_s")
    text = (
        f"Published recommendations for {manifest.get('date')}: {counts.get('rows', 0):,} users "
        f"({counts.get('model_users', 0):,} scored by model version {model.get('version')} of {model.get('name')}, "
        f"{counts.get('fallback_users', 0):,} by the popularity fallback) from catalog snapshot "
        f"{manifest.get('catalog_snapshot')} ({counts.get('candidate_items', 0):,} candidate items)."
    )
    tail = [f"{metrics['total_s']:.1f} s in all" if "total_s" in metrics else None,
            f"{users_per_s:,.0f} users/s while scoring" if users_per_s else None,
            f"slowest stage {slowest[0].removeprefix('stage_').removesuffix('_s')} ({slowest[1]:.1f} s)"
            if slowest else None]
    problems = {k: int(metrics[k]) for k in ("dropped_null_user_id", "dropped_null_item_id", "unknown_items",
                                              "nonfinite_users", "task_retries") if metrics.get(k)}
    tail.append("no data problems counted" if not problems
                else "counted: " + ", ".join(f"{k} {v:,}" for k, v in problems.items()))
    if model.get("resolution", "registry") != "registry":
        tail.append(f"model resolution: {model['resolution']}")
    return text + " " + "; ".join(t for t in tail if t) + ". Validation passed."


def failure_tags(date: dt.date, exc: BaseException, cause: str | None = None) -> dict[str, str]:
    """The exit code the run ends with and a note saying why, for a run that failed before publishing. ``cause``:
    the one line for a cause Spark hid (``recsys.spark.failures.spark_cause``), said instead of the error's."""
    from recsys.errors import ExitCode, RecsysError

    code = int(exc.exit_code) if isinstance(exc, RecsysError) else int(ExitCode.UNEXPECTED_ERROR)
    first = (redact_text(cause)[:1000] if cause
             else first_line(exc, with_type=not isinstance(exc, RecsysError), limit=1000))
    return {tags.EXIT_CODE: str(code),
            tags.NOTE: f"Failed for {date} with exit code {code} ({ExitCode(code).name.lower()}), nothing "
                      f"published: {first}"}


def partition_files_digest(root: str, dates: list[dt.date]) -> tuple[str, int, int]:
    """(digest, files, bytes) of the data files of ``root``'s ``dt=`` partitions for ``dates``.

    Paths relative to ``root``, sizes and modification times: cheap (a listing, no reads) and
    changes whenever an upstream export rewrites a partition.
    """
    fs, base = rfs.resolve(root)
    from pyarrow import fs as pafs

    h = hashlib.sha256()
    files = size = 0
    for date in sorted(dates):
        part = rfs.join(base, partition_name(date))
        info = fs.get_file_info(part)
        if info.type != pafs.FileType.Directory:
            continue
        for entry in sorted(fs.get_file_info(pafs.FileSelector(part, recursive=True)), key=lambda e: e.path):
            if entry.type != pafs.FileType.File:
                continue
            rel = entry.path[len(base):].lstrip("/")
            if any(p.startswith(("_", ".")) for p in rel.split("/")[1:]):
                continue
            h.update(f"{rel}\0{entry.size}\0{entry.mtime_ns}\n".encode())
            files += 1
            size += entry.size or 0
    return h.hexdigest()[:16], files, size


def events_dataset(events_root: str, date: dt.date, window_days: int) -> Any:
    """The events window before ``date`` as an MLflow dataset: its partitions' location and files' digest."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.spark_dataset_source import SparkDatasetSource
    from mlflow.types import ColSpec, Schema

    from recsys.data.contracts import EVENTS_SCHEMA

    start = date - dt.timedelta(days=window_days)
    window = [d for d in _partition_dates(events_root) if start <= d < date]
    digest, files, size = partition_files_digest(events_root, window)
    first, last = (str(window[0]), str(window[-1])) if window else ("none", "none")
    log.debug("events dataset: %d partitions, %d files, %d bytes", len(window), files, size)
    return MetaDataset(
        SparkDatasetSource(path=redact_uri(events_root)),
        name=f"events {first}..{last}",
        digest=digest,
        schema=Schema([ColSpec(_mlflow_type(f.type), f.name) for f in EVENTS_SCHEMA]),
    )


def input_datasets(inputs: Inputs, date: dt.date, catalog_date: dt.date) -> list[tuple[Any, str]]:
    """(MLflow dataset, context) for the events window and the catalog snapshot a run read."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.spark_dataset_source import SparkDatasetSource
    from mlflow.types import ColSpec, Schema

    from recsys.data.contracts import CATALOG_SCHEMA

    events = events_dataset(inputs.events_root, date, inputs.window_days)
    catalog_root = inputs.catalog_root
    cat_digest, cat_files, cat_bytes = partition_files_digest(catalog_root, [catalog_date])
    catalog = MetaDataset(
        SparkDatasetSource(path=redact_uri(rfs.join(catalog_root, partition_name(catalog_date)))),
        name=f"catalog {catalog_date}",
        digest=cat_digest,
        schema=Schema([ColSpec(_mlflow_type(f.type), f.name) for f in CATALOG_SCHEMA]),
    )
    log.debug("catalog dataset: %d files, %d bytes", cat_files, cat_bytes)
    return [(events, "events window"), (catalog, "catalog snapshot")]


def _partition_dates(root: str) -> list[dt.date]:
    from recsys.data.partitions import list_partitions

    try:
        _, parts = list_partitions(root, "events")
    except Exception:   # the run read them a moment ago; a listing failure here only loses the dataset
        return []
    return [p.date for p in parts]


def _mlflow_type(arrow_type: Any) -> str:
    import pyarrow as pa

    if pa.types.is_integer(arrow_type):
        return "long"
    if pa.types.is_boolean(arrow_type):
        return "boolean"
    if pa.types.is_floating(arrow_type):
        return "double"
    if pa.types.is_timestamp(arrow_type):
        return "datetime"
    return "string"


def record(recorder: Any, manifest: Mapping[str, Any], metrics: Mapping[str, float], inputs: Inputs) -> None:
    """Note, input datasets and the model version's link back, for a published run."""
    if recorder.run_id is None or recorder.failed:
        return
    date = dt.date.fromisoformat(str(manifest["date"]))
    recorder.set_tags({tags.NOTE: note(manifest, metrics), tags.EXIT_CODE: "0"})
    try:
        datasets = input_datasets(inputs, date, dt.date.fromisoformat(str(manifest["catalog_snapshot"])))
    except Exception as exc:   # describing the inputs must never cost the run
        log.warning("could not describe the run's input datasets: %s", exc)
        datasets = []
    for dataset, context in datasets:
        recorder.log_input(dataset, context)
    model = manifest.get("model", {})
    if model.get("name") and model.get("version") and not recorder.failed:
        try:   # a convenience on the registry side: its failure is a warning, not an unrecorded run
            from mlflow import MlflowClient

            MlflowClient().set_model_version_tag(model["name"], str(model["version"]), f"{tags.USED_BY_PREFIX}{date}",
                                                 recorder.run_id)
        except Exception as exc:
            log.warning("could not tag model version %s of %s with run %s: %s", model["version"], model["name"],
                        recorder.run_id, first_line(exc))


def record_training(recorder: Any, date: dt.date, inputs: Inputs, summary: TrainingSummary) -> None:
    """A training run's note (what was trained on what, how well, what the gate decided) and its events dataset."""
    if recorder.run_id is None or recorder.failed:
        return
    s = summary
    ndcg = next((v for k, v in s.metrics.items() if k.startswith("val_ndcg")), None)
    recorder.set_tags({tags.NOTE: (
        f"Trained {s.model_type} on the events before {date} ({s.users:,} users, {s.items:,} items in the vocabulary), "
        f"{s.kind} training" + (f" ({s.kind_reason})" if s.kind_reason else "") + "; "
        f"best epoch {int(s.metrics.get('best_epoch', 0))}"
        + (f", validation NDCG@10 {ndcg:.4f}" if ndcg is not None else "")
        + f". Registered as version {s.version} of {s.model_name}; {s.decision}.")})
    try:
        recorder.log_input(events_dataset(inputs.events_root, date, inputs.window_days), "training")
    except Exception as exc:
        log.warning("could not describe the training run's input dataset: %s", exc)
