"""Reading the inputs (events, the latest catalog snapshot) and checking them against the contract.

Transforms take DataFrames and plain values and return DataFrames, so they test on tiny fixtures;
the only I/O is at the edge. DataFrame API only: this runs over Spark Connect too.

Before Spark reads anything, the driver lists the partitions the run needs (the events window,
the one catalog snapshot) and reads every file's Parquet footer (microseconds each, a few
hundred milliseconds for thousands of files): a file that is not Parquet, or whose columns
drifted from the contract, is then reported by name. Left to Spark, a drifted file would be
read with another file's schema (a renamed column silently becomes nulls) and a corrupt one would
surface as a stack trace in the middle of a stage. Failures the user can fix raise
InputDataError with the path, the column and what to do.
"""
from __future__ import annotations

import datetime as dt
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from recsys.data.contracts import PARTITION_COLUMN, partition_name
from recsys.data.partitions import list_partitions, with_files
from recsys.errors import InputDataError, first_line
from recsys.redaction import redact_text, redact_uri

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

# The same contract in Arrow terms, for the footer check: column -> (accepted?, contract type name)
_ArrowCheck = tuple[Callable[[pa.DataType], bool], str]
_ID: _ArrowCheck = (lambda t: pa.types.is_int64(t) or pa.types.is_int32(t), "bigint")
EVENTS_FILE_COLUMNS: dict[str, _ArrowCheck] = {
    "user_id": _ID,
    "item_id": _ID,
    "event_type": (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "string"),
    "ts": (pa.types.is_timestamp, "timestamp"),
}
CATALOG_FILE_COLUMNS: dict[str, _ArrowCheck] = {
    "item_id": _ID,
    "available": (pa.types.is_boolean, "boolean"),
}
# Spark error texts that mean "this input file cannot be read", not "the job has a bug"
_READ_FAILURE_MARKERS = ("FAILED_READ_FILE", "CANNOT_READ_FILE_FOOTER", "is not a Parquet file",
                         "Could not read footer", "PARQUET_COLUMN_DATA_TYPE_MISMATCH",
                         "Parquet column cannot be converted")
_FILE_IN_MESSAGE = re.compile(r"(?:file|File) (\S+\.parquet)")


@dataclass(frozen=True)
class CatalogSnapshot:
    date: dt.date
    frame: DataFrame   # the contract's columns (+ descriptive ones), for that one date
    table: pa.Table    # item_id int64, available bool (+ the columns asked for): the same rows, read on the driver


def check_files(fs: pafs.FileSystem, files: list[str], expected: dict[str, _ArrowCheck], name: str) -> None:
    """Read every file's footer: each must be Parquet and hold the contract's columns in accepted types."""
    def footer(path: str) -> tuple[str, pa.Schema | Exception]:
        try:
            return path, pq.read_schema(path, filesystem=fs)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
            return path, exc

    with ThreadPoolExecutor(max_workers=8) as pool:   # latency-bound on object stores
        schemas = list(pool.map(footer, files))
    for path, schema in schemas:
        if isinstance(schema, Exception):
            reason = first_line(schema)
            raise InputDataError(
                f"{name} file {path} is not a readable Parquet file ({reason}); "
                f"rewrite or remove it (an interrupted upload?) and rerun"
            )
        found = {f.name: f.type for f in schema}
        missing = [c for c in expected if c not in found]
        if missing:
            raise InputDataError(
                f"{name} file {path} lacks column(s) {missing}; it has {sorted(found)}. "
                f"The contract needs {list(expected)} (docs/data-contracts.md)"
            )
        for col, (accepted, contract_type) in expected.items():
            if not accepted(found[col]):
                raise InputDataError(
                    f"{name} column {col!r} in file {path} has type {found[col]}, expected {contract_type} "
                    f"(docs/data-contracts.md)"
                )


@contextmanager
def read_errors_as_input_errors(name: str, root: str) -> Iterator[None]:
    """Turn Spark's "cannot read this file" failures (a page corrupt behind a valid footer) into InputDataError."""
    try:
        yield
    except InputDataError:
        raise
    except Exception as exc:  # classic and Connect raise different classes: match the message
        text = str(exc)
        if not any(marker in text for marker in _READ_FAILURE_MARKERS):
            raise
        found = _FILE_IN_MESSAGE.search(text)
        where = found.group(1) if found else f"a file under {redact_uri(root)!r}"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        causes = [line.removeprefix("Caused by:").strip() for line in lines if line.startswith("Caused by:")]
        marked = [line for line in lines if any(m in line for m in _READ_FAILURE_MARKERS)]
        reason = (causes or marked or [type(exc).__name__])[-1 if causes else 0]
        raise InputDataError(
            f"{name}: Spark cannot read {redact_text(where)} ({redact_text(reason[:300])}); rewrite or remove the file "
            f"and rerun"
        ) from None


