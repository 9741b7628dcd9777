"""The last model version the job resolved, remembered so a night survives an unreachable MLflow.

Resolving ``models:/<name>@<alias>`` needs the tracking store; a store that is down at night
would otherwise stop the recommendations, which do not depend on it. After every successful
resolution the job writes ``<paths.driver_scratch>/models/<name>/last-resolved@<alias>.json``
(version, source, local files: all on the driver's local disk, next to the download it names);
when the store cannot be reached, it scores with that version, says so in the log and the manifest (``model.resolution``), and exits with TRACKING_FAILED (5).

The remembered version can be out of date if the alias moved while MLflow was down; that is the
trade-off, and why the exit code flags the run. Model versions are immutable, so the remembered
files are still exactly that version. Nothing is remembered from a store that answered "no such
model": that is a configuration error, not an outage.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

from recsys import fs as rfs
from recsys.config import MlflowConfig
from recsys.errors import TrackingUnavailable
from recsys.tracking.store import ResolvedModel, resolve_model

log = logging.getLogger(__name__)


def memo_path(scratch: Path, model_name: str, alias: str) -> str:
    return str(Path(scratch) / "models" / model_name / f"last-resolved@{alias}.json")


def resolve_or_remembered(cfg: MlflowConfig, scratch: Path) -> tuple[ResolvedModel, str | None]:
    """(model, None) from the registry, or (remembered model, why) when the store is unreachable.

    ``scratch`` is the driver's local scratch directory (``paths.driver_scratch``): the model is
    downloaded under ``scratch/models`` and the resolution remembered next to it. Raises
    ModelNotFoundError when the store says the alias does not exist, and TrackingUnavailable when it
    is unreachable and nothing usable is remembered.
    """
    try:
        model = resolve_model(cfg, Path(scratch) / "models")
    except TrackingUnavailable as exc:
        remembered = recall(scratch, cfg.model_name, cfg.alias)
        if remembered is None:
            raise TrackingUnavailable(
                f"{exc}; no earlier resolution of models:/{cfg.model_name}@{cfg.alias} is remembered under "
                f"{memo_path(scratch, cfg.model_name, cfg.alias)}, so nothing can be scored. Retry when the "
                f"tracking store is back"
            ) from None
        log.warning("MLflow is unreachable (%s); scoring with the last resolved version %s of %s, remembered at %s",
                    exc, remembered.version, remembered.uri, remembered.local_dir)
        return remembered, str(exc)
    remember(scratch, model)
    return model, None


def remember(scratch: str, model: ResolvedModel) -> None:
    fs, path = rfs.resolve(memo_path(scratch, model.name, model.alias))
    record = {"name": model.name, "alias": model.alias, "version": model.version, "run_id": model.run_id,
              "source": model.source, "local_dir": str(model.local_dir),
              "resolved_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        rfs.write_text_atomic(fs, path, json.dumps(record, indent=2))
    except OSError as exc:  # only the fallback is lost; the run itself is fine
        log.warning("could not remember the model resolution at %s: %s", path, exc)


def recall(scratch: str, model_name: str, alias: str) -> ResolvedModel | None:
    """The remembered resolution, if its model files are still there."""
    fs, path = rfs.resolve(memo_path(scratch, model_name, alias))
    if not rfs.exists(fs, path):
        return None
    try:
        record = json.loads(rfs.read_text(fs, path))
        model = ResolvedModel(name=record["name"], alias=record["alias"], version=str(record["version"]),
                              run_id=record.get("run_id"), source=record["source"],
                              local_dir=Path(record["local_dir"]))
    except (ValueError, KeyError, TypeError, OSError) as exc:
        log.warning("ignoring the unreadable model resolution memo %s: %s", path, exc)
        return None
    from recsys.model.io import CONFIG_FILE  # here: model.io imports torch, which this module does not need

    if not (model.local_dir / CONFIG_FILE).is_file():
        log.warning("the remembered model files %s are gone; cannot fall back to version %s",
                    model.local_dir, model.version)
        return None
    return model
