"""Staged, all-or-nothing publishing of one date's partition, with its manifest.

Layout under ``paths.output``::

    dt=YYYY-MM-DD/               the published partition: part-*.parquet, _SUCCESS, _manifest.json
    _staging/dt=YYYY-MM-DD/<run> where Spark writes a run's output before validation
    _trash/                      the partition a republish replaced, until the swap completes

Spark and Hive skip directories whose names start with ``_``, so readers of the dataset never
list staging or trash. The partition directory is complete (data, ``_SUCCESS`` and manifest)
before it is renamed into place; on a local or HDFS filesystem the rename is atomic.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from typing import Any

from recsys.data.contracts import MANIFEST_NAME, SUCCESS_MARKER, partition_name
from recsys.publish import fs as rfs

log = logging.getLogger(__name__)

STAGING_DIR = "_staging"
TRASH_DIR = "_trash"


@dataclass(frozen=True)
class PartitionLayout:
    output_root: str
    date: dt.date
    run_key: str   # unique per attempt: the MLflow run id, or a generated id without tracking

    @property
    def final_dir(self) -> str:
        return rfs.join(self.output_root, partition_name(self.date))

    @property
    def staging_dir(self) -> str:
        return rfs.join(self.output_root, STAGING_DIR, partition_name(self.date), self.run_key)

    @property
    def trash_dir(self) -> str:
        return rfs.join(self.output_root, TRASH_DIR, f"{partition_name(self.date)}.{self.run_key}")


def read_manifest(output_root: str, date: dt.date) -> dict[str, Any] | None:
    """The manifest of the published partition for ``date``, or None if nothing is published."""
    fs, root = rfs.resolve(output_root)
    path = rfs.join(root, partition_name(date), MANIFEST_NAME)
    if not rfs.exists(fs, path):
        return None
    return json.loads(rfs.read_text(fs, path))


def publish(layout: PartitionLayout, manifest: dict[str, Any]) -> str:
    """Move the validated staging directory into place as the date's partition; returns its path.

    The manifest is written into the staging directory first, so the partition appears with it.
    A previously published partition for the date is moved to trash before the swap and deleted
    after it.
    """
    fs, staging = rfs.resolve(layout.staging_dir)
    _, final = rfs.resolve(layout.final_dir)
    _, trash = rfs.resolve(layout.trash_dir)
    if not rfs.exists(fs, rfs.join(staging, SUCCESS_MARKER)):
        raise RuntimeError(f"staging directory {layout.staging_dir} has no {SUCCESS_MARKER}; refusing to publish")
    rfs.write_text_atomic(fs, rfs.join(staging, MANIFEST_NAME), json.dumps(manifest, indent=2, sort_keys=True, default=str))
    if rfs.exists(fs, final):
        fs.create_dir(trash.rsplit("/", 1)[0], recursive=True)
        fs.move(final, trash)
    fs.move(staging, final)
    rfs.delete_dir_if_exists(fs, trash)
    _remove_empty_parents(fs, staging)
    return layout.final_dir


def discard_staging(layout: PartitionLayout) -> None:
    fs, staging = rfs.resolve(layout.staging_dir)
    rfs.delete_dir_if_exists(fs, staging)
    _remove_empty_parents(fs, staging)


def _remove_empty_parents(fs, path: str) -> None:
    """Tidy ``_staging/dt=.../`` once its last run directory is gone (best effort)."""
    parent = path.rsplit("/", 1)[0]
    try:
        if rfs.is_dir(fs, parent) and not rfs.list_dirs(fs, parent):
            from pyarrow.fs import FileSelector

            if not fs.get_file_info(FileSelector(parent)):
                fs.delete_dir(parent)
    except OSError:
        pass
