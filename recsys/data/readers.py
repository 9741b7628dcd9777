"""Reading the inputs (events, the latest catalog snapshot) and checking them against the contract.

Transforms take DataFrames and plain values and return DataFrames, so they test on tiny fixtures;
the only I/O is ``spark.read`` at the edge. DataFrame API only: this runs over Spark Connect too.
Failures the user can fix (missing path, schema drift, no snapshot) raise InputDataError with the
path, the column and what to do.
"""
from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from recsys.data.contracts import PARTITION_COLUMN, partition_name
from recsys.errors import InputDataError

# column -> accepted Spark types (the first is the contract's; the others are cast losslessly)
EVENTS_COLUMNS: dict[str, tuple[type[T.DataType], ...]] = {
    "user_id": (T.LongType, T.IntegerType),
    "item_id": (T.LongType, T.IntegerType),
    "event_type": (T.StringType,),
    "ts": (T.TimestampType, T.TimestampNTZType),
}
CATALOG_COLUMNS: dict[str, tuple[type[T.DataType], ...]] = {
    "item_id": (T.LongType, T.IntegerType),
    "available": (T.BooleanType,),
}
_DT_IN_PATH = re.compile(rf"(?:^|/){PARTITION_COLUMN}=(\d{{4}}-\d{{2}}-\d{{2}})(?:/|$)")


@dataclass(frozen=True)
class CatalogSnapshot:
    date: dt.date
    frame: DataFrame   # the contract's columns (+ descriptive ones), for that one date


def read_dataset(spark: SparkSession, root: str, name: str) -> DataFrame:
    """Read a dt-partitioned Parquet dataset, turning 'path does not exist' into a clear error."""
    try:
        return spark.read.parquet(root)
    except Exception as exc:  # AnalysisException classic / Connect differ in class; match the message
        text = str(exc)
        if "PATH_NOT_FOUND" in text or "does not exist" in text.lower():
            raise InputDataError(
                f"{name} path {root!r} does not exist; check paths.{name} in the configuration"
            ) from None
        if "UNABLE_TO_INFER_SCHEMA" in text:
            raise InputDataError(f"{name} path {root!r} holds no Parquet files; expected {name}/dt=YYYY-MM-DD/*.parquet") from None
        raise


def check_columns(df: DataFrame, expected: dict[str, tuple[type[T.DataType], ...]], name: str, root: str) -> DataFrame:
    """Fail on schema drift with the column and type named; cast accepted narrower types to the contract's."""
    fields = {f.name: f.dataType for f in df.schema.fields}
    missing = [c for c in expected if c not in fields]
    if missing:
        raise InputDataError(
            f"{name} at {root!r} lacks column(s) {missing}; found {sorted(fields)}. "
            f"The contract needs {list(expected)} (README: data contracts)"
        )
    for col, accepted in expected.items():
        if not isinstance(fields[col], accepted):
            raise InputDataError(
                f"{name} column {col!r} at {root!r} has type {fields[col].simpleString()}, "
                f"expected {accepted[0]().simpleString()} (README: data contracts)"
            )
    casts = {c: F.col(c).cast(accepted[0]()) for c, accepted in expected.items() if not isinstance(fields[c], accepted[0])}
    return df.withColumns(casts) if casts else df


def partition_dates(df: DataFrame) -> list[dt.date]:
    """Dates of the dt= partitions that hold files, from the file listing alone (no data read)."""
    dates = set()
    for path in df.inputFiles():
        match = _DT_IN_PATH.search(path)
        if match:
            dates.add(dt.date.fromisoformat(match.group(1)))
    return sorted(dates)


def read_events_window(
    spark: SparkSession, root: str, date: dt.date, window_days: int, event_types: tuple[str, ...] = ()
) -> DataFrame:
    """Events of the ``window_days`` days strictly before ``date`` (by partition and by timestamp)."""
    events = read_dataset(spark, root, "events")
    if PARTITION_COLUMN not in events.columns:
        raise InputDataError(f"events at {root!r} are not partitioned by {PARTITION_COLUMN}=YYYY-MM-DD")
    events = check_columns(events, EVENTS_COLUMNS, "events", root)
    return events_window(events, date, window_days, event_types)


def events_window(events: DataFrame, date: dt.date, window_days: int, event_types: tuple[str, ...] = ()) -> DataFrame:
    start = date - dt.timedelta(days=window_days)
    day_start = dt.datetime.combine(date, dt.time())
    window = events.filter(
        (F.col(PARTITION_COLUMN) >= F.lit(start)) & (F.col(PARTITION_COLUMN) < F.lit(date))
    ).filter(F.col("ts") < F.lit(day_start))
    if event_types:
        window = window.filter(F.col("event_type").isin(list(event_types)))
    return window.select("user_id", "item_id", "event_type", "ts")


def read_catalog_snapshot(spark: SparkSession, root: str, date: dt.date, max_age_days: int = 0) -> CatalogSnapshot:
    """The newest catalog partition on or before ``date``: the catalog as the business saw it then."""
    catalog = read_dataset(spark, root, "catalog")
    dates = [d for d in partition_dates(catalog) if d <= date]
    if not dates:
        raise InputDataError(
            f"no catalog snapshot on or before {date} under {root!r}; "
            f"write catalog/{partition_name(date)}/ or run for a later date"
        )
    snapshot = dates[-1]
    if max_age_days and (date - snapshot).days > max_age_days:
        raise InputDataError(
            f"the newest catalog snapshot on or before {date} is {snapshot}, {(date - snapshot).days} days old, "
            f"older than catalog.max_age_days={max_age_days}; publish a fresh snapshot or raise the limit"
        )
    frame = spark.read.option("basePath", root).parquet(f"{root.rstrip('/')}/{partition_name(snapshot)}")
    frame = check_columns(frame.drop(PARTITION_COLUMN), CATALOG_COLUMNS, "catalog", root)
    return CatalogSnapshot(snapshot, frame)
