"""Staged, all-or-nothing publishing of one date's partition, with its manifest, and recovery after a kill.

Layout under ``paths.output``::

    dt=YYYY-MM-DD/                 the published partition: part-*.parquet, _SUCCESS, _manifest.json
    _staging/dt=YYYY-MM-DD/<run>/  where Spark writes a run's output before validation
    _trash/dt=YYYY-MM-DD.<run>/    the replaced partition, during a two-rename publish only
    _locks/                        per-date locks (recsys.publish.lock)

Spark and Hive skip directories whose names start with ``_``, so readers of the dataset never
list staging, trash or locks. The partition directory is complete (data, ``_SUCCESS`` and
manifest) before it replaces the published one; how it replaces it depends on the store
(:mod:`recsys.publish.swap`): in one step on a local filesystem, in two renames on HDFS, by copy
with ``_SUCCESS`` last on object stores.

Every function here that changes a date's directories must run under that date's lock
(:class:`recsys.publish.lock.DateLock`): that is what makes "whatever is in ``_staging/dt=D`` belongs
to a dead run" true in :func:`recover`.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from recsys import fs as rfs
from recsys.config import PathsConfig
from recsys.data.contracts import SUCCESS_MARKER, partition_name
from recsys.errors import ConfigError
from recsys.hooks import NO_HOOKS, Hooks
from recsys.publish import manifest as manifest_file
from recsys.publish import swap
from recsys.uris import is_local_path, local_path, redact_uri

log = logging.getLogger(__name__)

STAGING_DIR = "_staging"
TRASH_DIR = "_trash"


@dataclass(frozen=True)
class PartitionLayout:
    output_root: str
    date: dt.date
    run_key: str   # unique per attempt, minted by the job before anything is written

    @property
    def final_dir(self) -> str:
        return rfs.join(self.output_root, partition_name(self.date))

    @property
    def staging_root(self) -> str:
        """Every run's staging directory for this date lives under here."""
        return rfs.join(self.output_root, STAGING_DIR, partition_name(self.date))

    @property
    def staging_dir(self) -> str:
        return rfs.join(self.staging_root, self.run_key)

    @property
    def trash_dir(self) -> str:
        return rfs.join(self.output_root, TRASH_DIR, f"{partition_name(self.date)}.{self.run_key}")


def check_output_location(paths: PathsConfig) -> None:
    """Refuse an output root that overlaps the inputs or the work directory.

    Publishing replaces and deletes directories under ``paths.output``; pointed at (or into, or
    above) an input dataset, it would destroy it.
    """
    out = _normalised(paths.output)
    for key in ("events", "catalog", "work"):
        other = _normalised(getattr(paths, key))
        if out == other or out.startswith(other + "/") or other.startswith(out + "/"):
            raise ConfigError(
                f"paths.output={redact_uri(paths.output)!r} overlaps paths.{key}={redact_uri(getattr(paths, key))!r}; "
                f"publishing replaces "
                f"directories under paths.output, so it must be a directory of its own"
            )


def _normalised(path: str) -> str:
    return str(local_path(path)) if is_local_path(path) else path.rstrip("/")


def publish_method(layout: PartitionLayout) -> swap.Method:
    """How this layout's partition will be replaced; local filesystems are probed for the swap."""
    method = swap.method_for(layout.output_root)
    if method == "exchange":
        root = local_path(layout.output_root)
        root.mkdir(parents=True, exist_ok=True)
        if not swap.exchange_supported(str(root)):
            log.warning("the filesystem of %s does not support renameat2(RENAME_EXCHANGE); publishing with two "
                        "renames (a moment without a partition; recovered after a kill)", root)
            return "rename"
    return method


def publish(layout: PartitionLayout, manifest: dict[str, Any], method: swap.Method | None = None,
            hooks: Hooks = NO_HOOKS) -> str:
    """Put the validated staging directory in place as the date's partition; returns its path.

    The manifest goes into the staging directory first, so the partition appears with it. On
    return the replaced partition is gone and nothing of this run is left in staging. ``hooks``
    may hold the publish at a pause point (tests and game days, :mod:`recsys.hooks`).
    """
    method = method or publish_method(layout)
    fs, staging = rfs.resolve(layout.staging_dir)
    _, final = rfs.resolve(layout.final_dir)
    if not rfs.exists(fs, rfs.join(staging, SUCCESS_MARKER)):
        raise RuntimeError(f"staging directory {layout.staging_dir} has no {SUCCESS_MARKER}; refusing to publish")
    text = manifest_file.to_text(manifest)
    if method == "copy":
        _publish_by_copy(fs, staging, final, text, hooks)
    else:
        rfs.write_text_atomic(fs, manifest_file.path_in(staging), text)
        hooks.pause("before_swap")
        if method == "exchange":
            _publish_by_exchange(staging, final, hooks)
        else:
            _publish_by_renames(fs, staging, final, rfs.resolve(layout.trash_dir)[1], hooks)
    _remove_if_empty(fs, rfs.resolve(layout.staging_root)[1])
    return layout.final_dir


