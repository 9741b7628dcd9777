"""MovieLens import: both formats, recognised by content, written to the events and catalog contracts."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA
from recsys.data.movielens import import_movielens
from recsys.errors import InputDataError

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "ml-latest-small"

U_DATA = (
    "196\t242\t3\t881279999\n"     # 1997-12-04 23:59:59 UTC
    "186\t302\t3\t881280000\n"     # 1997-12-05 00:00:00 UTC: the next day's partition
    "22\t377\t1\t881250949\n"      # 1997-12-04 15:55:49 UTC
    "196\t1\t5\t881280001\n"
)
_FLAGS = "|".join
U_ITEM_ROWS = [
    # id|title|release|video release|url|19 flags in README order:
    # unknown, Action, Adventure, Animation, Children's, Comedy, Crime, Documentary, Drama, ...
    "1|Toy Story (1995)|01-Jan-1995||http://us.imdb.com/M/title-exact?Toy%20Story|" + _FLAGS("0001110000000000000"),
    "242|Kolya (1996)|24-Jan-1997||http://us.imdb.com/M/title-exact?Kolya%20(1996)|" + _FLAGS("0000010000000000000"),
    "302|L.A. Confidential (1997)|01-Jan-1997||http://x|" + _FLAGS("0000001000100000100"),
    "377|Heavyweights (1994)|01-Jan-1994||http://x|" + _FLAGS("0000110000000000000"),
    "500|Misérables, Les (1995)|01-Jan-1995||http://x|" + _FLAGS("0000000010000000000"),
    "600|unknown||||" + _FLAGS("0000000000000000000"),
]


def _read(root: Path) -> pd.DataFrame:
    frames = []
    for part in sorted(root.glob("dt=*")):
        frame = pq.read_table(part).to_pandas()
        frame["dt"] = part.name[3:]
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


@pytest.fixture
def ml100k(tmp_path) -> tuple[Path, Path]:
    ratings = tmp_path / "u.data"
    ratings.write_text(U_DATA)
    movies = tmp_path / "u.item"
    movies.write_bytes(("\n".join(U_ITEM_ROWS) + "\n").encode("latin-1"))
    return ratings, movies


# ----------------------------------------------------------------------------- bundled ml-latest-small


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    out = tmp_path_factory.mktemp("ml")
    messages: list[str] = []
    summary = import_movielens(BUNDLED / "ratings.csv", out, movies=BUNDLED / "movies.csv", progress=messages.append)
    return summary, out, messages


def test_bundled_ml_latest_small_keeps_every_rating_user_and_movie(bundled):
    summary, out, _ = bundled
    events = pq.read_table(out / "events")
    assert events.num_rows == 100_837 == summary.ratings
    assert len(set(events["user_id"].to_pylist())) == 611 == summary.users      # 610 + planted user 999
    catalog_parts = sorted(p.name for p in (out / "catalog").iterdir())
    assert catalog_parts == ["dt=1996-03-29"]
    catalog = pq.read_table(out / "catalog" / "dt=1996-03-29")
    assert catalog.num_rows == 9_743 == summary.items                           # 9,742 movies + 999999
    assert all(catalog["available"].to_pylist())
    assert (summary.first_date, summary.last_date, summary.catalog_date) == (
        dt.date(1996, 3, 29), dt.date(2018, 9, 24), dt.date(1996, 3, 29))
    event_parts = sorted(p.name for p in (out / "events").iterdir())
    assert event_parts[0] == "dt=1996-03-29" and event_parts[-1] == "dt=2018-09-24"
    assert len(event_parts) == summary.days


def test_bundled_planted_rating_without_metadata_is_kept_counted_and_warned(bundled):
    summary, out, messages = bundled
    catalog = pq.read_table(out / "catalog").to_pandas().set_index("item_id")
    assert summary.items_without_metadata == 1
    assert catalog.loc[999999, ["title", "category"]].isna().all()
    assert any("warning" in m and "999999" in m for m in messages)
    planted = pq.read_table(out / "events" / "dt=2017-05-03").to_pandas()
    assert ((planted["user_id"] == 999) & (planted["item_id"] == 999999)).sum() == 1


def test_a_rating_lands_in_its_utc_day_at_its_exact_time(bundled):
    _, out, _ = bundled
    day = pq.read_table(out / "events" / "dt=2000-07-30").to_pandas()
    row = day[(day["user_id"] == 1) & (day["item_id"] == 1)]
    assert len(row) == 1
    assert row["ts"].iloc[0] == pd.Timestamp("2000-07-30 18:45:03", tz="UTC")
    assert row["event_type"].iloc[0] == "rating"


def test_quoted_titles_with_commas_and_genres_reach_the_catalog(bundled):
    _, out, _ = bundled
    catalog = pq.read_table(out / "catalog").to_pandas().set_index("item_id")
    assert catalog.loc[11, "title"] == "American President, The (1995)"
    assert catalog.loc[11, "category"] == "Comedy|Drama|Romance"
    assert catalog.loc[1, "category"] == "Adventure|Animation|Children|Comedy|Fantasy"


def test_event_files_follow_the_contract_and_are_sorted_by_time(bundled):
    _, out, _ = bundled
    parts = sorted((out / "events").iterdir())
    for part in parts[:: max(1, len(parts) // 50)]:
        file = next(part.glob("*.parquet"))
        assert pq.read_schema(file).remove_metadata() == EVENTS_SCHEMA
        frame = pq.read_table(file).to_pandas()
        assert frame["ts"].is_monotonic_increasing
        assert (frame["ts"].dt.strftime("%Y-%m-%d") == part.name[3:]).all()
    catalog_file = next((out / "catalog").glob("*/*.parquet"))
    assert pq.read_schema(catalog_file).remove_metadata() == CATALOG_SCHEMA


def test_summary_is_one_line_with_the_counts(bundled):
    summary, _, _ = bundled
    line = str(summary)
    assert "\n" not in line
    assert "100,837 ratings" in line and "9,743 items" in line and "1996-03-29" in line


# ----------------------------------------------------------------------------- ml-100k


def test_ml100k_u_data_splits_events_by_utc_day_and_drops_the_rating_value(ml100k, tmp_path):
    ratings, movies = ml100k
    summary = import_movielens(ratings, tmp_path / "out", movies=movies)
    events = _read(tmp_path / "out" / "events")
    assert sorted(events["dt"].unique()) == ["1997-12-04", "1997-12-05"]
    by_day = events.groupby("dt")["item_id"].apply(sorted).to_dict()
    assert by_day == {"1997-12-04": [242, 377], "1997-12-05": [1, 302]}
    assert list(events.columns) == ["user_id", "item_id", "event_type", "ts", "dt"]
    assert set(events["event_type"]) == {"rating"}
    assert (summary.ratings, summary.users, summary.days) == (4, 3, 2)
    assert (summary.first_date, summary.last_date) == (dt.date(1997, 12, 4), dt.date(1997, 12, 5))


def test_ml100k_u_item_genres_come_from_the_flags_in_readme_order(ml100k, tmp_path):
    ratings, movies = ml100k
    summary = import_movielens(ratings, tmp_path / "out", movies=movies)
    catalog = _read(tmp_path / "out" / "catalog").set_index("item_id")
    assert catalog.loc[1, "category"] == "Animation|Children's|Comedy"
    assert catalog.loc[242, "category"] == "Comedy"
    assert catalog.loc[302, "category"] == "Crime|Film-Noir|Thriller"
    assert pd.isna(catalog.loc[600, "category"])                       # no flag set
    assert catalog.loc[500, "title"] == "Misérables, Les (1995)"        # latin-1 decoded
    assert catalog.loc[1, "title"] == "Toy Story (1995)"
    # unrated movies 500 and 600 are listed too; the snapshot is dated at the first event
    assert sorted(catalog.index) == [1, 242, 302, 377, 500, 600]
    assert set(catalog["dt"]) == {"1997-12-04"}
    assert summary.items_without_metadata == 0 and summary.items == 6


def test_formats_are_recognised_by_content_not_by_file_name(ml100k, tmp_path):
    ratings, movies = ml100k
    odd_ratings = tmp_path / "ratings.csv"                 # u.data content under a csv name
    odd_ratings.write_bytes(ratings.read_bytes())
    odd_movies = tmp_path / "movies.txt"
    odd_movies.write_bytes(movies.read_bytes())
    summary = import_movielens(odd_ratings, tmp_path / "a", movies=odd_movies)
    assert summary.ratings == 4 and summary.items == 6

    csv_as_udata = tmp_path / "u2.data"                     # csv content under a u.data name
    csv_as_udata.write_text("userId,movieId,rating,timestamp\n5,10,4.5,881279999\n")
    movies_csv = tmp_path / "u2.item"
    movies_csv.write_text('movieId,title,genres\n10,"Sabrina, The (1995)",Comedy|Romance\n')
    summary = import_movielens(csv_as_udata, tmp_path / "b", movies=movies_csv)
    catalog = _read(tmp_path / "b" / "catalog")
    assert catalog[["item_id", "title", "category"]].values.tolist() == [[10, "Sabrina, The (1995)", "Comedy|Romance"]]


def test_without_a_movies_file_every_item_is_listed_without_metadata(ml100k, tmp_path):
    ratings, _ = ml100k
    messages: list[str] = []
    summary = import_movielens(ratings, tmp_path / "out", progress=messages.append)
    catalog = _read(tmp_path / "out" / "catalog")
    assert sorted(catalog["item_id"]) == [1, 242, 302, 377]
    assert catalog["title"].isna().all() and catalog["available"].all()
    assert summary.items_without_metadata == 4
    assert any("no movies file" in m for m in messages)


def test_rated_items_missing_from_the_movies_file_are_kept_and_counted(tmp_path):
    ratings = tmp_path / "ratings.csv"
    ratings.write_text("userId,movieId,rating,timestamp\n1,10,4.0,881279999\n1,77,3.0,881279000\n2,78,3.0,881279000\n")
    movies = tmp_path / "movies.csv"
    movies.write_text("movieId,title,genres\n10,Heat (1995),Action|Crime\n")
    messages: list[str] = []
    summary = import_movielens(ratings, tmp_path / "out", movies=movies, progress=messages.append)
    catalog = _read(tmp_path / "out" / "catalog").set_index("item_id")
    assert catalog.loc[[77, 78], "title"].isna().all()
    assert catalog.loc[10, "title"] == "Heat (1995)"
    assert summary.items_without_metadata == 2
    assert any("2 rated items" in m and "77" in m for m in messages)


# ----------------------------------------------------------------------------- bad input

HEADER = "userId,movieId,rating,timestamp\n"


@pytest.mark.parametrize(
    "content, expected",
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        (HEADER, "no ratings"),
        ("1::2::5::978300760\n", "unrecognised ratings format.*accepted: ml-latest.*u.data"),
        ("user,item\n1,2\n", "unrecognised ratings format"),
        (HEADER + "1,2,4.0,881279999\nabc,3,4.0,881279999\n", "userId 'abc' is not a whole number"),
        (HEADER + "1,2.5,4.0,881279999\n", "movieId '2.5' is not a whole number"),
        (HEADER + "1,-3,4.0,881279999\n", "movieId -3 in data row 1 is negative"),
        (HEADER + "1,2,4.0,881279999\nNaN,3,4.0,881279999\n", "userId is missing or NaN in data row 2"),
        (HEADER + "1,,4.0,881279999\n", "movieId is missing or NaN in data row 1"),
        (HEADER + "1,2,4.0,881279999000\n", "timestamp 881279999000 .*milliseconds"),
        (HEADER + "1,2,4.0\n", "cannot read as ml-latest csv"),
        ("7\tx\t3\t881279999\n", "item id 'x' is not a whole number"),
    ],
)
def test_bad_ratings_file_is_rejected_with_a_one_line_reason(tmp_path, content, expected):
    ratings = tmp_path / "ratings.csv"
    ratings.write_text(content)
    with pytest.raises(InputDataError, match=expected) as info:
        import_movielens(ratings, tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()                  # nothing written


def test_missing_ratings_file_is_named(tmp_path):
    with pytest.raises(InputDataError, match=r"ratings file .*nope\.csv does not exist"):
        import_movielens(tmp_path / "nope.csv", tmp_path / "out")
    with pytest.raises(InputDataError, match="not a file"):
        import_movielens(tmp_path, tmp_path / "out")


@pytest.mark.parametrize(
    "content, expected",
    [
        ("", "is empty"),
        ("id;title\n1;x\n", "unrecognised movies format.*accepted: ml-latest.*u.item"),
        ("movieId,title,genres\n10,A,Drama\n10,B,Comedy\n", "movie id 10 is listed 2 times"),
        ("movieId,title,genres\nten,A,Drama\n", "movieId 'ten' is not a whole number"),
        ("movieId,title,genres\n-1,A,Drama\n", "movie id -1 .* negative"),
    ],
)
def test_bad_movies_file_is_rejected_with_a_one_line_reason(tmp_path, content, expected):
    ratings = tmp_path / "ratings.csv"
    ratings.write_text(HEADER + "1,10,4.0,881279999\n")
    movies = tmp_path / "movies.csv"
    movies.write_text(content)
    with pytest.raises(InputDataError, match=expected):
        import_movielens(ratings, tmp_path / "out", movies=movies)
    assert not (tmp_path / "out").exists()


def test_refuses_to_mix_with_existing_partitions_unless_asked_to_overwrite(ml100k, tmp_path):
    ratings, movies = ml100k
    out = tmp_path / "out"
    import_movielens(ratings, out, movies=movies)
    with pytest.raises(InputDataError, match="already holds"):
        import_movielens(ratings, out, movies=movies)
    import_movielens(ratings, out, movies=movies, overwrite=True)
    assert sorted(p.name for p in (out / "events").iterdir()) == ["dt=1997-12-04", "dt=1997-12-05"]
