"""Convert the Wikipedia edit log (``../shared/data/wikipedia-edits/edits.csv.gz``) to the input layout.

    python benchmarks/wikipedia_edits.py --out /tmp/wikipedia [--start 2024-01-01] [--overwrite]

The log gives seconds since its first edit and no calendar start; like the figures in DESIGN.md and
docs/quality.md, this puts the first edit at ``--start`` 00:00 UTC (default 2024-01-01), so the 31
days run 2024-01-01..2024-01-31. Every edit becomes one ``event_type = "edit"`` event (user_id, the
page as item_id, the time); events are written one partition per UTC day. The catalog is one snapshot,
dated the first day, listing every edited page as available (the log has no catalog history).

A stop-gap until the generic CSV importer exists; the conversion is a few lines of pyarrow so that the
backtest (``recsys backtest``) and its figures in docs/quality.md can be reproduced exactly.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LOG = REPO.parent / "shared" / "data" / "wikipedia-edits" / "edits.csv.gz"
if not DEFAULT_LOG.is_file():
    DEFAULT_LOG = Path("/work/shared/data/wikipedia-edits/edits.csv.gz")


def convert(log: Path, out: Path, start: dt.date, overwrite: bool = False) -> str:
    """Write ``out/events/dt=.../`` and ``out/catalog/dt=<start>/``; a one-line summary."""
    from recsys.data._output import prepare_dataset_dirs
    from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition

    table = pacsv.read_csv(log)
    for column in ("user_id", "page_id", "seconds"):
        if column not in table.column_names:
            raise SystemExit(f"{log} lacks column {column!r}; it has {table.column_names}")
    users = table.column("user_id").to_numpy().astype(np.int64)
    pages = table.column("page_id").to_numpy().astype(np.int64)
    seconds = np.asarray(table.column("seconds").to_numpy(), dtype=np.float64)
    origin_us = int(dt.datetime.combine(start, dt.time(), tzinfo=dt.timezone.utc).timestamp() * 1_000_000)
    ts_us = origin_us + np.round(seconds * 1_000_000).astype(np.int64)
    order = np.lexsort((pages, users, ts_us))
    users, pages, ts_us = users[order], pages[order], ts_us[order]
    events_dir, catalog_dir = prepare_dataset_dirs(out, overwrite=overwrite)
    events = pa.table({
        "user_id": pa.array(users, pa.int64()),
        "item_id": pa.array(pages, pa.int64()),
        "event_type": pc.take(pa.array(["edit"]), pa.array(np.zeros(len(users), dtype=np.int32))),
        "ts": pa.array(ts_us, pa.timestamp("us", tz="UTC")),
    }, schema=EVENTS_SCHEMA)
    day = np.floor_divide(ts_us, 86_400 * 1_000_000)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(day)) + 1])
    ends = np.append(starts[1:], len(day))
    epoch = dt.date(1970, 1, 1)
    dates = [epoch + dt.timedelta(days=int(d)) for d in day[starts]]
    for date, a, b in zip(dates, starts, ends):
        write_partition(events.slice(int(a), int(b - a)), events_dir, date)
    items = np.unique(pages)
    catalog = pa.table({"item_id": pa.array(items, pa.int64()), "available": pa.array(np.ones(len(items), bool)),
                        "title": pa.array([f"page {i}" for i in items]),
                        "category": pa.array(["wikipedia"] * len(items))}, schema=CATALOG_SCHEMA)
    write_partition(catalog, catalog_dir, dates[0])
    return (f"wikipedia-edits: {len(users):,} edits by {len(np.unique(users)):,} users of {len(items):,} pages on "
            f"{len(dates)} days {dates[0]}..{dates[-1]} -> {events_dir}; catalog dated {dates[0]} -> {catalog_dir}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=DEFAULT_LOG, help=f"edits.csv.gz (default: {DEFAULT_LOG})")
    parser.add_argument("--out", type=Path, required=True, help="dataset root (events/ and catalog/ inside)")
    parser.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2024, 1, 1),
                        help="calendar date of the log's first edit (default: 2024-01-01)")
    parser.add_argument("--overwrite", action="store_true", help="replace the partitions of an earlier conversion")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    print(convert(args.log, args.out, args.start, args.overwrite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
