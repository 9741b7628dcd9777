"""The user-visible data contracts (docs/data-contracts.md), in one place.

Inputs and outputs are Parquet datasets with Hive-style date partitions ``dt=YYYY-MM-DD``.
Changing anything here is a breaking change for users: it needs a migration note in the README.
Pure pyarrow: used by the generators and importers, which run without Spark.
"""
from __future__ import annotations

import datetime as dt
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PARTITION_COLUMN = "dt"
DATE_FORMAT = "%Y-%m-%d"

EVENTS_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64()),
        pa.field("item_id", pa.int64()),
        pa.field("event_type", pa.string()),
        pa.field("ts", pa.timestamp("us", tz="UTC")),
    ]
)

# Required catalog columns; any further (descriptive) columns are carried through untouched.
CATALOG_REQUIRED_SCHEMA = pa.schema(
    [
        pa.field("item_id", pa.int64()),
        pa.field("available", pa.bool_()),
    ]
)
CATALOG_SCHEMA = pa.schema(
    list(CATALOG_REQUIRED_SCHEMA)
    + [
        pa.field("title", pa.string()),
        pa.field("category", pa.string()),
    ]
)

RECOMMENDATION_TYPE = pa.list_(
    pa.field("element", pa.struct([pa.field("item_id", pa.int64()), pa.field("score", pa.float32())]))
)
OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64()),
        pa.field("recommendations", RECOMMENDATION_TYPE),
        pa.field("source", pa.string()),          # "model" or the fallback's name, e.g. "popularity"
        pa.field("model_version", pa.string()),
    ]
)
OUTPUT_SPARK_DDL = (
    "user_id BIGINT, recommendations ARRAY<STRUCT<item_id: BIGINT, score: FLOAT>>, "
    "source STRING, model_version STRING"
)
# The per-user histories the job builds (recsys.data.history) and scores: user_id BIGINT plus this
# column, array<bigint> of external item ids, oldest first. Internal, but shared by history building,
# scoring and validation, so it is defined once here.
HISTORY_COLUMN = "history"
# Aligned with it, element by element: how many events the user had with each item in the window, and
# when the latest was (epoch microseconds, UTC): what repeats say, for the repeat blend (recsys.model.repeats).
HISTORY_COUNTS_COLUMN = "history_counts"
HISTORY_LAST_US_COLUMN = "history_last_us"
# Beside it, when the nightly job compares with the previous published partition (recsys.scoring.compare):
# the user's list there (item ids, best first; null: the user had none) and the distinct items of the
# user's events since that partition's date. Internal too.
PREVIOUS_COLUMN = "previous_items"
TOUCHED_COLUMN = "touched_items"
# Beside them, from the same aggregation: which of the touched items the user had an event with before that
# date (known when the list was made: the repeat targets; the rest are new to the user), and the user's
# personal-frequency list as of that date (items with most events before it first, ties by the latest such
# event, then item id; at most scoring.top_n): the baseline a repeat-heavy log is measured against. Internal.
TOUCHED_KNOWN_COLUMN = "touched_known_items"
PERSONAL_FREQUENCY_COLUMN = "personal_frequency_items"
# Beside it too, when the operators' rules exclude items by event (recommend.exclude.events): the distinct items
# each user had such an event with recently enough, whether or not the history kept them. Internal.
EXCLUDED_COLUMN = "excluded_items"

SOURCE_MODEL = "model"
SOURCE_POPULARITY = "popularity"

SUCCESS_MARKER = "_SUCCESS"
MANIFEST_NAME = "_manifest.json"


def start_of_day_us(date: dt.date) -> int:
    """Midnight UTC of ``date``, in epoch microseconds: the instant a night's lists are for, and the first
    instant a model trained on the events before ``date`` has not seen.

    >>> start_of_day_us(dt.date(1970, 1, 2))
    86400000000
    """
    return int(dt.datetime(date.year, date.month, date.day, tzinfo=dt.timezone.utc).timestamp()) * 1_000_000


def parse_date(value: str | dt.date) -> dt.date:
    """Parse YYYY-MM-DD, with an error that says what was wrong."""
    if isinstance(value, dt.date):
        return value
    try:
        return dt.datetime.strptime(value, DATE_FORMAT).date()
    except (TypeError, ValueError):
        raise ValueError(f"date {value!r} is not in YYYY-MM-DD form, e.g. 2024-05-01") from None


MAX_RANGE_DAYS = 3660   # ten years: any real backfill fits; a typo in the year (2204) does not


def date_range(start: dt.date, end: dt.date, *, names: tuple[str, str] = ("start date", "end date")) -> list[dt.date]:
    """Every date from ``start`` to ``end``, both included, in order: the one check of a backfill range,
    for the CLI (``--start-date``/``--end-date``) and the on-demand frontend (``start_date``/``end_date``),
    each naming the bounds as its user typed them (``names``). Raises ValueError naming what is wrong."""
    if end < start:
        raise ValueError(f"{names[1]} {end} is before {names[0]} {start}")
    days = (end - start).days + 1
    if days > MAX_RANGE_DAYS:
        raise ValueError(f"a range of {days} days is longer than {MAX_RANGE_DAYS}; split it")
    return [start + dt.timedelta(days=i) for i in range(days)]


def partition_name(date: dt.date) -> str:
    return f"{PARTITION_COLUMN}={date.strftime(DATE_FORMAT)}"


def write_partition(table: pa.Table, root: str | Path, date: dt.date, *, replace: bool = True) -> Path:
    """Write one date partition of a local dataset: files appear under their final name only when complete.

    Used by the sample generator and importers (local paths). The file is written under a hidden
    name and renamed, so a reader listing the partition never sees a half-written file.
    """
    part_dir = Path(root) / partition_name(date)
    part_dir.mkdir(parents=True, exist_ok=True)
    if replace:
        for old in part_dir.glob("*.parquet"):
            old.unlink()
    tmp = part_dir / f".part-{uuid.uuid4().hex}.parquet.tmp"
    pq.write_table(table, tmp, compression="zstd")
    final = part_dir / f"part-{uuid.uuid4().hex[:12]}.parquet"
    os.replace(tmp, final)
    return final
