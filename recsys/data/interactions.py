"""Import any interaction log (a CSV file, plain or compressed) into the events and catalog contracts.

MovieLens has its own importer; every other log (a shop's clicks, edits, plays, check-ins) comes
in here. What it does, and why:

- **Columns by name.** The user, item and time columns are given (``ColumnMapping``) or
  recognised from the header among common names (``user_id``, ``visitorid``, ``page_id``,
  ``timestamp``, ...); a name that fits two columns is refused rather than guessed. The event
  type is a column (``event_type``/``event``/``action`` recognised) or one fixed value.
- **Timestamps** are Unix seconds, milliseconds or microseconds, or ISO 8601 strings (with or
  without a zone offset: without one they are UTC). ``auto`` decides on the first block: numbers
  or ISO strings, whichever most values are, and for numbers the unit by magnitude (below 1e11:
  seconds, below 1e14: milliseconds, else microseconds), and says what it decided. Numbers can
  count from another origin than 1970 (``time_origin``), for logs that give seconds since their
  own start.
- **Ids.** Whole-number ids are kept as they are. Other ids (strings) become stable 60-bit ids:
  the first 15 hex digits of the MD5 of the UTF-8 string, as an integer. The same string gets
  the same id in every import, so a log imported again next week, or another file of the same
  shop, agrees with the model trained on the first; and any SQL engine computes it
  (``CAST(conv(substr(md5(key), 1, 15), 16, 10) AS BIGINT)`` in Spark), so lists can be joined
  back to the original keys without this tool. The dictionary (id, original string) is written
  beside the data too (``ids/``), and two strings with the same id (about one chance in 20,000
  for ten million ids) stop the import rather than merge two users or items.
- **Bad rows are counted, never dropped silently.** A row with a missing value, an id that is
  not a whole number, a timestamp that does not parse or lies outside 1970-9999, the wrong number
  of fields or nothing at all is left out and counted by reason, with its line number. Above
  ``max_bad_share`` of the rows the import fails (nothing written) with one line naming the
  first bad rows: a share that large is a wrong mapping, not a dirty log.
- **Streaming.** The file is read block by block (``pyarrow.csv.open_csv``); rows wait in memory
  per day up to ``flush_rows`` and are then written, so memory stays bounded by that, the
  catalog and the distinct ids, whatever the file's size. Everything is written into a staging
  directory first and moved into place only when the whole file is read and under the bad-row
  limit: a failed import leaves the output as it was.

The output is the input layout: ``events/dt=YYYY-MM-DD/`` (one partition per UTC day), one
``catalog/dt=.../`` snapshot dated at the first event's day listing every item with an event as
available (as the MovieLens importer does, and for the same reason), ``ids/`` for string ids, and
``import_report.json`` (the mapping used, counts, bad rows by reason with examples).
"""
from __future__ import annotations

import bisect
import codecs
import csv
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys.data._output import CATALOG_DIRNAME, EVENTS_DIRNAME, check_dataset_dirs, prepare_dataset_dirs
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition
from recsys.errors import InputDataError, first_line

# Header names recognised for each role, compared lower-cased with everything but letters and digits removed.
USER_NAMES = ("userid", "user", "uid", "visitorid", "visitor", "customerid", "customer", "memberid", "accountid",
              "clientid", "readerid", "listenerid", "viewerid")
ITEM_NAMES = ("itemid", "item", "movieid", "movie", "pageid", "page", "productid", "product", "articleid", "article",
              "trackid", "track", "songid", "song", "videoid", "video", "bookid", "book", "contentid", "docid",
              "documentid", "sku", "asin")
TIME_NAMES = ("timestamp", "ts", "time", "seconds", "datetime", "eventtime", "createdat", "date", "unixtime")
EVENT_TYPE_NAMES = ("eventtype", "event", "action")
DEFAULT_EVENT_TYPE = "interaction"

TIME_FORMATS = ("auto", "s", "ms", "us", "iso")
ID_KINDS = ("auto", "int", "string")
# Values that mean "no value" in the logs people export (pandas writes nan, Hive \N), compared lower-cased.
NULL_MARKERS = ("", "null", "none", "nan", "na", "n/a", "\\n")

# Why a row was left out, in the order a row is checked: a row counts once, for its first problem.
BLANK_LINE = "blank line"
MISSING_VALUE = "missing value"
UNPARSEABLE_ID = "unparseable id"
UNPARSEABLE_TIMESTAMP = "unparseable timestamp"
TIMESTAMP_OUT_OF_RANGE = "timestamp out of range"
WRONG_FIELD_COUNT = "wrong number of fields"
REASONS = (BLANK_LINE, MISSING_VALUE, UNPARSEABLE_ID, UNPARSEABLE_TIMESTAMP, TIMESTAMP_OUT_OF_RANGE,
           WRONG_FIELD_COUNT)
EXAMPLES_PER_REASON = 5

IDS_DIRNAME = "ids"
REPORT_NAME = "import_report.json"

_US_PER = {"s": 1_000_000, "ms": 1_000, "us": 1}
_MAX_US = 253_402_300_799_999_999          # 9999-12-31T23:59:59.999999Z; the minimum is the Unix epoch
_DAY_US = 86_400 * 1_000_000
_INT_ID = r"^\d{1,19}(\.0+)?$"             # 12 and 12.0 (ids exported from a float column) alike
_INT_NUMBER = r"^-?\d{1,18}$"
_DECIMAL_NUMBER = r"^-?\d{1,18}\.\d*$"
_ISO = (r"^(?P<date>\d{4}-\d{2}-\d{2})(?:[T ](?P<hour>\d{2}):(?P<minute>\d{2})"
        r"(?::(?P<second>\d{2})(?:[.,](?P<frac>\d{1,9}))?)?)?\s*(?P<zone>[Zz]|[+-]\d{2}(?::?\d{2})?)?$")
_SNIFF_BYTES = 64 * 1024
_PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class ColumnMapping:
    """Which CSV column holds what. ``None``: recognised from the header (user, item, time, event type);
    ``event_type`` (a fixed value) and ``event_type_column`` exclude each other; ``title`` and ``category``
    are only ever taken when given. Without a header, columns are named ``1``, ``2``, ... by position."""

    user: str | None = None
    item: str | None = None
    time: str | None = None
    event_type_column: str | None = None
    event_type: str | None = None
    title: str | None = None
    category: str | None = None