def _publish_by_exchange(staging: str, final: str, hooks: Hooks) -> None:
    try:
        swap.exchange(staging, final)      # staging now holds the old partition
    except FileNotFoundError:
        swap.rename_noreplace(staging, final)   # first publish of this date
        return
    hooks.pause("after_swap")
    rfs.delete_dir_if_exists(pafs.LocalFileSystem(), staging)


def _publish_by_renames(fs: pafs.FileSystem, staging: str, final: str, trash: str, hooks: Hooks) -> None:
    if rfs.exists(fs, final):
        fs.create_dir(trash.rsplit("/", 1)[0], recursive=True)
        fs.move(final, trash)
        hooks.pause("between_renames")
    fs.move(staging, final)
    hooks.pause("after_swap")
    rfs.delete_dir_if_exists(fs, trash)


def _publish_by_copy(fs: pafs.FileSystem, staging: str, final: str, manifest_text: str, hooks: Hooks) -> None:
    """Object stores: remove the old partition, copy the data, then manifest and ``_SUCCESS`` last."""
    rfs.delete_dir_if_exists(fs, final)
    fs.create_dir(final, recursive=True)
    infos = fs.get_file_info(pafs.FileSelector(staging, recursive=True))
    for info in infos:
        if info.type == pafs.FileType.File and not info.base_name.startswith(("_", ".")):
            fs.copy_file(info.path, rfs.join(final, info.path[len(staging):]))
    with fs.open_output_stream(manifest_file.path_in(final)) as f:
        f.write(manifest_text.encode())
    hooks.pause("after_swap")
    with fs.open_output_stream(rfs.join(final, SUCCESS_MARKER)) as f:
        f.write(b"")
    rfs.delete_dir_if_exists(fs, staging)


def recover(layout: PartitionLayout) -> list[str]:
    """Undo what a killed run of this date left behind; returns what was done, for the log.

    Run under the date's lock, before anything else: a partition moved to ``_trash/`` by a run
    killed between two renames is put back (the date then has its old partition again), other
    trash is deleted, and every staging directory of the date is removed (the lock guarantees
    their runs are dead).
    """
    fs, final = rfs.resolve(layout.final_dir)
    _, trash_root = rfs.resolve(rfs.join(layout.output_root, TRASH_DIR))
    notes = []
    prefix = f"{partition_name(layout.date)}."
    trashed = sorted((i for i in _list(fs, trash_root) if i.base_name.startswith(prefix)),
                     key=lambda i: i.mtime_ns or 0)
    if trashed and not rfs.exists(fs, final):
        newest = trashed.pop()
        fs.move(newest.path, final)
        notes.append(f"restored {layout.final_dir} from {newest.path}: a run was killed while replacing it")
    for info in trashed:
        fs.delete_dir(info.path)
        notes.append(f"removed {info.path}, left by a killed run")
    _, staging_root = rfs.resolve(layout.staging_root)
    for info in _list(fs, staging_root):
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(info.path)
            notes.append(f"removed staging directory {info.path}, left by a killed run")
    _remove_if_empty(fs, staging_root)
    if rfs.is_dir(fs, final) and not rfs.exists(fs, rfs.join(final, SUCCESS_MARKER)):
        notes.append(f"{layout.final_dir} has no {SUCCESS_MARKER} (a copy interrupted on an object store); "
                     f"this run replaces it")
    return notes


def discard_staging(layout: PartitionLayout) -> None:
    fs, staging = rfs.resolve(layout.staging_dir)
    rfs.delete_dir_if_exists(fs, staging)
    _remove_if_empty(fs, rfs.resolve(layout.staging_root)[1])


def _list(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    if not rfs.is_dir(fs, path):
        return []
    return fs.get_file_info(pafs.FileSelector(path))


def _remove_if_empty(fs: pafs.FileSystem, path: str) -> None:
    """Tidy ``_staging/dt=.../`` once its last run directory is gone (best effort)."""
    try:
        if rfs.is_dir(fs, path) and not fs.get_file_info(pafs.FileSelector(path)):
            fs.delete_dir(path)
    except OSError:
        pass
