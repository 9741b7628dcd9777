"""Publishing one date's night: its run directory, the commit point, the path view; recovery after a kill.

Layout under ``paths.output`` (:mod:`recsys.publish.published` has the run directories and pointers)::

    _runs/dt=YYYY-MM-DD/run=<key>/      where Spark writes a run's output; kept once published
    _runs/dt=YYYY-MM-DD/_published.json the date's pointer
    dt=YYYY-MM-DD/                      the path view: part-*.parquet, _SUCCESS, _manifest.json of the published run
    _staging/dt=YYYY-MM-DD/<key>/       a copy of a run being swapped into the path view
    _trash/dt=YYYY-MM-DD.<key>/         the replaced path view, during a two-rename swap only
    _locks/                             per-date locks (recsys.publish.lock)

Publishing, in this order, each step atomic and each a pause point a test can kill the job at
(docs/faults.md): the manifest into the run directory (``before_swap``); the table's partition pointed
at the run directory, one metastore operation (``after_table``): the commit point with a table; the
pointer rewritten in one atomic write (``after_pointer``): the commit point without one; the path view
replaced as the store allows (:mod:`recsys.publish.swap`: one ``renameat2`` exchange on a local disk,
two renames on HDFS, a copy with ``_SUCCESS`` last on object stores; ``between_renames``,
``after_swap``). A kill between two steps leaves every reader of each pointer the old night or the
new one; :func:`recover`, run by the next run of the date before anything else, brings the later
steps in line with the commit point.

Every function here that changes a date's directories must run under that date's lock
(:class:`recsys.publish.lock.DateLock`): that is what makes "a run directory that was never published
belongs to a dead run" true in :func:`recover`.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow.fs as pafs

from recsys import fs as rfs
from recsys.config import PathsConfig
from recsys.data.contracts import SUCCESS_MARKER, partition_name
from recsys.errors import ConfigError
from recsys.hooks import NO_HOOKS, Hooks
from recsys.publish import manifest as manifest_file
from recsys.publish.manifest import Manifest
from recsys.publish import swap
from recsys.publish.published import (Pointer, PublishedPartition, is_complete, kept_runs, read_pointer, run_dir,
                                      run_of, runs_root, view_dir, write_pointer)
from recsys.uris import is_local_path, local_path
from recsys.redaction import redact_uri

log = logging.getLogger(__name__)

STAGING_DIR = "_staging"
TRASH_DIR = "_trash"


@dataclass(frozen=True)
class PartitionLayout:
    output_root: str
    date: dt.date
    run_key: str   # unique per attempt, minted by the job before anything is written; starts with its UTC start time

    @property
    def final_dir(self) -> str:
        """The path view ``dt=D/``."""
        return view_dir(self.output_root, self.date)

    @property
    def run_dir(self) -> str:
        """This run's directory: Spark writes here, and a published run stays here."""
        return run_dir(self.output_root, self.date, self.run_key)

    @property
    def staging_dir(self) -> str:
        """Where this run's output is written before it is validated: its run directory."""
        return self.run_dir

    @property
    def staging_root(self) -> str:
        """Copies of runs being swapped into the path view live under here."""
        return rfs.join(self.output_root, STAGING_DIR, partition_name(self.date))

    @property
    def view_staging_dir(self) -> str:
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


def publish(layout: PartitionLayout, manifest: Manifest, method: swap.Method | None = None,
            hooks: Hooks = NO_HOOKS, table: Any = None,
            still_ours: Callable[[], None] | None = None) -> PublishedPartition:
    """Publish the validated run directory as the date's night; returns what is now published.

    ``table``: the output table (:class:`recsys.publish.table.OutputTable`), or None to publish the
    pointer and the path view only. On return the pointer and the path view name this run, the path
    view's old copy is gone, and the run directory stays (it is what the table points at); older runs
    are left to :mod:`recsys.publish.retention`. ``hooks`` may hold the publish at its pause points.

    ``still_ours``: the date lock's check (:meth:`recsys.publish.lock.DateLock.verify`, raising LockHeld),
    called after the pointer is read and before the first switch. Where pointer writes are conditional,
    a run whose lock is taken over after that check still cannot switch the pointer over the newer
    run's: its write names the pointer it read before the check.
    """
    method = method or publish_method(layout)
    fs, run = rfs.resolve(layout.run_dir)
    if not rfs.exists(fs, rfs.join(run, SUCCESS_MARKER)):
        raise RuntimeError(f"run directory {layout.run_dir} has no {SUCCESS_MARKER}; refusing to publish")
    manifest_file.write(layout.run_dir, manifest)
    hooks.pause("before_swap")
    previous = read_pointer(layout.output_root, layout.date)
    if still_ours is not None:
        still_ours()
    if table is not None:
        table.point(layout.date, layout.run_dir)          # the commit point: one metastore operation
        hooks.pause("after_table")
    write_pointer(layout.output_root, layout.date, layout.run_key, "publish", previous)
    hooks.pause("after_pointer")
    refresh_view(layout, layout.run_key, method, hooks)
    return PublishedPartition(layout.date, layout.run_dir, manifest, "table" if table is not None else "pointer")