@dataclass(frozen=True)
class ImportOptions:
    """How to read the file. ``time_origin``: what numeric timestamps count from (default: the Unix epoch);
    ``max_bad_share``: the share of bad rows above which the import fails; ``flush_rows``: rows held in
    memory before they are written; ``block_size``: bytes parsed at a time."""

    time_format: str = "auto"
    time_origin: dt.datetime | None = None
    user_ids: str = "auto"
    item_ids: str = "auto"
    delimiter: str | None = None
    header: bool = True
    encoding: str = "utf8"
    max_bad_share: float = 0.01
    flush_rows: int = 2_000_000
    block_size: int = 2 << 20           # the reader reads some 20 blocks ahead: about 40 MB


@dataclass(frozen=True)
class BadRow:
    line: int | None          # 1-based line of the file (the header is line 1); None if unknown
    column: str | None        # the column at fault (None: the whole row)
    value: str

    def __str__(self) -> str:
        where = f"line {self.line}" if self.line is not None else "a row"
        what = f"{self.column} {self.value!r}" if self.column is not None else repr(self.value)
        return f"{where}, {what}"


@dataclass(frozen=True)
class InteractionsSummary:
    """What was imported; ``bad`` counts rows left out by reason, ``examples`` the first few of each."""

    source: Path
    rows: int
    events: int
    bad: dict[str, int]
    examples: dict[str, list[BadRow]]
    users: int
    items: int
    first_date: dt.date
    last_date: dt.date
    days: int
    events_dir: Path
    catalog_dir: Path
    catalog_date: dt.date
    columns: dict[str, str | None]
    event_type: str | None
    time_format: str
    id_kinds: dict[str, str]
    id_maps: dict[str, Path]
    report: Path
    seconds: float

    @property
    def bad_rows(self) -> int:
        return sum(self.bad.values())

    def __str__(self) -> str:
        bad = ", ".join(f"{n:,} {reason}" for reason, n in self.bad.items() if n) or "none"
        return (
            f"interactions: {self.events:,} events of {self.rows:,} rows (bad rows left out: {bad}) by "
            f"{self.users:,} users on {self.days:,} days {self.first_date}..{self.last_date} -> {self.events_dir}; "
            f"catalog of {self.items:,} items dated {self.catalog_date} -> {self.catalog_dir}; "
            f"report {self.report}"
        )


