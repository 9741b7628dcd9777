"""``recsys rollback``: point a date back at an earlier run that is still kept, under the date's lock.

The same steps as a publish from the commit point on (the table's partition, the pointer, the path
view), after the same recovery a nightly run does first. What a rollback can reach is what retention
kept (``output.keep_runs``); a later run of the date (a scheduler's retry, ``--force``) publishes anew.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from recsys.config import Config
from recsys.publish import manifest as manifest_file
from recsys.publish.lock import DateLock
from recsys.publish.published import kept_runs, new_run_key, read_pointer, run_dir
from recsys.publish.publisher import PartitionLayout, check_output_location, publish_method, recover, roll_back

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeptRun:
    run: str
    published: bool        # published for the date at some point (a rollback target)
    current: bool          # the one published now
    model_version: str | None
    published_at: str | None


def kept(cfg: Config, date: dt.date) -> list[KeptRun]:
    """The date's run directories that are kept, newest first, with what the pointer says of them."""
    root = cfg.paths.output
    pointer = read_pointer(root, date)
    published = pointer.published_runs() if pointer else []
    when = {e.run: e.at for e in (pointer.history if pointer else ())}
    found = []
    for run in sorted(kept_runs(root, date), reverse=True):
        location = run_dir(root, date, run)
        manifest = manifest_file.read_at(location)
        version = manifest.model.version if manifest is not None else None
        found.append(KeptRun(run, run in published, bool(pointer and pointer.run == run), version, when.get(run)))
    return found


def rollback(spark, cfg: Config, date: dt.date, to: str | None) -> tuple[str, str]:
    """Point ``date`` at run ``to`` (None: the newest earlier published one); returns (from run, to run)."""
    from recsys.pipelines.nightly import output_table

    check_output_location(cfg.paths)
    key = new_run_key("rollback")
    layout = PartitionLayout(cfg.paths.output, date, key)
    with DateLock(cfg.paths.output, date, key):
        table = output_table(spark, cfg) if spark is not None else None
        method = publish_method(layout)
        for note in recover(layout, table, method):
            log.warning("rollback %s: %s", date, note)
        old, new = roll_back(layout, to, table, method)
    log.info("rollback %s: the date now points at run %s (was %s)%s", date, new, old,
             f"; table {cfg.output.table} switched" if table is not None else "")
    return old, new