def refresh_view(layout: PartitionLayout, run: str, method: swap.Method, hooks: Hooks = NO_HOOKS) -> None:
    """Make the path view ``dt=D/`` a complete copy of ``run``'s directory, as atomically as the store allows."""
    fs, source = rfs.resolve(run_dir(layout.output_root, layout.date, run))
    _, final = rfs.resolve(layout.final_dir)
    if method == "copy":
        _publish_by_copy(fs, source, final, hooks)
        return
    _, staging = rfs.resolve(layout.view_staging_dir)
    rfs.delete_dir_if_exists(fs, staging)
    _clone(fs, source, staging)
    if method == "exchange":
        _publish_by_exchange(staging, final, hooks)
    else:
        _publish_by_renames(fs, staging, final, rfs.resolve(layout.trash_dir)[1], hooks)
    _remove_if_empty(fs, rfs.resolve(layout.staging_root)[1])


def _clone(fs: pafs.FileSystem, source: str, target: str) -> None:
    """``target`` holding ``source``'s files: hard links on a local disk (no bytes copied), copies elsewhere."""
    infos = fs.get_file_info(pafs.FileSelector(source, recursive=True))
    fs.create_dir(target, recursive=True)
    for info in sorted(infos, key=lambda i: i.path):
        dest = rfs.join(target, info.path[len(source):])
        if info.type == pafs.FileType.Directory:
            fs.create_dir(dest, recursive=True)
        elif isinstance(fs, pafs.LocalFileSystem):
            os.link(info.path, dest)
        else:
            fs.copy_file(info.path, dest)


def _publish_by_exchange(staging: str, final: str, hooks: Hooks) -> None:
    try:
        swap.exchange(staging, final)      # staging now holds the old path view
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


def _publish_by_copy(fs: pafs.FileSystem, source: str, final: str, hooks: Hooks) -> None:
    """Object stores: remove the old view, copy the data, then the manifest and ``_SUCCESS`` last."""
    rfs.delete_dir_if_exists(fs, final)
    fs.create_dir(final, recursive=True)
    infos = fs.get_file_info(pafs.FileSelector(source, recursive=True))
    files = [i for i in infos if i.type == pafs.FileType.File]
    for info in files:
        if not info.base_name.startswith(("_", ".")):
            fs.copy_file(info.path, rfs.join(final, info.path[len(source):]))
    fs.copy_file(manifest_file.path_in(source), manifest_file.path_in(final))
    hooks.pause("after_swap")
    with fs.open_output_stream(rfs.join(final, SUCCESS_MARKER)) as f:
        f.write(b"")


def recover(layout: PartitionLayout, table: Any = None, method: swap.Method | None = None) -> list[str]:
    """Undo or finish what a killed run of this date left behind; returns what was done, for the log.

    Run under the date's lock, before anything else. The commit point (the table's partition, or the
    pointer without a table) says which run is published: the pointer and the path view are brought
    in line with it; a path view moved to ``_trash/`` by a two-rename swap is put back first; copies
    under ``_staging/`` and run directories that were never published (their runs are dead: the lock
    says so) are removed. A date published before run directories existed is adopted: its path view
    becomes a run directory (hard links on a local disk), the pointer and the table name it.
    """
    fs, final = rfs.resolve(layout.final_dir)
    notes = _restore_trashed_view(layout, fs, final)
    _, staging_root = rfs.resolve(layout.staging_root)
    for info in _list(fs, staging_root):
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(info.path)
            notes.append(f"removed staging directory {info.path}, left by a killed run")
    _remove_if_empty(fs, staging_root)

    root, date = layout.output_root, layout.date
    pointer = read_pointer(root, date)
    current = pointer.run if pointer else None
    if table is not None:
        location = table.location(date)
        in_table = run_of(location) if location else None
        if in_table and in_table != current:
            pointer = write_pointer(root, date, in_table, "recovered", pointer)
            notes.append(f"the table points {partition_name(date)} at run {in_table}, the pointer said "
                         f"{current or 'nothing'}: a run was killed after its commit; the pointer follows the table")
            current = in_table
        elif in_table is None and current:
            table.point(date, run_dir(root, date, current))
            notes.append(f"registered run {current} of {partition_name(date)} in the table (the pointer names it; "
                         f"the table did not)")
    if current is None:
        adopted = _adopt_view(layout, fs, final, table, pointer)
        if adopted:
            notes.append(adopted)
            pointer = read_pointer(root, date)
            current = pointer.run if pointer else None

    keep = set(pointer.published_runs()) if pointer else set()
    for run in kept_runs(root, date):
        if run not in keep and run != layout.run_key:
            fs.delete_dir(rfs.resolve(run_dir(root, date, run))[1])
            notes.append(f"removed run directory run={run} of {partition_name(date)}: never published (a run killed "
                         f"before its commit, or a failed one)")
    if current is not None:
        view = _view_run(fs, final)
        if view != current:
            refresh_view(layout, current, method or publish_method(layout))
            notes.append(f"the path view {layout.final_dir} showed {view or 'nothing complete'}; refreshed from run "
                         f"{current}, the published one")
    elif rfs.is_dir(fs, final) and not rfs.exists(fs, rfs.join(final, SUCCESS_MARKER)):
        notes.append(f"{layout.final_dir} has no {SUCCESS_MARKER} (a copy interrupted on an object store); "
                     f"this run replaces it")
    return notes


