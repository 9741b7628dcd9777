"""What is kept: ``output.keep_runs`` run directories per date, ``output.retention_days`` of dates.

Run after each publish, under the published date's lock. The rule that makes it safe to kill at any
point: nothing is removed while a pointer names it. For the published date, the runs beyond the
newest ``keep_runs`` published ones are removed, never the one the table and the pointer name. A date
older than ``retention_days`` before the run date is retired under its own lock (skipped, and tried
again next night, while another run holds it): its table partition is dropped first (readers of the
table no longer see it), then its pointer, then its path view and run directories. A kill between
two steps leaves a date either still published or no longer pointed at with files left over, which
the next night's pass removes.
"""
from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from recsys import fs as rfs
from recsys.data.contracts import partition_name
from recsys.errors import LockHeld
from recsys.hooks import NO_HOOKS, Hooks
from recsys.publish.lock import DateLock
from recsys.publish.published import (Pointer, kept_runs, published_dates, read_pointer, remove_pointer, run_dir,
                                      runs_root, view_dir)

log = logging.getLogger(__name__)


def trim_runs(output_root: str, date: dt.date, keep_runs: int, hooks: Hooks = NO_HOOKS) -> list[str]:
    """Remove run directories of ``date`` beyond the newest ``keep_runs`` published ones; returns what went."""
    pointer = read_pointer(output_root, date)
    if pointer is None or pointer.run is None:
        return []
    keep = set(pointer.published_runs()[:keep_runs]) | {pointer.run}
    removed = []
    for run in kept_runs(output_root, date):
        if run in keep:
            continue
        fs, path = rfs.resolve(run_dir(output_root, date, run))
        rfs.delete_dir_if_exists(fs, path)
        removed.append(f"removed run directory run={run} of {partition_name(date)} (output.keep_runs={keep_runs})")
        hooks.pause("retention")
    return removed


def retire_dates(output_root: str, date: dt.date, retention_days: int | None, table: Any = None, run_key: str = "retention",
                 hooks: Hooks = NO_HOOKS) -> list[str]:
    """Remove every date older than ``retention_days`` before ``date``: table partition, pointer, files."""
    if retention_days is None:
        return []
    cutoff = date - dt.timedelta(days=retention_days)
    old = sorted(set(published_dates(output_root)) | set(table.dates() if table is not None else ()))
    notes = []
    for day in (d for d in old if d < cutoff):
        try:
            with DateLock(output_root, day, run_key):
                notes.append(_retire(output_root, day, table, hooks))
        except LockHeld as exc:
            notes.append(f"kept {partition_name(day)} for now: {exc}")
    return notes


def _retire(output_root: str, day: dt.date, table: Any, hooks: Hooks) -> str:
    if table is not None:
        table.drop(day)                               # readers of the table stop seeing the date here
        hooks.pause("retention")
    try:
        pointer = read_pointer(output_root, day)
    except RuntimeError:                              # unreadable: removed as it is
        pointer = Pointer(day, None)
    if pointer is not None:
        remove_pointer(output_root, day, pointer)    # ... and readers of the pointer here
    fs, view = rfs.resolve(view_dir(output_root, day))
    rfs.delete_dir_if_exists(fs, view)
    rfs.delete_dir_if_exists(fs, rfs.resolve(runs_root(output_root, day))[1])
    return f"retired {partition_name(day)} (output.retention_days)"
