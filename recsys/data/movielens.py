"""Import MovieLens ratings (and movie metadata) into the events and catalog contracts.

MovieLens is the public yardstick the project measures itself on (docs/quality.md), so the
importer keeps every rating and changes only the shape:

- every rating becomes one ``event_type = "rating"`` event at its Unix timestamp (UTC); the
  rating value is dropped, since the models learn from implicit feedback (what was rated, when);
- events are written one partition per UTC day, sorted by time, user and item: the file is
  read once, sorted once and sliced, so ml-latest-small's ~4,100 days cost one write each;
- the catalog is ONE snapshot, dated at the first event's date, listing every item as available:
  the union of the movies file's items and the rated items. MovieLens has no catalog history, and
  the job reads the newest snapshot on or before its run date, so this date makes the snapshot
  visible to a run (or backfill) for any date that has events. The price is that a run for an
  early date sees movies released later as candidates; for the evaluation protocol (leave the
  last event out, rank the whole catalog) that is the usual choice.

Formats are recognised by content, not by file name: ml-latest / ml-latest-small ``ratings.csv``
and ``movies.csv``, and ml-100k ``u.data`` and ``u.item``. The whole ratings file is read into
memory (about 30 bytes a rating: fine for ml-latest-small and ml-25m, not for unbounded logs).
"""
from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recsys.data._output import prepare_dataset_dirs
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition
from recsys.errors import InputDataError, first_line

EVENT_TYPE = "rating"
RATINGS_FORMATS = (
    "accepted: ml-latest(-small) ratings.csv (comma-separated, header userId,movieId,rating,timestamp) "
    "or ml-100k u.data (tab-separated user, item, rating, timestamp, no header)"
)
MOVIES_FORMATS = (
    "accepted: ml-latest(-small) movies.csv (comma-separated, header movieId,title,genres) "
    "or ml-100k u.item (pipe-separated, latin-1: id|title|release date|video release date|IMDb URL|19 genre flags)"
)
# The genre flags of u.item, in the order of the ml-100k README.
ML100K_GENRES: tuple[str, ...] = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
    "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
    "War", "Western",
)
_U_ITEM_FIELDS = 5 + len(ML100K_GENRES)
_MAX_UNIX_SECONDS = 253_402_300_799            # 9999-12-31T23:59:59Z
_SNIFF_BYTES = 64 * 1024


@dataclass(frozen=True)
class ImportSummary:
    """What was imported. ``items`` is the catalog size (movies-file items plus rated ones);
    ``items_without_metadata`` counts catalog items with a null title (all of them without a movies file)."""

    ratings: int
    users: int
    items: int
    items_without_metadata: int
    first_date: dt.date
    last_date: dt.date
    days: int
    events_dir: Path
    catalog_dir: Path
    catalog_date: dt.date

    def __str__(self) -> str:
        return (
            f"movielens: {self.ratings:,} ratings by {self.users:,} users on {self.days:,} days "
            f"{self.first_date}..{self.last_date} -> {self.events_dir}; catalog of {self.items:,} items "
            f"({self.items_without_metadata:,} without title) dated {self.catalog_date} -> {self.catalog_dir}"
        )


def import_movielens(
    ratings: Path,
    out: Path,
    *,
    movies: Path | None = None,
    progress: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> ImportSummary:
    """Write ``out/events/dt=.../`` (one partition per UTC day) and one ``out/catalog/dt=.../`` snapshot.

    Raises :class:`InputDataError` (nothing written) for a missing, empty or unrecognised file or
    bad ids. ``out`` must not hold date partitions already unless ``overwrite`` (see ``_output``).
    """
    say = progress or (lambda _message: None)
    ratings = Path(ratings)
    users, item_ids, seconds, fmt = read_ratings(ratings)
    say(f"read {len(users):,} ratings ({fmt}) from {ratings}")
    metadata = None
    if movies is not None:
        metadata = read_movies(Path(movies))
        say(f"read {len(metadata):,} movies from {movies}")
    events_dir, catalog_dir = prepare_dataset_dirs(Path(out), overwrite=overwrite)

    order = np.lexsort((item_ids, users, seconds))         # by time, then user, then item
    users, item_ids, seconds = users[order], item_ids[order], seconds[order]
    day = np.floor_divide(seconds, 86_400)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(day)) + 1])
    ends = np.append(starts[1:], len(day))
    table = pa.table(
        {
            "user_id": pa.array(users, type=pa.int64()),
            "item_id": pa.array(item_ids, type=pa.int64()),
            "event_type": pc.take(pa.array([EVENT_TYPE]), pa.array(np.zeros(len(users), dtype=np.int32))),
            "ts": pa.array(seconds * 1_000_000, type=pa.timestamp("us", tz="UTC")),
        },
        schema=EVENTS_SCHEMA,
    )
    epoch = dt.date(1970, 1, 1)
    dates = [epoch + dt.timedelta(days=int(d)) for d in day[starts]]
    say(f"writing {len(dates):,} daily event partitions {dates[0]}..{dates[-1]}")
    for date, start, end in zip(dates, starts, ends):
        write_partition(table.slice(int(start), int(end - start)), events_dir, date)

    catalog, missing = _catalog(np.unique(item_ids), metadata)
    write_partition(catalog, catalog_dir, dates[0])
    if metadata is not None and missing:
        say(f"warning: {missing:,} rated item{'s are' if missing > 1 else ' is'} not in {movies} (e.g. item "
            f"{_first_missing(catalog)}): their title and category are null")
    elif metadata is None:
        say("warning: no movies file given: every catalog title and category is null")
    return ImportSummary(
        ratings=len(users), users=int(len(np.unique(users))), items=catalog.num_rows,
        items_without_metadata=catalog.num_rows if metadata is None else missing,
        first_date=dates[0], last_date=dates[-1], days=len(dates),
        events_dir=events_dir, catalog_dir=catalog_dir, catalog_date=dates[0],
    )