def check_columns(df: DataFrame, expected: dict[str, tuple[type[T.DataType], ...]], name: str, root: str) -> DataFrame:
    """Fail on schema drift with the column and type named; cast accepted narrower types to the contract's."""
    fields = {f.name: f.dataType for f in df.schema.fields}
    missing = [c for c in expected if c not in fields]
    if missing:
        raise InputDataError(
            f"{name} at {redact_uri(root)!r} lacks column(s) {missing}; found {sorted(fields)}. "
            f"The contract needs {list(expected)} (docs/data-contracts.md)"
        )
    for col, accepted in expected.items():
        if not isinstance(fields[col], accepted):
            raise InputDataError(
                f"{name} column {col!r} at {redact_uri(root)!r} has type {fields[col].simpleString()}, "
                f"expected {accepted[0]().simpleString()} (docs/data-contracts.md)"
            )
    casts = {c: F.col(c).cast(accepted[0]()) for c, accepted in expected.items() if not isinstance(fields[c], accepted[0])}
    return df.withColumns(casts) if casts else df


def window_start(date: dt.date, window_days: int) -> dt.date:
    """First day of the history window of a run for ``date``: the window is [start, date)."""
    return date - dt.timedelta(days=window_days)


def read_events_window(
    spark: SparkSession, root: str, date: dt.date, window_days: int, event_types: tuple[str, ...] = ()
) -> DataFrame:
    """Events of the ``window_days`` days strictly before ``date`` (by partition and by timestamp).

    Only the window's partitions are listed, checked and read.
    """
    start = window_start(date, window_days)
    events = read_events(spark, root, lambda d: start <= d < date)
    if events is None:
        raise InputDataError(
            f"no events between {start} and {date} (exclusive) under {redact_uri(root)!r}: no dt= partition in that range holds "
            f"files; check paths.events and history.window_days, or that the upstream export ran"
        )
    return events_window(events, date, window_days, event_types)


class KeptWindow:
    """One date's events window, read once and kept by Spark for every stage of one process that reads it.

    ``recsys night`` trains and then builds the night's histories, both from the ``history.window_days``
    before the date: without this the night lists, checks and reads the window's partitions twice, and on
    a log of many small daily partitions the second read costs as much as the first (docs/performance.md).
    The window is read at the first :meth:`events` that asks for it, kept on the executors' local disk
    (:func:`keep`) and released by :meth:`release` or the end of the ``with`` block. A stage that asks for
    another window (another date, root, length or event types) gets None and reads its own.
    """

    def __init__(self, spark: SparkSession, root: str, date: dt.date, window_days: int,
                 event_types: tuple[str, ...] = ()):
        self._spark = spark
        self._key = (root, date, window_days, tuple(event_types))
        self._events: DataFrame | None = None

    def events(self, root: str, date: dt.date, window_days: int, event_types: tuple[str, ...] = ()) -> DataFrame | None:
        """The kept window if it is the one asked for (read and kept now if no stage has read it yet), else None."""
        if (root, date, window_days, tuple(event_types)) != self._key:
            return None
        if self._events is None:
            self._events = keep(read_events_window(self._spark, *self._key))
        return self._events

    @property
    def read(self) -> bool:
        """Whether a stage has read the window (and Spark keeps it)."""
        return self._events is not None

    def release(self) -> None:
        if self._events is not None:
            self._events.unpersist()
            self._events = None

    def __enter__(self) -> "KeptWindow":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def keep(frame: DataFrame) -> DataFrame:
    """``frame`` kept by Spark on the executors' local disk (``DISK_ONLY``) from its first computation until
    ``unpersist``: every later pass reads it there instead of computing it again from the source.

    Disk, not memory: the stages that pass over a kept frame need the heap themselves (Parquet reads, shuffles),
    and a frame kept in memory crowds them out. With ``MEMORY_AND_DISK`` a 1M-user window in a 1g local driver
    filled the storage memory, and reading its spilled blocks back (Spark copies a block into the heap whole to
    cache it again) ran out of heap in most runs; on disk the same stage finished every time, and no slower
    (docs/performance.md). The OS's page cache keeps a small frame in memory anyway.
    """
    from pyspark import StorageLevel

    return frame.persist(StorageLevel.DISK_ONLY)


