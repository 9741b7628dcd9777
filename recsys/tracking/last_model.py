"""The last model version the job resolved, remembered so a night survives an unreachable MLflow.

Resolving ``models:/<name>@<alias>`` needs the tracking store; a store that is down at night
would otherwise stop the recommendations, which do not depend on it. After every successful
resolution the job writes ``<paths.driver_scratch>/models/<name>/last-resolved@<alias>.json``
(version, source, local files: all on the driver's local disk, next to the download it names);
when the store cannot be reached, it scores with that version, says so in the log and the manifest
(``model.resolution``), and exits with TRACKING_FAILED (5).

The memo is bound to the tracking store it came from (:func:`~recsys.tracking.store.tracking_store_id`,
no credentials) and to the digest of the model files as resolved (:func:`recsys.fs.files_digest`). A
version number only means something in its own registry: a test's store, another checkout's or a
staging server's "recsys-default@champion version 1" once stood in for the demo's model (a toy model
published as "version 1", exit 5, which says "no need to rerun"). So a memo from another store,
files that changed or vanished since, and memos written before this binding (they carry neither)
are not used: the run stops as it would with nothing remembered (exit 1), its one error line saying
why.

The remembered version can be out of date if the alias moved while MLflow was down; that is the
trade-off, and why the exit code flags the run. Model versions are immutable, and the digest shows
that the remembered files are still exactly what was resolved. Nothing is remembered from a store
that answered "no such model": that is a configuration error, not an outage.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

from recsys import fs as rfs
from recsys.config import MlflowConfig
from recsys.errors import TrackingUnavailable, first_line
from recsys.tracking.store import ResolvedModel, resolve_model, tracking_store_id
from recsys.redaction import redact_uri

log = logging.getLogger(__name__)


def memo_path(scratch: Path, model_name: str, alias: str) -> str:
    """Where the resolution of ``models:/<model_name>@<alias>`` is remembered under the driver's scratch."""
    return str(Path(scratch) / "models" / model_name / f"last-resolved@{alias}.json")


def resolve_or_remembered(cfg: MlflowConfig, scratch: Path) -> tuple[ResolvedModel, str | None]:
    """(model, None) from the registry, or (remembered model, why) when the store is unreachable.

    ``scratch`` is the driver's local scratch directory (``paths.driver_scratch``): the model is
    downloaded under ``scratch/models`` and the resolution remembered next to it. Raises
    ModelNotFoundError when the store says the alias does not exist, and TrackingUnavailable when it
    is unreachable and nothing usable is remembered (its message says why the memo, if any, is not).
    """
    try:
        model = resolve_model(cfg, Path(scratch) / "models")
    except TrackingUnavailable as exc:
        remembered, why_not = recall(scratch, cfg.model_name, cfg.alias, cfg.tracking_uri)
        if remembered is None:
            raise TrackingUnavailable(f"{exc}; {why_not}, so nothing can be scored. Retry when the tracking "
                                      f"store is back") from None
        log.warning("MLflow is unreachable (%s); scoring with the last resolved version %s of %s, remembered at %s",
                    exc, remembered.version, remembered.uri, remembered.local_dir)
        return remembered, str(exc)
    remember(scratch, model, cfg.tracking_uri)
    return model, None


def remember(scratch: str | Path, model: ResolvedModel, tracking_uri: str) -> None:
    """Remember ``model`` as resolved just now from the store at ``tracking_uri``, with its files' digest.

    Failing to write the memo only loses the fallback for a later night, so it is a warning.
    """
    fs, path = rfs.resolve(memo_path(scratch, model.name, model.alias))
    try:
        record = {"name": model.name, "alias": model.alias, "version": model.version, "run_id": model.run_id,
                  "source": redact_uri(model.source), "local_dir": str(model.local_dir),
                  "tracking_store": tracking_store_id(tracking_uri), "files_digest": rfs.files_digest(model.local_dir),
                  "resolved_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        rfs.write_text_atomic(fs, path, json.dumps(record, indent=2))
    except OSError as exc:  # only the fallback is lost; the run itself is fine
        log.warning("could not remember the model resolution at %s: %s", path, exc)


def recall(scratch: str | Path, model_name: str, alias: str,
           tracking_uri: str) -> tuple[ResolvedModel | None, str | None]:
    """(the remembered resolution, None) if it may stand in for the registry's answer, else (None, why not).

    Usable only when it came from the store at ``tracking_uri`` and its files are still there with the
    digest they had when they were resolved; why-not names the memo and what to do.
    """
    where = memo_path(scratch, model_name, alias)
    fs, path = rfs.resolve(where)
    if not rfs.exists(fs, path):
        return None, f"no earlier resolution of models:/{model_name}@{alias} is remembered under {where}"
    try:
        record = json.loads(rfs.read_text(fs, path))
        model = ResolvedModel(name=record["name"], alias=record["alias"], version=str(record["version"]),
                              run_id=record.get("run_id"), source=record["source"],
                              local_dir=Path(record["local_dir"]))
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        return None, f"the remembered resolution {where} is unreadable ({first_line(exc, with_type=True)})"
    if (model.name, model.alias) != (model_name, alias):
        return None, (f"the resolution remembered in {where} is of {model.uri}, not models:/{model_name}@{alias}, "
                      f"so it is not used")
    store, digest = record.get("tracking_store"), record.get("files_digest")
    if not store or not digest:
        return None, (f"the resolution remembered in {where} (version {model.version}) does not say which tracking "
                      f"store it came from and what its files were (it predates both), so it is not trusted; run the "
                      f"job once with MLflow reachable to remember the model again")
    here = tracking_store_id(tracking_uri)
    if store != here:
        return None, (f"the resolution remembered in {where} (version {model.version}) came from the tracking store "
                      f"{store}, not this run's {here}, so it is not used: a version number means nothing in "
                      f"another registry")
    from recsys.model.io import CONFIG_FILE  # here: model.io imports torch, which this module does not need

    if not (model.local_dir / CONFIG_FILE).is_file():
        return None, f"the files of the remembered version {model.version} at {model.local_dir} are gone"
    try:
        now = rfs.files_digest(model.local_dir)
    except OSError as exc:
        return None, (f"the files of the remembered version {model.version} at {model.local_dir} cannot be read "
                      f"({first_line(exc, with_type=True)})")
    if now != digest:
        return None, (f"the files of the remembered version {model.version} at {model.local_dir} changed since "
                      f"they were resolved (digest {digest} then, {now} now), so they are not used")
    return model, None