def import_interactions(
    csv_path: Path,
    out: Path,
    *,
    columns: ColumnMapping = ColumnMapping(),
    options: ImportOptions = ImportOptions(),
    progress: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> InteractionsSummary:
    """Write ``out/events/dt=.../``, one ``out/catalog/dt=.../`` snapshot, ``out/ids/`` and the report.

    Raises :class:`InputDataError` (nothing written) for a missing or unreadable file, a mapping that
    does not fit its header, too many bad rows or colliding string ids. ``out`` must not hold date
    partitions already unless ``overwrite`` (see ``_output``).
    """
    say = progress or (lambda _message: None)
    started = time.perf_counter()
    csv_path, out = Path(csv_path), Path(out)
    _check_options(options, columns)
    check_dataset_dirs(out, overwrite=overwrite)
    source = _Source.open(csv_path, options)
    staging = out / f".import-{uuid.uuid4().hex[:12]}"
    try:
        roles = _resolve_columns(source.names, columns, options.header, csv_path)
        say(f"reading {csv_path} ({source.size:,} bytes{', ' + source.codec if source.codec else ''}, delimiter "
            f"{source.delimiter!r}): " + ", ".join(f"{role} <- {name}" for role, name in roles.items() if name)
            + ("" if roles["event_type"] else f", event type {columns.event_type or DEFAULT_EVENT_TYPE!r}"))
        out.mkdir(parents=True, exist_ok=True)
        state = _Import(source, roles, columns, options, staging, say, csv_path)
        state.run()
        return state.publish(out, overwrite=overwrite, seconds=time.perf_counter() - started)
    finally:
        source.close()
        shutil.rmtree(staging, ignore_errors=True)


def _check_options(options: ImportOptions, columns: ColumnMapping) -> None:
    if options.time_format not in TIME_FORMATS:
        raise InputDataError(f"time format {options.time_format!r} is not one of {', '.join(TIME_FORMATS)}")
    for name, kind in (("user ids", options.user_ids), ("item ids", options.item_ids)):
        if kind not in ID_KINDS:
            raise InputDataError(f"{name} kind {kind!r} is not one of {', '.join(ID_KINDS)}")
    share = options.max_bad_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise InputDataError(f"the bad-row limit must be a share from 0 to 1 (e.g. 0.01 for 1%), got {share!r}")
    if options.time_origin is not None and options.time_format == "iso":
        raise InputDataError("a time origin applies to numeric timestamps, not to ISO 8601 ones: leave it out")
    if columns.event_type is not None and columns.event_type_column is not None:
        raise InputDataError("give the event type as a column or as one fixed value, not both")
    if columns.event_type is not None and not columns.event_type.strip():
        raise InputDataError("the fixed event type is empty: give a name such as 'view' or 'edit'")
    if options.delimiter is not None and len(options.delimiter) != 1:
        raise InputDataError(f"the delimiter must be one character (\\t for tabs), got {options.delimiter!r}")
    if options.flush_rows < 1 or options.block_size < 1024:
        raise InputDataError("flush_rows must be >= 1 and block_size >= 1024 bytes")


# --------------------------------------------------------------------------- the file


@dataclass
class _Source:
    """The open CSV stream, its column names and what line numbers mean in it."""

    path: Path
    names: list[str]
    delimiter: str
    codec: str | None
    size: int
    raw: pa.NativeFile
    reader: pacsv.CSVStreamingReader | None = None
    first_data_line: int = 2
    invalid_lines: list[int] = field(default_factory=list)     # malformed lines not yet placed in a batch
    invalid_count: int = 0
    invalid_examples: list[BadRow] = field(default_factory=list)

    @classmethod
    def open(cls, path: Path, options: ImportOptions) -> "_Source":
        if not path.exists():
            raise InputDataError(f"interaction file {path} does not exist: check the path")
        if not path.is_file():
            raise InputDataError(f"interaction file {path} is not a file: pass the CSV file itself")
        codec = _codec(path)
        head = _head_text(path, codec, options.encoding)
        lines = head.splitlines()
        if not any(ln.strip() for ln in lines):
            raise InputDataError(f"interaction file {path} is empty: pass a CSV file with a header and rows")
        if not lines[0].strip():
            raise InputDataError(f"{path}: the first line is empty: the header (or, without one, the first row) "
                                 "must be on the first line")
        delimiter = options.delimiter or _sniff_delimiter(lines[0], path)
        first = next(csv.reader([lines[0]], delimiter=delimiter))
        if options.header:
            names = [n.strip() for n in first]
            if len(set(names)) != len(names) or not all(names):
                raise InputDataError(f"{path}: the header {lines[0][:120]!r} has an empty or repeated column name: "
                                     "fix the header, or pass --no-header and name columns by position")
        else:
            names = [str(i + 1) for i in range(len(first))]
        source = cls(path=path, names=names, delimiter=delimiter, codec=codec, size=path.stat().st_size,
                     raw=pa.OSFile(str(path), "rb"), first_data_line=2 if options.header else 1)
        return source

    def start(self, wanted: list[str], options: ImportOptions) -> None:
        stream = pa.CompressedInputStream(self.raw, self.codec) if self.codec else self.raw
        try:
            self.reader = pacsv.open_csv(
                stream,
                read_options=pacsv.ReadOptions(
                    use_threads=False,             # line numbers in bad-row reports need a serial reader
                    block_size=options.block_size, column_names=self.names, skip_rows=int(options.header),
                    encoding=options.encoding),
                parse_options=pacsv.ParseOptions(delimiter=self.delimiter, ignore_empty_lines=False,
                                                 invalid_row_handler=self._invalid_row),
                convert_options=pacsv.ConvertOptions(
                    column_types={name: pa.string() for name in wanted}, include_columns=wanted,
                    strings_can_be_null=False, quoted_strings_can_be_null=False),
            )
        except (pa.ArrowInvalid, UnicodeDecodeError) as err:
            raise self._read_error(err) from None

    def _invalid_row(self, row) -> str:
        self.invalid_count += 1
        if row.number is not None:
            bisect.insort(self.invalid_lines, int(row.number))
        if len(self.invalid_examples) < EXAMPLES_PER_REASON:
            self.invalid_examples.append(BadRow(row.number, None, f"{row.text[:80]} "
                                                f"({row.actual_columns} fields, not {row.expected_columns})"))
        return "skip"

    def batches(self):
        """``(batch, its first line, its last line, the malformed lines skipped between them)``: a batch's
        rows are the lines after the previous batch's, less the malformed ones the handler skipped. The
        handler may run a block ahead of the batches, so its line numbers are kept sorted and consumed
        as the batches pass them."""
        line = self.first_data_line
        while True:
            try:
                batch = self.reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, UnicodeDecodeError) as err:
                raise self._read_error(err, after_line=line) from None
            n = batch.num_rows
            end = line + n - 1
            while True:                          # the last line: n rows plus the skipped lines among them
                skipped = bisect.bisect_right(self.invalid_lines, end) - bisect.bisect_left(self.invalid_lines, line)
                if line + n - 1 + skipped == end:
                    break
                end = line + n - 1 + skipped
            lo, hi = bisect.bisect_left(self.invalid_lines, line), bisect.bisect_right(self.invalid_lines, end)
            skipped_here = self.invalid_lines[lo:hi]
            del self.invalid_lines[:hi]
            yield batch, line, end, skipped_here
            line = end + 1

    @property
    def position(self) -> int:
        """Bytes of the file read so far (compressed bytes for a compressed file), for progress."""
        try:
            return self.raw.tell()
        except (OSError, ValueError):
            return 0

    def close(self) -> None:
        if not self.raw.closed:
            self.raw.close()

    def _read_error(self, err: BaseException, after_line: int | None = None) -> InputDataError:
        message = first_line(err, limit=300)
        where = f" after line {after_line - 1}" if after_line and after_line > self.first_data_line else ""
        if "UTF8" in message or "utf-8" in message.lower() or isinstance(err, UnicodeDecodeError):
            return InputDataError(f"{self.path}: text that is not UTF-8{where} ({message}): pass the file's "
                                  "encoding, e.g. --encoding latin-1")
        return InputDataError(f"{self.path}: cannot read as CSV{where}: {message}")


_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4", ".br": "brotli"}


def _codec(path: Path) -> str | None:
    """The compression a file's extension names (what ``pyarrow.csv`` would infer from a path)."""
    return _CODECS.get(path.suffix.lower())


def _head_text(path: Path, codec: str | None, encoding: str) -> str:
    try:
        with pa.input_stream(str(path), compression=codec) as f:
            head = f.read(_SNIFF_BYTES)
    except (OSError, pa.ArrowInvalid) as err:
        raise InputDataError(f"{path}: cannot read ({first_line(err)}): is it a {codec or 'plain'} file?") from None
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        raise InputDataError(f"unknown encoding {encoding!r}: pass one Python knows, e.g. utf8 or latin-1") from None
    text = codecs.getincrementaldecoder("utf-8-sig" if name == "utf-8" else name)("replace").decode(head)
    if len(head) == _SNIFF_BYTES:
        text = text[: text.rfind("\n") + 1] or text
    return text


