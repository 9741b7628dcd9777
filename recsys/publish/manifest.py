"""``_manifest.json``, the document published with each partition: its one home.

The manifest ties the data to its run (run id, model version, catalog snapshot, counts, config
digest, timings). The nightly stages assemble its content (:func:`recsys.pipelines.nightly_stages.manifest`);
this module finishes it (format version, time, package version, every string redacted), writes it
into the partition, reads it back (the skip decision, ``recsys runs``) and rewrites it when the run's
MLflow record failed after publishing. The copy logged to MLflow is the same document.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any, Mapping, Sequence

from recsys import __version__
from recsys import fs as rfs
from recsys.data.contracts import MANIFEST_NAME, SUCCESS_MARKER, partition_name
from recsys.uris import redact_values

log = logging.getLogger(__name__)

NAME = MANIFEST_NAME
FORMAT_VERSION = 1

Manifest = dict[str, Any]


def finish(content: Mapping[str, Any]) -> Manifest:
    """The document to publish: ``content`` with the format's own fields, every string redacted.

    Redacted here (not only the URIs known to hold credentials), so the copy next to the data and the
    one in MLflow are the same document and neither holds a secret.
    """
    return redact_values({
        "format_version": FORMAT_VERSION,
        "date": content["date"],
        "run_id": content["run_id"],
        "job_run": content["job_run"],
        "publish_method": content["publish_method"],
        "published_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "recsys_version": __version__,
        **{k: v for k, v in content.items() if k not in ("date", "run_id", "job_run", "publish_method")},
    })


def to_text(manifest: Mapping[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True, default=str)


def path_in(partition_dir: str) -> str:
    """Where the manifest of a partition directory (a path or URI) lives."""
    return rfs.join(partition_dir, NAME)


def read(output_root: str, date: dt.date) -> Manifest | None:
    """The manifest of the published partition for ``date``, or None if nothing complete is published.

    A partition without ``_SUCCESS`` (only possible on object stores, after a kill mid-copy) counts
    as not published; so does one whose manifest is not valid JSON (logged).
    """
    fs, root = rfs.resolve(output_root)
    part = rfs.join(root, partition_name(date))
    if not rfs.exists(fs, rfs.join(part, SUCCESS_MARKER)) or not rfs.exists(fs, path_in(part)):
        return None
    try:
        return json.loads(rfs.read_text(fs, path_in(part)))
    except ValueError:
        log.warning("the manifest of %s is not valid JSON; treating the date as not published", part)
        return None


def mark_unrecorded(partition_dirs: Sequence[str], manifest: Manifest, error: str | None) -> None:
    """Say in the published manifest that its MLflow run was not recorded, if it does not already.

    The manifest is written before publishing; a tracking store that fails after that (while the
    run's figures and plots are recorded) would otherwise leave a manifest saying nothing went
    wrong, while the exit code is 5 and the MLflow run stays RUNNING. Rewritten atomically
    (temporary file and rename on local and HDFS stores), in each of ``partition_dirs``: the run
    directory and the path view.
    """
    tracking = manifest.setdefault("tracking", {})
    if tracking.get("error") or not error:
        return
    tracking["error"] = error
    for partition_dir in partition_dirs:
        try:
            fs, path = rfs.resolve(path_in(partition_dir))
            rfs.write_text_atomic(fs, path, to_text(manifest))
        except OSError as exc:
            log.warning("could not note the tracking failure in %s: %s", path_in(partition_dir), exc)