def register_dates(output_root: str, table: Any) -> list[str]:
    """Register in a (new) table every date whose pointer names a run the table lacks: the table follows the
    pointers whenever it is created anew (a new metastore, a table added to an existing output)."""
    from recsys.publish.published import published_dates

    known = set(table.dates())
    notes = []
    for date in published_dates(output_root):
        pointer = read_pointer(output_root, date)
        if date not in known and pointer is not None and pointer.run and is_complete(run_dir(output_root, date, pointer.run)):
            table.point(date, run_dir(output_root, date, pointer.run))
            notes.append(f"registered {partition_name(date)} (run {pointer.run}) in table {table.name}")
    return notes


def _restore_trashed_view(layout: PartitionLayout, fs: pafs.FileSystem, final: str) -> list[str]:
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
    return notes


def _view_run(fs: pafs.FileSystem, final: str) -> str | None:
    """The run a complete path view holds (its manifest's ``job_run``), None if it is not complete."""
    manifest = manifest_file.read_in(fs, final)
    return (manifest.job_run or None) if manifest is not None else None


def _adopt_view(layout: PartitionLayout, fs: pafs.FileSystem, final: str, table: Any,
                pointer: Pointer | None) -> str | None:
    """A complete path view without a pointer (published before run directories): make it a run directory.

    ``pointer``: the date's pointer as read, if one naming no run is there: replaced, its history not kept."""
    run = _view_run(fs, final)
    if run is None:
        return None
    target = run_dir(layout.output_root, layout.date, run)
    _, path = rfs.resolve(target)
    if not is_complete(target):
        rfs.delete_dir_if_exists(fs, path)
        _clone(fs, final, path)
    if table is not None:
        table.point(layout.date, target)
    fresh = Pointer(layout.date, None, (), pointer.version) if pointer is not None else None
    write_pointer(layout.output_root, layout.date, run, "adopted", fresh)
    return (f"adopted {layout.final_dir} (published before run directories) as run directory run={run}"
            f"{' and registered it in the table' if table is not None else ''}")


def roll_back(layout: PartitionLayout, to: str | None, table: Any = None, method: swap.Method | None = None,
              hooks: Hooks = NO_HOOKS) -> tuple[str, str]:
    """Point the date back at an earlier published run that is still kept; returns (from run, to run).

    ``to``: a run key (``recsys rollback --to``); None: the newest earlier one. The same steps as a
    publish, from the table on: table, pointer, path view. Run under the date's lock, after :func:`recover`.
    """
    root, date = layout.output_root, layout.date
    pointer = read_pointer(root, date)
    if pointer is None or pointer.run is None:
        raise ConfigError(f"{partition_name(date)} has no published run under {redact_uri(root)}: nothing to roll back")
    kept = [r for r in pointer.published_runs()[1:] if is_complete(run_dir(root, date, r))]
    if to is None:
        if not kept:
            raise ConfigError(f"{partition_name(date)}: no earlier published run is kept (output.keep_runs) to roll back "
                               f"to; the published run is {pointer.run}")
        to = kept[0]
    elif to == pointer.run:
        raise ConfigError(f"{partition_name(date)}: run {to} already is the published one")
    elif to not in kept:
        raise ConfigError(f"{partition_name(date)}: run {to} is not a kept earlier run; kept: {', '.join(kept) or 'none'}")
    target = run_dir(root, date, to)
    if table is not None:
        table.point(date, target)
        hooks.pause("after_table")
    write_pointer(root, date, to, "rollback", pointer)
    hooks.pause("after_pointer")
    refresh_view(layout, to, method or publish_method(layout), hooks)
    return pointer.run, to


def discard_staging(layout: PartitionLayout, table: Any = None) -> None:
    """Remove this run's directory and copies after it failed, unless the table or the pointer names the run
    (a failure after the commit point: the run is published, and its directory is what readers read)."""
    pointer = read_pointer(layout.output_root, layout.date)
    fs, run = rfs.resolve(layout.run_dir)
    named = pointer is not None and layout.run_key in pointer.published_runs()
    if table is not None and not named:
        location = table.location(layout.date)
        named = location is not None and run_of(location) == layout.run_key
    if not named:
        rfs.delete_dir_if_exists(fs, run)
    _, staging = rfs.resolve(layout.view_staging_dir)
    rfs.delete_dir_if_exists(fs, staging)
    _remove_if_empty(fs, rfs.resolve(layout.staging_root)[1])
    _remove_if_empty(fs, rfs.resolve(runs_root(layout.output_root, layout.date))[1])


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