def _sniff_delimiter(line: str, path: Path) -> str:
    counts = {d: line.count(d) for d in (",", "\t", ";", "|")}
    best = max(counts, key=counts.get)
    if counts[best] == 0:
        raise InputDataError(f"{path}: no delimiter in the first line {line[:120]!r}: a CSV needs at least the user, "
                             "item and time columns; pass the delimiter if it is not , tab ; or |")
    return best


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _resolve_columns(names: list[str], columns: ColumnMapping, header: bool, path: Path) -> dict[str, str | None]:
    """role -> column name (None for an absent optional role), each checked against the header."""
    roles: dict[str, str | None] = {}
    given = {"user": columns.user, "item": columns.item, "time": columns.time,
             "event_type": columns.event_type_column, "title": columns.title, "category": columns.category}
    shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    for role, name in given.items():
        if name is not None:
            if name not in names:
                raise InputDataError(f"{path}: no column {name!r} for the {role.replace('_', ' ')} "
                                     f"(columns: {shown})" + ("" if header else "; without a header, columns are "
                                                              "named 1, 2, ... by position"))
            roles[role] = name
    recognised = {"user": USER_NAMES, "item": ITEM_NAMES, "time": TIME_NAMES}
    if columns.event_type is None:
        recognised["event_type"] = EVENT_TYPE_NAMES
    for role, candidates in recognised.items():
        if role in roles:
            continue
        if not header:
            if role == "event_type":
                continue
            raise InputDataError(f"{path}: without a header the {role} column must be given by position, "
                                 f"e.g. --{role} 1")
        taken = set(roles.values())
        found = [n for n in names if _norm(n) in candidates and n not in taken]
        if len(found) > 1:
            option = "--event-type-column" if role == "event_type" else f"--{role}"
            raise InputDataError(f"{path}: columns {', '.join(found)} could each be the {role.replace('_', ' ')}: "
                                 f"say which, e.g. {option} {found[0]}")
        if not found and role != "event_type":
            raise InputDataError(f"{path}: no {role} column recognised among {shown}: name it, e.g. --{role} COLUMN")
        roles[role] = found[0] if found else None
    for role in ("event_type", "title", "category"):
        roles.setdefault(role, None)
    used = [n for n in roles.values() if n is not None]
    if len(set(used)) != len(used):
        repeated = next(n for n in used if used.count(n) > 1)
        raise InputDataError(f"{path}: column {repeated!r} is mapped to two roles: each role needs its own column")
    return {role: roles[role] for role in ("user", "item", "time", "event_type", "title", "category")}


# --------------------------------------------------------------------------- one import