def events_window_once(spark: SparkSession, root: str, date: dt.date, window_days: int,
                       event_types: tuple[str, ...] = (), kept: KeptWindow | None = None) -> DataFrame:
    """:func:`read_events_window`, or the window ``kept`` holds when it is this one."""
    window = kept.events(root, date, window_days, event_types) if kept is not None else None
    return window if window is not None else read_events_window(spark, root, date, window_days, event_types)


def read_events(spark: SparkSession, root: str, keep: Callable[[dt.date], bool] = lambda d: True) -> DataFrame | None:
    """Events of the partitions whose date ``keep`` accepts, every file's footer checked first; None if
    none of them holds a file. The nightly job reads a window; ``recsys evaluate`` reads everything."""
    fs, parts = list_partitions(root, "events")
    chosen = [p for p in (with_files(fs, p) for p in parts if keep(p.date)) if p.files]
    if not chosen:
        return None
    check_files(fs, [f for p in chosen for f in p.files], EVENTS_FILE_COLUMNS, "events")
    events = spark.read.option("basePath", root).parquet(*[p.path for p in chosen])
    events = check_columns(events, EVENTS_COLUMNS, "events", root)
    return events.coalesce(read_tasks(spark, sum(p.bytes for p in chosen)))


def read_tasks(spark: SparkSession, data_bytes: int) -> int:
    """The most tasks a read of ``data_bytes`` of files needs: one per ``spark.sql.files.maxPartitionBytes``, and
    no fewer than ``spark.sql.shuffle.partitions`` (the parallelism the job's other stages run with).

    Spark splits a read by bytes but counts every file as at least ``spark.sql.files.openCostInBytes`` (4 MiB), so
    a log of many small daily files is read in far more tasks than its bytes need. A window that a night keeps
    (:class:`KeptWindow`) keeps that partitioning, and every stage that scans it pays for every task again.
    Coalescing to this number never splits a partition, and leaves a read that Spark split by its bytes about as it
    was (figures: docs/performance.md, "Reading many small partitions")."""
    per_task = byte_string(spark.conf.get("spark.sql.files.maxPartitionBytes", "128m"), default=128 << 20)
    floor = int(spark.conf.get("spark.sql.shuffle.partitions", "200"))
    return max(1, floor, -(-data_bytes // max(1, per_task)))


_BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
               "t": 1 << 40, "tb": 1 << 40, "p": 1 << 50, "pb": 1 << 50}


def byte_string(value: str, default: int) -> int:
    """A size as Spark's configuration spells it (``134217728b``, ``128m``, ``1g``; binary units), or ``default``
    when it is spelled otherwise (Spark itself refuses such a value where it reads it).

    >>> byte_string("134217728b", 0), byte_string("128MB", 0), byte_string("1k", 0), byte_string("a lot", 7)
    (134217728, 134217728, 1024, 7)
    """
    match = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", value.lower())
    if match is None or match.group(2) not in _BYTE_UNITS:
        return default
    return int(match.group(1)) * _BYTE_UNITS[match.group(2)]


def events_window(events: DataFrame, date: dt.date, window_days: int, event_types: tuple[str, ...] = ()) -> DataFrame:
    start = window_start(date, window_days)
    day_start = dt.datetime.combine(date, dt.time())
    window = events.filter(
        (F.col(PARTITION_COLUMN) >= F.lit(start)) & (F.col(PARTITION_COLUMN) < F.lit(date))
    ).filter(F.col("ts") < F.lit(day_start))
    if event_types:
        window = window.filter(F.col("event_type").isin(list(event_types)))
    return window.select("user_id", "item_id", "event_type", "ts")


def read_catalog_snapshot(spark: SparkSession, root: str, date: dt.date, max_age_days: int = 0,
                          columns: tuple[str, ...] = ()) -> CatalogSnapshot:
    """The newest catalog partition on or before ``date``: the catalog as the business saw it then.

    ``columns``: descriptive columns read into ``table`` too (the operators' catalog rules), those the snapshot
    has: whoever asked judges a missing one (its name is in the frame's columns or not)."""
    fs, parts = list_partitions(root, "catalog")
    snapshot = None
    for part in reversed([p for p in parts if p.date <= date]):
        part = with_files(fs, part)
        if part.files:
            snapshot = part
            break
    if snapshot is None:
        raise InputDataError(
            f"no catalog snapshot on or before {date} under {redact_uri(root)!r}; "
            f"write catalog/{partition_name(date)}/ or run for a later date"
        )
    if max_age_days and (date - snapshot.date).days > max_age_days:
        raise InputDataError(
            f"the newest catalog snapshot on or before {date} is {snapshot.date}, {(date - snapshot.date).days} days "
            f"old, older than catalog.max_age_days={max_age_days}; publish a fresh snapshot or raise the limit"
        )
    check_files(fs, snapshot.files, CATALOG_FILE_COLUMNS, "catalog")
    frame = spark.read.parquet(snapshot.path)
    frame = check_columns(frame.drop(PARTITION_COLUMN), CATALOG_COLUMNS, "catalog", root)
    extra = tuple(c for c in columns if c in frame.columns and c not in CATALOG_COLUMNS)
    return CatalogSnapshot(snapshot.date, frame, _catalog_table(fs, snapshot.files, root, extra))


def _catalog_table(fs: pafs.FileSystem, files: list[str], root: str, extra: tuple[str, ...] = ()) -> pa.Table:
    """The snapshot's ``item_id`` and ``available`` columns, read with pyarrow on the driver.

    A snapshot is one row per catalog item (tens of thousands): reading it here takes milliseconds,
    where Spark spent seconds of jobs (two distinct counts and a distinct) on the same few MB.
    The footers were checked already (``check_files``); accepted narrower types are cast.
    """
    parts = []
    for path in files:
        try:
            t = pq.read_table(path, filesystem=fs, columns=["item_id", "available", *extra])
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
            raise InputDataError(f"catalog: cannot read {redact_text(path)} under {redact_uri(root)!r} ({exc}); rewrite or remove the file "
                                 f"and rerun") from None
        parts.append(pa.table({"item_id": t.column("item_id").cast(pa.int64()),
                               "available": t.column("available").cast(pa.bool_()),
                               **{c: t.column(c) for c in extra}}))
    if not parts:
        return pa.table({"item_id": pa.array([], pa.int64()), "available": pa.array([], pa.bool_())})
    try:
        return pa.concat_tables(parts, promote_options="permissive")   # a rule column typed differently per file
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputDataError(f"catalog: the files under {redact_uri(root)!r} disagree on a column's type ({first_line(exc)}); "
                             f"rewrite them with one type") from None


def catalog_figures(catalog: CatalogSnapshot, root: str) -> tuple[dict[str, int], np.ndarray]:
    """Counts of the snapshot, and its available item ids (sorted); refuses a snapshot that cannot be trusted.

    A null or repeated ``item_id`` means the export is broken (which row says whether the item is
    available?), an empty snapshot or one without available items would publish nothing useful:
    each stops the run with the snapshot named.
    """
    figures, duplicated_ids, available_ids = _arrow_catalog_counts(catalog.table)
    where = f"catalog snapshot {catalog.date} under {redact_uri(root)!r}"
    if figures["rows"] == 0:
        raise InputDataError(f"{where} is empty; nothing can be recommended - fix the catalog export")
    if figures["null_item_ids"]:
        raise InputDataError(f"{where} has {figures['null_item_ids']} row(s) with a null item_id; "
                             f"every catalog row needs an id - fix the catalog export")
    duplicated = figures["rows"] - figures["distinct_items"]
    if duplicated:
        examples = duplicated_ids()
        raise InputDataError(f"{where} has {duplicated} duplicate row(s) (item_id {', '.join(map(str, examples))} "
                             f"among them); each item must appear once per snapshot - fix the catalog export")
    if figures["available_items"] == 0:
        raise InputDataError(f"{where} has {figures['rows']} items but none is available; nothing can be recommended")
    return figures, available_ids()


def _arrow_catalog_counts(table: pa.Table):
    """Counts of a snapshot read on the driver: numpy over two columns."""
    ids = table.column("item_id")
    valid = ~np.asarray(ids.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    values = ids.fill_null(0).to_numpy().astype(np.int64)[valid]
    available = np.asarray(table.column("available").fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)[valid]
    uniq, counts = np.unique(values, return_counts=True)
    available_ids = np.unique(values[available])
    figures = {"rows": table.num_rows, "null_item_ids": int((~valid).sum()), "distinct_items": int(len(uniq)),
               "available_items": int(len(available_ids))}
    return figures, lambda: uniq[counts > 1][:5].tolist(), lambda: available_ids