# --------------------------------------------------------------------------- ratings


def read_ratings(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """``(user ids, item ids, Unix seconds, format name)`` as int64 arrays, validated."""
    first = _first_line(path, "ratings")
    header = first.lower().replace(" ", "")
    names = ["user", "item", "rating", "timestamp"]
    if header == "userid,movieid,rating,timestamp":
        fmt, delimiter, skip, shown = "ml-latest csv", ",", 1, ["userId", "movieId", "rating", "timestamp"]
    elif len(first.split("\t")) == 4:
        fmt, delimiter, skip, shown = "ml-100k u.data", "\t", 0, ["user id", "item id", "rating", "timestamp"]
    else:
        raise InputDataError(f"{path}: unrecognised ratings format (first line {first[:80]!r}); {RATINGS_FORMATS}")
    label = dict(zip(names, shown))
    table = _read_csv(
        path, fmt,
        pacsv.ReadOptions(column_names=names, skip_rows=skip),
        pacsv.ParseOptions(delimiter=delimiter),
        pacsv.ConvertOptions(column_types={n: pa.int64() for n in ("user", "item", "timestamp")},
                             include_columns=["user", "item", "timestamp"]),
        label,
    )
    if table.num_rows == 0:
        raise InputDataError(f"{path}: no ratings after the header: pass a ratings file with at least one row")
    columns = {}
    for name in ("user", "item", "timestamp"):
        column = table[name]
        if column.null_count:
            row = _first_index(pc.is_null(column))
            raise InputDataError(f"{path}: {label[name]} is missing or NaN in data row {row + 1}: "
                                 "every rating needs whole-number ids and a timestamp; fix or remove that row")
        columns[name] = column.to_numpy()
    for name in ("user", "item"):
        bad = np.flatnonzero(columns[name] < 0)
        if len(bad):
            raise InputDataError(f"{path}: {label[name]} {columns[name][bad[0]]} in data row {bad[0] + 1} is negative: "
                                 "ids must be >= 0; fix or remove that row")
    ts = columns["timestamp"]
    bad = np.flatnonzero((ts < 0) | (ts > _MAX_UNIX_SECONDS))
    if len(bad):
        raise InputDataError(f"{path}: timestamp {ts[bad[0]]} in data row {bad[0] + 1} is not Unix seconds "
                             "between 1970 and 9999 (milliseconds?): convert the timestamps to seconds")
    return columns["user"], columns["item"], ts, fmt


# --------------------------------------------------------------------------- movies


def read_movies(path: Path) -> pa.Table:
    """``item_id`` int64, ``title``, ``category`` (genres joined by ``|``), one row per movie."""
    first = _first_line(path, "movies")
    if first.lower().replace(" ", "") == "movieid,title,genres":
        table = _read_csv(
            path, "movies.csv",
            pacsv.ReadOptions(column_names=["item_id", "title", "category"], skip_rows=1),
            pacsv.ParseOptions(delimiter=","),
            pacsv.ConvertOptions(column_types={"item_id": pa.int64(), "title": pa.string(), "category": pa.string()}),
            {"item_id": "movieId"},
        )
    elif (fields := first.split("|")) and len(fields) == _U_ITEM_FIELDS and fields[0].strip().isdigit():
        table = _read_u_item(path)
    else:
        raise InputDataError(f"{path}: unrecognised movies format (first line {first[:80]!r}); {MOVIES_FORMATS}")
    if table.num_rows == 0:
        raise InputDataError(f"{path}: no movies after the header: pass a movies file with at least one row, or none")
    ids = table["item_id"]
    if ids.null_count:
        row = _first_index(pc.is_null(ids))
        raise InputDataError(f"{path}: movie id is missing or NaN in data row {row + 1}: fix or remove that row")
    ids_np = ids.to_numpy()
    if (ids_np < 0).any():
        row = int(np.flatnonzero(ids_np < 0)[0])
        raise InputDataError(f"{path}: movie id {ids_np[row]} in data row {row + 1} is negative: ids must be >= 0")
    unique, counts = np.unique(ids_np, return_counts=True)
    if (counts > 1).any():
        raise InputDataError(f"{path}: movie id {unique[counts > 1][0]} is listed {counts[counts > 1][0]} times: "
                             "keep one row per movie")
    return table.select(["item_id", "title", "category"])


def _read_u_item(path: Path) -> pa.Table:
    flags = [f"g{i}" for i in range(len(ML100K_GENRES))]
    names = ["item_id", "title", "release", "video_release", "url", *flags]
    table = _read_csv(
        path, "ml-100k u.item",
        pacsv.ReadOptions(column_names=names, encoding="latin-1"),
        pacsv.ParseOptions(delimiter="|", quote_char=False),
        pacsv.ConvertOptions(column_types={"item_id": pa.int64(), "title": pa.string(),
                                           **{f: pa.int8() for f in flags}},
                             include_columns=["item_id", "title", *flags]),
        {"item_id": "movie id", **{f: f"genre flag {g!r}" for f, g in zip(flags, ML100K_GENRES)}},
    )
    matrix = np.zeros((table.num_rows, len(flags)), dtype=bool)
    for j, flag in enumerate(flags):
        matrix[:, j] = table[flag].fill_null(0).to_numpy() > 0
    # Few distinct flag combinations exist: build each one's string once, then gather.
    codes = matrix.astype(np.int64) @ (1 << np.arange(len(flags), dtype=np.int64))
    unique, inverse = np.unique(codes, return_inverse=True)
    names_of = ["|".join(g for bit, g in enumerate(ML100K_GENRES) if code >> bit & 1) or None for code in unique]
    category = pc.take(pa.array(names_of, type=pa.string()), pa.array(inverse.reshape(-1)))
    return pa.table({"item_id": table["item_id"], "title": table["title"], "category": category})


# --------------------------------------------------------------------------- catalog


def _catalog(rated: np.ndarray, metadata: pa.Table | None) -> tuple[pa.Table, int]:
    """Every movie and every rated item, available; ``(table, rated items without metadata)``."""
    if metadata is None:
        ids = rated
        title = category = pa.nulls(len(ids), type=pa.string())
        missing = len(ids)
    else:
        movie_ids = metadata["item_id"].to_numpy()
        ids = np.union1d(movie_ids, rated)
        by_id = np.argsort(movie_ids)
        pos = np.minimum(np.searchsorted(movie_ids, ids, sorter=by_id), len(movie_ids) - 1)
        found = movie_ids[by_id[pos]] == ids
        take = pa.array(by_id[pos], mask=~found)              # null index -> null title / category
        title, category = pc.take(metadata["title"], take), pc.take(metadata["category"], take)
        missing = int((~found).sum())
    table = pa.table(
        {"item_id": pa.array(ids, type=pa.int64()), "available": pa.array(np.ones(len(ids), dtype=bool)),
         "title": title, "category": category},
        schema=CATALOG_SCHEMA,
    )
    return table, missing


def _first_missing(catalog: pa.Table) -> int:
    return catalog["item_id"][_first_index(pc.is_null(catalog["title"]))].as_py()


# --------------------------------------------------------------------------- reading helpers


def _first_line(path: Path, what: str) -> str:
    """The first non-blank line, for recognising the format; errors for a missing or empty file."""
    if not path.exists():
        raise InputDataError(f"{what} file {path} does not exist: check the path")
    if not path.is_file():
        raise InputDataError(f"{what} file {path} is not a file: pass the {what} file itself, not its directory")
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES)
    text = head.decode("latin-1").lstrip("\ufeff\xef\xbb\xbf")    # a UTF-8 BOM read as latin-1, too
    for line in text.splitlines():
        if line.strip():
            return line.strip("\r\n ")
    raise InputDataError(f"{what} file {path} is empty: pass the {what} file of a MovieLens download")


def _read_csv(path: Path, fmt: str, read: pacsv.ReadOptions, parse: pacsv.ParseOptions,
              convert: pacsv.ConvertOptions, label: dict[str, str]) -> pa.Table:
    """Parse with Arrow's CSV reader, turning its errors into one-line ones that name the bad value."""
    try:
        return pacsv.read_csv(path, read_options=read, parse_options=parse, convert_options=convert)
    except (pa.ArrowInvalid, UnicodeDecodeError) as err:
        message = first_line(err, limit=10_000)
        match = re.search(r"column #(\d+): CSV conversion error to \w+: invalid value '(.*)'", message)
        if match:
            name = read.column_names[int(match.group(1))] if read.column_names else match.group(1)
            raise InputDataError(f"{path}: {label.get(name, name)} {match.group(2)!r} is not a whole number: "
                                 f"ids and timestamps must be integers ({fmt}); fix or remove that row") from None
        raise InputDataError(f"{path}: cannot read as {fmt}: {message}") from None


def _first_index(mask: pa.ChunkedArray | pa.Array) -> int:
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])