class _Import:
    """The import's state while it reads: formats decided on the first block, bad rows, day buffers,
    distinct ids, id dictionaries and catalog metadata."""

    def __init__(self, source: _Source, roles: dict[str, str | None], columns: ColumnMapping,
                 options: ImportOptions, staging: Path, say: Callable[[str], None], path: Path):
        self.source, self.roles, self.options, self.say, self.path = source, roles, options, say, path
        self.fixed_event_type = None if roles["event_type"] else (columns.event_type or DEFAULT_EVENT_TYPE).strip()
        self.staging = staging
        self.time_format = options.time_format
        self.id_kinds = {"user": options.user_ids, "item": options.item_ids}
        self.rows = self.events = 0
        self.bad = {reason: 0 for reason in REASONS}
        self.examples: dict[str, list[BadRow]] = {reason: [] for reason in REASONS}
        self.buffers: dict[int, list[pa.Table]] = {}
        self.buffered = 0
        self.days_written: set[int] = set()
        self.users, self.items = _Distinct(), _Distinct()
        self.keys = {"user": _KeyMap("user"), "item": _KeyMap("item")}
        self.metadata = _Metadata()
        self.decided = False
        self.min_us, self.max_us = None, None

    # ---- reading

    def run(self) -> None:
        wanted = [n for n in self.roles.values() if n is not None]
        self.source.start(wanted, self.options)
        last_report = time.monotonic()
        for batch, first_line_no, last_line_no, skipped in self.source.batches():
            if not self.decided and self._has_times(batch):
                self._decide_formats(batch)
                self.decided = True
            self._take(batch, first_line_no, last_line_no, skipped)
            if time.monotonic() - last_report >= _PROGRESS_EVERY_S:
                last_report = time.monotonic()
                self.say(self._progress_line())
        self.rows += self.source.invalid_count
        self.bad[WRONG_FIELD_COUNT] = self.source.invalid_count
        self.say(self._progress_line().replace(" so far", "") + ": all read")
        self.examples[WRONG_FIELD_COUNT] = self.source.invalid_examples
        self._flush()
        self._check_bad_share()

    def _progress_line(self) -> str:
        done = self.source.position / self.source.size if self.source.size else 0.0
        return (f"read {self.rows:,} rows ({done:.0%} of {self.path.name}), {self.events:,} events on "
                f"{len(self.days_written | set(self.buffers)):,} days, {sum(self.bad.values()):,} bad rows so far")

    def _has_times(self, batch: pa.RecordBatch) -> bool:
        return batch.num_rows > 0 and not pc.all(_missing(_clean(batch.column(self.roles["time"])))).as_py()

    def _decide_formats(self, batch: pa.RecordBatch) -> None:
        """``auto`` settings, decided once on the first block and said, so a surprise shows at once."""
        if self.time_format == "auto":
            values = _clean(batch.column(self.roles["time"]))
            present = pc.invert(_missing(values))
            numeric = pc.sum(pc.and_(present, pc.match_substring_regex(values, r"^-?\d+(\.\d*)?$"))).as_py() or 0
            iso = pc.sum(pc.and_(present, pc.match_substring_regex(values, _ISO))).as_py() or 0
            if numeric == 0 and iso == 0:
                sample = next((v for v in values.to_pylist() if v), "")
                raise InputDataError(f"{self.path}: the timestamps of column {self.roles['time']!r} are neither "
                                     f"numbers nor ISO 8601 (e.g. {sample[:40]!r}): check the time column")
            if iso > numeric:
                self.time_format = "iso"
                self.say("timestamps: ISO 8601 (auto; without a zone offset they are taken as UTC)")
            else:
                numbers = pc.cast(pc.filter(values, pc.match_substring_regex(values, r"^-?\d+(\.\d*)?$")),
                                  pa.float64())
                top = float(pc.max(pc.abs(numbers)).as_py() or 0.0)
                self.time_format = "s" if top < 1e11 else "ms" if top < 1e14 else "us"
                name = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}[self.time_format]
                self.say(f"timestamps: {name} since {self._origin_text()} (auto: the first block's largest is "
                         f"{top:.0f}); pass the time unit if that is wrong")
        if self.time_format == "iso" and self.options.time_origin is not None:
            raise InputDataError(f"{self.path}: the timestamps are ISO 8601, which a time origin does not apply to: "
                                 "leave the time origin out")
        for role in ("user", "item"):
            if self.id_kinds[role] != "auto":
                continue
            # Whole numbers unless treating the others as bad rows would break the bad-row limit: one stray
            # value does not turn a numeric column into strings, a column of names is strings at once.
            values = _clean(batch.column(self.roles[role]))
            present = pc.invert(_missing(values))
            n_present = pc.sum(present).as_py() or 0
            n_whole = pc.sum(pc.and_(present, pc.match_substring_regex(values, _INT_ID))).as_py() or 0
            other = n_present - n_whole
            self.id_kinds[role] = "int" if n_present and other <= self.options.max_bad_share * n_present else "string"
            if self.id_kinds[role] == "int":
                self.say(f"{role} ids: whole numbers, kept as they are (auto: {n_whole:,} of {n_present:,} in the "
                         f"first block){'' if not other else '; the others are bad rows, or pass string ids'}")
            else:
                example = pc.filter(values, pc.and_(present, pc.invert(pc.match_substring_regex(values, _INT_ID))))
                self.say(f"{role} ids: strings (auto, e.g. {example[0].as_py()[:40]!r}), mapped to stable 60-bit ids; "
                         f"the dictionary goes to {IDS_DIRNAME}/{role}_ids.parquet")

    def _origin_text(self) -> str:
        origin = self.options.time_origin
        return "1970-01-01 (Unix time)" if origin is None else origin.isoformat()

    def _take(self, batch: pa.RecordBatch, first_line_no: int, last_line_no: int, skipped: list[int]) -> None:
        n = batch.num_rows
        self.rows += n
        if n == 0:
            return
        reason = np.zeros(n, dtype=np.int8)          # 0: good, else 1 + index into REASONS
        values = {role: _clean(batch.column(name)) for role, name in self.roles.items() if name is not None}
        required = ["user", "item", "time"] + (["event_type"] if self.roles["event_type"] else [])
        missing = {role: _missing(values[role]).to_numpy(zero_copy_only=False) for role in required}
        blank = np.logical_and.reduce([_missing(v).to_numpy(zero_copy_only=False) for v in values.values()])
        culprit = np.full(n, -1, dtype=np.int8)       # index into ``required``: which column was bad
        _mark(reason, culprit, blank, BLANK_LINE, -1)
        for i, role in enumerate(required):
            _mark(reason, culprit, missing[role], MISSING_VALUE, i)
        ids = {}
        for i, role in enumerate(("user", "item")):
            ids[role], ok = self._ids(role, values[role])
            _mark(reason, culprit, ~ok, UNPARSEABLE_ID, i)
        ts, parsed, in_range = self._timestamps(values["time"])
        _mark(reason, culprit, ~parsed, UNPARSEABLE_TIMESTAMP, 2)
        _mark(reason, culprit, ~in_range, TIMESTAMP_OUT_OF_RANGE, 2)

        if reason.any():
            self._record_bad(reason, culprit, required, values, first_line_no, last_line_no, skipped)
        good = reason == 0
        if not good.any():
            return
        keep = pa.array(good)
        if self.fixed_event_type is not None:
            event_type = pc.cast(pc.take(pa.array([self.fixed_event_type]),
                                         pa.array(np.zeros(int(good.sum()), dtype=np.int32))), pa.string())
        else:
            event_type = pc.filter(values["event_type"], keep)
        user, item, ts = ids["user"][good], ids["item"][good], ts[good]
        for role in ("user", "item"):
            if self.id_kinds[role] == "string":
                self.keys[role].add(ids[role][good], pc.filter(values[role], keep))
        self.users.add(user)
        self.items.add(item)
        if self.roles["title"] or self.roles["category"]:
            self.metadata.add(item, *(pc.filter(values[r], keep) if self.roles[r] else None
                                      for r in ("title", "category")))
        self.events += len(user)
        self.min_us = int(ts.min()) if self.min_us is None else min(self.min_us, int(ts.min()))
        self.max_us = int(ts.max()) if self.max_us is None else max(self.max_us, int(ts.max()))
        table = pa.table({"user_id": pa.array(user, pa.int64()), "item_id": pa.array(item, pa.int64()),
                          "event_type": event_type, "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))},
                         schema=EVENTS_SCHEMA)
        self._buffer(table, ts // _DAY_US)

    def _ids(self, role: str, values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, parsed)``: int64 ids (0 where not parsed) and whether each parsed (missing values count
        as parsed here: they are reported as missing)."""
        absent = _missing(values)
        if self.id_kinds[role] == "string":
            return self.keys[role].ids_of(values, absent), np.ones(len(values), dtype=bool)
        whole = pc.match_substring_regex(values, _INT_ID)
        digits = pc.if_else(whole, pc.replace_substring_regex(values, r"\.0+$", ""), "0")
        number = pc.cast(digits, pa.uint64()).to_numpy(zero_copy_only=False)
        ok = whole.to_numpy(zero_copy_only=False) & (number <= np.uint64(2**63 - 1))
        return np.where(ok, number, 0).astype(np.int64), ok | absent.to_numpy(zero_copy_only=False)

    def _timestamps(self, values: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(microseconds since the epoch, parsed, in range)``; missing values count as parsed and in range
        (they are reported as missing)."""
        absent = _missing(values).to_numpy(zero_copy_only=False)
        if not self.decided:                       # no time value seen yet: every row here lacks one
            return np.full(len(values), -1, dtype=np.int64), absent, absent
        if self.time_format == "iso":
            us, parsed = _parse_iso(values)
        else:
            us, parsed = _parse_number(values, _US_PER[self.time_format], self.options.time_origin)
        in_range = (us >= 0) & (us <= _MAX_US)
        return us, parsed | absent, in_range | ~parsed | absent

    def _record_bad(self, reason: np.ndarray, culprit: np.ndarray, required: list[str], values: dict,
                    first_line_no: int, last_line_no: int, skipped: list[int]) -> None:
        lines = None
        for code in np.unique(reason[reason > 0]):
            name = REASONS[code - 1]
            rows = np.flatnonzero(reason == code)
            self.bad[name] += len(rows)
            room = EXAMPLES_PER_REASON - len(self.examples[name])
            if room <= 0:
                continue
            if lines is None:     # the batch's line numbers: its span less the malformed lines skipped in it
                lines = np.setdiff1d(np.arange(first_line_no, last_line_no + 1), np.asarray(skipped, dtype=np.int64))
            for row in rows[:room]:
                c = int(culprit[row])
                role = required[c] if c >= 0 else None
                value = values[role][int(row)].as_py() if role else ""
                self.examples[name].append(BadRow(int(lines[row]) if row < len(lines) else None,
                                                  self.roles[role] if role else None, value[:80]))

    # ---- writing

    def _buffer(self, table: pa.Table, day: np.ndarray) -> None:
        order = np.argsort(day, kind="stable")
        sorted_days = day[order]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(sorted_days)) + 1])
        ends = np.append(starts[1:], len(order))
        table = table.take(pa.array(order))
        for start, end in zip(starts, ends):
            self.buffers.setdefault(int(sorted_days[start]), []).append(table.slice(int(start), int(end - start)))
        self.buffered += len(order)
        if self.buffered >= self.options.flush_rows:
            self._flush()

    def _flush(self) -> None:
        """Each buffered day becomes one more file in its staged partition, sorted by time, user and item."""
        for day, parts in sorted(self.buffers.items()):
            table = pa.concat_tables(parts)
            table = table.sort_by([("ts", "ascending"), ("user_id", "ascending"), ("item_id", "ascending")])
            write_partition(table, self.staging / EVENTS_DIRNAME, _date(day), replace=False)
            self.days_written.add(day)
        self.buffers.clear()
        self.buffered = 0

    def _check_bad_share(self) -> None:
        bad = sum(self.bad.values())
        if self.rows == 0:
            raise InputDataError(f"{self.path}: no rows after the header: pass a file with at least one interaction")
        share = bad / self.rows
        if self.events == 0 or share > self.options.max_bad_share:
            detail = "; ".join(f"{self.bad[r]:,} {r} (first: {self.examples[r][0] if self.examples[r] else '?'})"
                               for r in REASONS if self.bad[r])
            raise InputDataError(
                f"{self.path}: {bad:,} of {self.rows:,} rows ({share:.2%}) are bad, more than the limit of "
                f"{self.options.max_bad_share:.2%} (--max-bad-share): {detail}; nothing was written: check the "
                "column mapping, time format and id kinds, fix the rows, or raise the limit")
        if bad:
            self.say(f"warning: {bad:,} of {self.rows:,} rows ({share:.3%}) are bad and left out: " + "; ".join(
                f"{self.bad[r]:,} {r} (first: {self.examples[r][0] if self.examples[r] else '?'})"
                for r in REASONS if self.bad[r]))

    def publish(self, out: Path, *, overwrite: bool, seconds: float) -> InteractionsSummary:
        """Catalog, ids and report into staging, then every staged partition into place."""
        first_day, last_day = min(self.days_written), max(self.days_written)
        catalog_date = _date(first_day)
        items = self.items.values()
        titles, categories = self.metadata.lookup(items)
        if titles is None and self.id_kinds["item"] == "string":
            titles = self.keys["item"].lookup(items)          # the original string, for people reading lists
        catalog = pa.table({
            "item_id": pa.array(items, pa.int64()), "available": pa.array(np.ones(len(items), dtype=bool)),
            "title": titles if titles is not None else pa.nulls(len(items), pa.string()),
            "category": categories if categories is not None else pa.nulls(len(items), pa.string()),
        }, schema=CATALOG_SCHEMA)
        write_partition(catalog, self.staging / CATALOG_DIRNAME, catalog_date)
        id_maps = {}
        for role in ("user", "item"):
            if self.id_kinds[role] == "string":
                id_maps[role] = self.keys[role].write(self.staging / IDS_DIRNAME / f"{role}_ids.parquet", self.path)
        self._warn_about_dates()

        events_dir, catalog_dir = prepare_dataset_dirs(out, overwrite=overwrite)
        for kind, target in ((EVENTS_DIRNAME, events_dir), (CATALOG_DIRNAME, catalog_dir)):
            for part in sorted((self.staging / kind).glob("dt=*")):
                os.replace(part, target / part.name)
        final_maps = {}
        ids_dir = out / IDS_DIRNAME
        for role in ("user", "item"):
            stale = ids_dir / f"{role}_ids.parquet"
            if role in id_maps:
                ids_dir.mkdir(exist_ok=True)
                os.replace(id_maps[role], stale)
                final_maps[role] = stale
            elif stale.exists():
                stale.unlink()                               # an earlier import's map, which these ids do not follow
        summary = InteractionsSummary(
            source=self.path, rows=self.rows, events=self.events, bad={r: n for r, n in self.bad.items()},
            examples=self.examples, users=self.users.count(), items=len(items),
            first_date=_date(first_day), last_date=_date(last_day), days=len(self.days_written),
            events_dir=events_dir, catalog_dir=catalog_dir, catalog_date=catalog_date,
            columns=dict(self.roles), event_type=self.fixed_event_type, time_format=self.time_format,
            id_kinds=dict(self.id_kinds), id_maps=final_maps, report=out / REPORT_NAME, seconds=seconds)
        _write_report(summary, self.options)
        return summary

    def _warn_about_dates(self) -> None:
        first, last = _date(self.min_us // _DAY_US), _date(self.max_us // _DAY_US)
        if self.time_format != "iso" and self.options.time_origin is None and first.year == 1970:
            self.say(f"warning: the events start on {first}: if the timestamps count from the log's own start, "
                     "pass its date as the time origin (--time-origin YYYY-MM-DD)")
        if (last - first).days > 50 * 366:
            self.say(f"warning: the events span {first}..{last}, more than 50 years: is the time unit right?")


def _mark(reason: np.ndarray, culprit: np.ndarray, bad: np.ndarray, name: str, column: int) -> None:
    """Give rows not yet bad this reason (a row counts once, for its first problem)."""
    new = bad & (reason == 0)
    reason[new] = REASONS.index(name) + 1
    culprit[new] = column


def _date(day: int) -> dt.date:
    return dt.date(1970, 1, 1) + dt.timedelta(days=int(day))


def _write_report(summary: InteractionsSummary, options: ImportOptions) -> None:
    report = {
        "source": str(summary.source),
        "columns": summary.columns,
        "event_type": summary.event_type,
        "time_format": summary.time_format,
        "time_origin": options.time_origin.isoformat() if options.time_origin else None,
        "id_kinds": summary.id_kinds,
        "id_maps": {role: str(path) for role, path in summary.id_maps.items()},
        "rows": summary.rows,
        "events": summary.events,
        "bad_rows": summary.bad_rows,
        "bad_rows_by_reason": summary.bad,
        "bad_row_examples": {r: [asdict(e) for e in ex] for r, ex in summary.examples.items() if ex},
        "max_bad_share": options.max_bad_share,
        "users": summary.users,
        "items": summary.items,
        "first_date": str(summary.first_date),
        "last_date": str(summary.last_date),
        "days": summary.days,
        "catalog_date": str(summary.catalog_date),
        "seconds": round(summary.seconds, 2),
    }
    tmp = summary.report.with_name(f".{REPORT_NAME}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, summary.report)


# --------------------------------------------------------------------------- parsing values


def _clean(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column's values without surrounding blanks; never null (a null reads as an empty value)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return pc.utf8_trim_whitespace(pc.fill_null(column, ""))


def _missing(values: pa.Array) -> pa.Array:
    return pc.or_kleene(pc.is_null(values), pc.is_in(pc.utf8_lower(values), value_set=pa.array(NULL_MARKERS)))


def _parse_number(values: pa.Array, us_per_unit: int, origin: dt.datetime | None) -> tuple[np.ndarray, np.ndarray]:
    """Numeric timestamps in a unit -> (microseconds since the epoch, parsed)."""
    whole = pc.match_substring_regex(values, _INT_NUMBER)
    decimal = pc.match_substring_regex(values, _DECIMAL_NUMBER)
    ints = pc.cast(pc.if_else(whole, values, "0"), pa.int64()).to_numpy(zero_copy_only=False)
    floats = pc.cast(pc.if_else(decimal, values, "0"), pa.float64()).to_numpy(zero_copy_only=False)
    whole_np, decimal_np = whole.to_numpy(zero_copy_only=False), decimal.to_numpy(zero_copy_only=False)
    base = 0 if origin is None else _origin_us(origin)
    approx = np.where(whole_np, ints.astype(np.float64), floats) * us_per_unit + base
    safe = np.abs(approx) < 2.0 ** 62                       # beyond: out of range anyway, and would overflow
    exact_ints = np.where(safe & whole_np, ints, 0) * us_per_unit + base
    rounded = np.round(np.where(safe & decimal_np, floats, 0.0) * us_per_unit).astype(np.int64) + base
    us = np.where(safe, np.where(whole_np, exact_ints, rounded), -1)
    return us, whole_np | decimal_np


def _origin_us(origin: dt.datetime) -> int:
    if origin.tzinfo is None:
        origin = origin.replace(tzinfo=dt.timezone.utc)
    delta = origin - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _parse_iso(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """ISO 8601 strings -> (microseconds since the epoch, parsed). Each value's own zone offset applies
    (none: UTC); impossible dates and times (February 30, 25:00) do not parse."""
    parts = pc.extract_regex(pc.if_else(pc.is_null(values), "", values), _ISO)
    matched = pc.is_valid(parts).to_numpy(zero_copy_only=False)
    parts = pc.if_else(pc.is_valid(parts), parts, pa.scalar({name: "" for name in
                                                             ("date", "hour", "minute", "second", "frac", "zone")},
                                                            type=parts.type))

    def part(name: str, default: str) -> pa.Array:
        value = pc.struct_field(parts, name)
        return pc.if_else(pc.equal(value, ""), default, value)

    canonical = pc.binary_join_element_wise(
        part("date", "1970-01-01"), "T", part("hour", "00"), ":", part("minute", "00"), ":", part("second", "00"), "")
    stamp = pc.strptime(canonical, format="%Y-%m-%dT%H:%M:%S", unit="s", error_is_null=True)
    # strptime rolls February 30 over into March: a value is valid only if it prints back as itself
    same = pc.equal(pc.strftime(stamp, format="%Y-%m-%dT%H:%M:%S"), canonical)
    valid = matched & pc.fill_null(same, False).to_numpy(zero_copy_only=False)
    seconds = pc.cast(pc.fill_null(stamp, pa.scalar(0, pa.timestamp("s"))), pa.int64()).to_numpy(zero_copy_only=False)
    us = seconds * 1_000_000
    frac = pc.utf8_rpad(pc.struct_field(parts, "frac"), width=9, padding="0")
    ns = pc.cast(pc.utf8_slice_codeunits(frac, 0, 9), pa.int64()).to_numpy(zero_copy_only=False)
    us = us + ns // 1000
    zone = pc.struct_field(parts, "zone")
    offset_values = pc.utf8_slice_codeunits(pc.replace_substring(zone, ":", ""), 1, 5)   # "+05:30" -> "0530"
    digits = pc.utf8_rpad(pc.if_else(pc.match_substring_regex(zone, r"^[+-]"), offset_values, "0000"), 4, "0")
    hours = pc.cast(pc.utf8_slice_codeunits(digits, 0, 2), pa.int64()).to_numpy(zero_copy_only=False)
    minutes = pc.cast(pc.utf8_slice_codeunits(digits, 2, 4), pa.int64()).to_numpy(zero_copy_only=False)
    sign = np.where(pc.starts_with(zone, "-").to_numpy(zero_copy_only=False), -1, 1)
    valid &= (hours <= 23) & (minutes <= 59)
    us = us - sign * (hours * 3600 + minutes * 60) * 1_000_000
    return np.where(valid, us, -1), valid


# --------------------------------------------------------------------------- accumulators


class _Distinct:
    """Distinct int64 values seen, kept as sorted arrays merged now and then: O(distinct) memory."""

    def __init__(self) -> None:
        self.merged = np.zeros(0, dtype=np.int64)
        self.pending: list[np.ndarray] = []
        self.pending_size = 0

    def add(self, values: np.ndarray) -> None:
        values = np.unique(values)
        self.pending.append(values)
        self.pending_size += len(values)
        if self.pending_size > max(1 << 20, 2 * len(self.merged)):
            self._merge()

    def _merge(self) -> None:
        if self.pending:
            self.merged = np.unique(np.concatenate([self.merged, *self.pending]))
            self.pending, self.pending_size = [], 0

    def values(self) -> np.ndarray:
        self._merge()
        return self.merged

    def count(self) -> int:
        return len(self.values())


def string_id(key: str) -> int:
    """The stable id of a string id: the first 15 hex digits of its UTF-8 MD5, as a 60-bit integer.
    Spark SQL: ``CAST(conv(substr(md5(key), 1, 15), 16, 10) AS BIGINT)``."""
    return int.from_bytes(hashlib.md5(key.encode("utf-8")).digest()[:8], "big") >> 4


class _KeyMap:
    """String ids of one role: their numeric ids per batch, and the (id, string) dictionary, deduplicated
    now and then and checked for two strings with one id."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.table = pa.table({f"{role}_id": pa.array([], pa.int64()), role: pa.array([], pa.string())})
        self.pending: list[pa.Table] = []
        self.pending_rows = 0

    def ids_of(self, values: pa.Array, absent: pa.Array) -> np.ndarray:
        """The ids of a batch's strings, each distinct string hashed once; 0 where ``absent``."""
        encoded = pc.dictionary_encode(pc.if_else(absent, pa.scalar(None, pa.string()), values))
        strings = encoded.dictionary.to_pylist()
        lookup = np.fromiter((string_id(k) for k in strings), dtype=np.int64, count=len(strings))
        lookup = np.append(lookup, 0)                              # the last slot: absent values
        indices = pc.fill_null(encoded.indices, len(strings)).to_numpy(zero_copy_only=False)
        return lookup[indices]

    def add(self, ids: np.ndarray, keys: pa.Array) -> None:
        part = pa.table({f"{self.role}_id": pa.array(ids, pa.int64()), self.role: keys})
        part = part.group_by([f"{self.role}_id", self.role], use_threads=False).aggregate([])
        self.pending.append(part)
        self.pending_rows += part.num_rows
        if self.pending_rows > max(1 << 20, 2 * self.table.num_rows):
            self._merge()

    def _merge(self) -> None:
        if not self.pending:
            return
        both = pa.concat_tables([self.table, *self.pending])
        self.table = both.group_by([f"{self.role}_id", self.role], use_threads=False).aggregate([])
        self.pending, self.pending_rows = [], 0

    def _collisions(self) -> tuple[str, str] | None:
        ids = self.table[f"{self.role}_id"].to_numpy()
        unique, counts = np.unique(ids, return_counts=True)
        if (counts == 1).all():
            return None
        twice = unique[counts > 1][0]
        keys = pc.filter(self.table[self.role], pc.equal(self.table[f"{self.role}_id"], twice)).to_pylist()
        return keys[0], keys[1]

    def write(self, path: Path, source: Path) -> Path:
        self._merge()
        clash = self._collisions()
        if clash:
            raise InputDataError(f"{source}: the {self.role} ids {clash[0]!r} and {clash[1]!r} map to the same "
                                 f"number (id {string_id(clash[0])}): rename one of them in the log")
        path.parent.mkdir(parents=True, exist_ok=True)
        table = self.table.sort_by(f"{self.role}_id")
        pq.write_table(table, path, compression="zstd")
        return path

    def lookup(self, ids: np.ndarray) -> pa.Array:
        self._merge()
        known = self.table[f"{self.role}_id"].to_numpy()
        order = np.argsort(known)
        pos = np.searchsorted(known, ids, sorter=order)
        return pc.take(self.table[self.role], pa.array(order[np.minimum(pos, len(known) - 1)]))


class _Metadata:
    """Each item's first non-empty title and category, as (item id, value) tables merged now and then."""

    def __init__(self) -> None:
        self.parts: dict[str, list[tuple[np.ndarray, pa.Array]]] = {"title": [], "category": []}
        self.sizes = {"title": 0, "category": 0}
        self.seen = False

    def add(self, items: np.ndarray, title: pa.Array | None, category: pa.Array | None) -> None:
        self.seen = True
        for name, values in (("title", title), ("category", category)):
            if values is None:
                continue
            present = pc.invert(_missing(values)).to_numpy(zero_copy_only=False)
            ids = items[present]
            first = np.unique(ids, return_index=True)[1]
            self.parts[name].append((ids[first], pc.filter(values, pa.array(present)).take(pa.array(first))))
            self.sizes[name] += len(first)
            if self.sizes[name] > 1 << 20:
                self.parts[name] = [self._first(name)]
                self.sizes[name] = len(self.parts[name][0][0])

    def _first(self, name: str) -> tuple[np.ndarray, pa.Array]:
        ids = np.concatenate([p[0] for p in self.parts[name]])
        values = pa.concat_arrays([p[1] for p in self.parts[name]]) if self.parts[name] else pa.array([], pa.string())
        unique, first = np.unique(ids, return_index=True)        # the earliest part wins: first occurrence
        return unique, values.take(pa.array(first))

    def lookup(self, items: np.ndarray) -> tuple[pa.Array | None, pa.Array | None]:
        if not self.seen:
            return None, None
        found = []
        for name in ("title", "category"):
            if not self.parts[name]:
                found.append(None)
                continue
            ids, values = self._first(name)
            pos = np.minimum(np.searchsorted(ids, items), max(len(ids) - 1, 0))
            hit = (ids[pos] == items) if len(ids) else np.zeros(len(items), dtype=bool)
            found.append(pc.take(values, pa.array(pos, mask=~hit)) if len(ids) else pa.nulls(len(items), pa.string()))
        return found[0], found[1]
