"""import-interactions: any CSV log into the events and catalog contracts, bad rows counted by reason. No Spark."""
from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import json
import logging
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from recsys.cli.main import main
from recsys.data import interactions
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA
from recsys.data.interactions import (
    BLANK_LINE, MISSING_VALUE, REPORT_NAME, TIMESTAMP_OUT_OF_RANGE, UNPARSEABLE_ID, UNPARSEABLE_TIMESTAMP,
    WRONG_FIELD_COUNT, ColumnMapping, ImportOptions, import_interactions, string_id,
)
from recsys.data.movielens import import_movielens
from recsys.errors import ExitCode, InputDataError

BUNDLED_RATINGS = Path(__file__).resolve().parents[1] / "data" / "ml-latest-small" / "ratings.csv"
UTC = dt.timezone.utc


def _read(root: Path) -> pd.DataFrame:
    frames = []
    for part in sorted(root.glob("dt=*")):
        frame = pq.read_table(part).to_pandas()
        frame["dt"] = part.name[3:]
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def _write(tmp_path: Path, text: str, name: str = "log.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _ts(*args) -> pd.Timestamp:
    return pd.Timestamp(dt.datetime(*args, tzinfo=UTC))


# ----------------------------------------------------------------------------- timestamps


@pytest.mark.parametrize("fmt, values", [
    ("s", ["1704067200", "1704153600.5"]),
    ("ms", ["1704067200000", "1704153600500"]),
    ("us", ["1704067200000000", "1704153600500000"]),
    ("iso", ["2024-01-01T00:00:00Z", "2024-01-02 00:00:00.5"]),
])
def test_each_timestamp_format_is_recognised_and_read_to_the_same_instants(tmp_path, fmt, values):
    csv = _write(tmp_path, "user_id,item_id,timestamp\n" + "".join(f"1,{i},{v}\n" for i, v in enumerate(values)))
    messages: list[str] = []
    summary = import_interactions(csv, tmp_path / "out", progress=messages.append)
    assert summary.time_format == fmt
    assert any(m.startswith("timestamps: ") and "(auto" in m for m in messages)   # the decision is said
    events = _read(tmp_path / "out" / "events")
    assert list(events["ts"]) == [_ts(2024, 1, 1), _ts(2024, 1, 2, 0, 0, 0, 500_000)]
    assert list(events["dt"]) == ["2024-01-01", "2024-01-02"]


def test_iso_timestamps_keep_each_rows_own_offset_and_read_naive_ones_as_utc(tmp_path):
    csv = _write(tmp_path, "user,item,time\n"
                           "1,1,2024-03-01T23:30:00+02:00\n"          # 21:30 UTC
                           "1,2,2024-03-01T10:00\n"                   # naive: UTC, whatever came before
                           "1,3,2024-03-01T22:00:00.25-0130\n"        # 23:30:00.25 UTC
                           "1,4,2024-03-02\n"                         # a date: midnight UTC
                           "1,5,20240302\n")                          # not ISO 8601 in the extended form
    summary = import_interactions(csv, tmp_path / "out", options=ImportOptions(max_bad_share=0.5))
    events = _read(tmp_path / "out" / "events").sort_values("item_id")
    assert list(events["ts"]) == [_ts(2024, 3, 1, 21, 30), _ts(2024, 3, 1, 10), _ts(2024, 3, 1, 23, 30, 0, 250_000),
                                  _ts(2024, 3, 2)]
    assert summary.bad[UNPARSEABLE_TIMESTAMP] == 1 and summary.examples[UNPARSEABLE_TIMESTAMP][0].line == 6


def test_impossible_dates_are_bad_rows_not_rolled_over(tmp_path):
    csv = _write(tmp_path, "user,item,time\n1,1,2024-02-30T00:00:00Z\n1,2,2024-02-29T24:00:00Z\n1,3,2024-02-29\n")
    summary = import_interactions(csv, tmp_path / "out", options=ImportOptions(max_bad_share=1.0))
    assert summary.bad[UNPARSEABLE_TIMESTAMP] == 2 and summary.events == 1


def test_seconds_since_the_logs_own_start_count_from_the_time_origin(tmp_path):
    """The Wikipedia edit log's layout: user_id, page_id, seconds since its first edit."""
    csv = _write(tmp_path, "user_id,page_id,seconds\n1,8228,0\n2,8229,36\n2,8229,86400\n")
    summary = import_interactions(csv, tmp_path / "out", columns=ColumnMapping(event_type="edit"),
                                  options=ImportOptions(time_origin=dt.datetime(2024, 1, 1, tzinfo=UTC)))
    assert summary.columns["item"] == "page_id" and summary.time_format == "s"
    events = _read(tmp_path / "out" / "events")
    assert list(events["ts"]) == [_ts(2024, 1, 1), _ts(2024, 1, 1, 0, 0, 36), _ts(2024, 1, 2)]
    assert set(events["event_type"]) == {"edit"} and list(events["item_id"]) == [8228, 8229, 8229]


def test_without_a_time_origin_a_log_starting_in_1970_is_warned_about(tmp_path):
    csv = _write(tmp_path, "user_id,page_id,seconds\n1,8228,0\n2,8229,36\n")
    messages: list[str] = []
    import_interactions(csv, tmp_path / "out", progress=messages.append)
    assert any("start on 1970-01-01" in m and "--time-origin" in m for m in messages)


def test_an_explicit_time_format_overrides_the_guess(tmp_path):
    csv = _write(tmp_path, "user,item,ts\n1,1,1000\n")                         # auto would say seconds
    import_interactions(csv, tmp_path / "out", options=ImportOptions(time_format="ms",
                                                                     time_origin=dt.datetime(2024, 1, 1)))
    assert list(_read(tmp_path / "out" / "events")["ts"]) == [_ts(2024, 1, 1, 0, 0, 1)]


# ----------------------------------------------------------------------------- ids


def test_string_ids_become_stable_md5_ids_with_a_dictionary_beside_the_data(tmp_path):
    csv = _write(tmp_path, "visitor,sku,ts\nalice,SKU-1,1704067200\nbob,SKU-2,1704067300\nalice,SKU-2,1704067400\n")
    summary = import_interactions(csv, tmp_path / "a")
    assert summary.id_kinds == {"user": "string", "item": "string"}
    events = _read(tmp_path / "a" / "events")
    # the documented formula, the same in SQL: CAST(conv(substr(md5(key), 1, 15), 16, 10) AS BIGINT)
    assert string_id("alice") == int(hashlib.md5(b"alice").hexdigest()[:15], 16)
    assert list(events["user_id"]) == [string_id("alice"), string_id("bob"), string_id("alice")]
    assert list(events["item_id"]) == [string_id("SKU-1"), string_id("SKU-2"), string_id("SKU-2")]
    users = pq.read_table(tmp_path / "a" / "ids" / "user_ids.parquet").to_pandas()
    items = pq.read_table(tmp_path / "a" / "ids" / "item_ids.parquet").to_pandas()
    assert dict(zip(users["user_id"], users["user"])) == {string_id("alice"): "alice", string_id("bob"): "bob"}
    assert dict(zip(items["item_id"], items["item"])) == {string_id("SKU-1"): "SKU-1", string_id("SKU-2"): "SKU-2"}
    catalog = _read(tmp_path / "a" / "catalog").set_index("item_id")
    assert catalog.loc[string_id("SKU-2"), "title"] == "SKU-2"           # the key is the title when none is mapped
    # another file of the same shop, imported on its own, agrees on every id
    other = _write(tmp_path, "visitor,sku,ts\nbob,SKU-1,1704153600\n", "other.csv")
    import_interactions(other, tmp_path / "b")
    again = _read(tmp_path / "b" / "events")
    assert (again["user_id"][0], again["item_id"][0]) == (string_id("bob"), string_id("SKU-1"))


def test_whole_number_ids_are_kept_including_ones_written_as_floats(tmp_path):
    csv = _write(tmp_path, "user_id,item_id,ts\n7,12.0,1704067200\n9223372036854775807,3,1704067200\n")
    summary = import_interactions(csv, tmp_path / "out")
    assert summary.id_kinds == {"user": "int", "item": "int"} and summary.id_maps == {}
    events = _read(tmp_path / "out" / "events")
    assert list(events["user_id"]) == [7, 9223372036854775807] and list(events["item_id"]) == [12, 3]
    assert not (tmp_path / "out" / "ids").exists()


def test_two_strings_with_one_id_stop_the_import_naming_both(tmp_path, monkeypatch):
    monkeypatch.setattr(interactions, "string_id", lambda key: 42)           # a collision, made to happen
    csv = _write(tmp_path, "user,item,ts\nalice,1,1704067200\nbob,2,1704067200\n")
    with pytest.raises(InputDataError, match="'alice' and 'bob' map to the same number"):
        import_interactions(csv, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*/dt=*"))


# ----------------------------------------------------------------------------- event types and catalog


def test_an_event_type_column_is_recognised_and_a_fixed_type_or_the_default_is_used_otherwise(tmp_path):
    with_column = _write(tmp_path, "timestamp,visitorid,event,itemid\n1433221332117,257597,view,355908\n"
                                   "1433224214164,992329,addtocart,248676\n", "retail.csv")
    summary = import_interactions(with_column, tmp_path / "a")
    assert summary.columns == {"user": "visitorid", "item": "itemid", "time": "timestamp", "event_type": "event",
                               "title": None, "category": None}
    assert summary.time_format == "ms"
    assert list(_read(tmp_path / "a" / "events")["event_type"]) == ["view", "addtocart"]
    plain = _write(tmp_path, "user,item,ts\n1,2,1704067200\n", "plain.csv")
    import_interactions(plain, tmp_path / "b")
    import_interactions(plain, tmp_path / "c", columns=ColumnMapping(event_type="purchase"))
    assert list(_read(tmp_path / "b" / "events")["event_type"]) == ["interaction"]
    assert list(_read(tmp_path / "c" / "events")["event_type"]) == ["purchase"]


def test_writes_the_contracts_one_partition_per_utc_day_and_one_catalog_snapshot_with_mapped_metadata(tmp_path):
    csv = _write(tmp_path, "user,item,ts,name,dept\n"
                           "1,10,2024-01-01T23:59:59Z,Mug,kitchen\n"
                           "2,11,2024-01-02T00:00:00Z,,garden\n"
                           "1,11,2024-01-03T08:00:00Z,Rake,\n"
                           "2,10,2024-01-03T09:00:00Z,Other Mug,home\n")
    summary = import_interactions(csv, tmp_path / "out", columns=ColumnMapping(title="name", category="dept"))
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "events").iterdir()) == ["dt=2024-01-01", "dt=2024-01-02", "dt=2024-01-03"]
    assert [p.name for p in (out / "catalog").iterdir()] == ["dt=2024-01-01"]
    for part in (out / "events").iterdir():
        assert pq.read_schema(next(part.glob("*.parquet"))).remove_metadata() == EVENTS_SCHEMA
    snapshot = next((out / "catalog" / "dt=2024-01-01").glob("*.parquet"))
    assert pq.read_schema(snapshot).remove_metadata() == CATALOG_SCHEMA
    catalog = _read(out / "catalog").set_index("item_id")
    # the first non-empty title and category of each item
    assert catalog.loc[10, ["available", "title", "category"]].tolist() == [True, "Mug", "kitchen"]
    assert catalog.loc[11, ["available", "title", "category"]].tolist() == [True, "Rake", "garden"]
    assert (summary.users, summary.items, summary.days, summary.events) == (2, 2, 3, 4)
    assert summary.catalog_date == dt.date(2024, 1, 1)
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["events"] == 4 and report["bad_rows"] == 0 and report["columns"]["title"] == "name"
    assert not list(out.glob(".import-*"))                                    # the staging directory is gone


def test_reads_compressed_files_and_headerless_tab_separated_ones_by_position(tmp_path):
    gz = tmp_path / "log.csv.gz"
    with gzip.open(gz, "wt") as f:
        f.write("user_id,item_id,timestamp\n1,2,1704067200\n")
    assert import_interactions(gz, tmp_path / "a").events == 1
    udata = _write(tmp_path, "196\t242\t3\t881250949\n186\t302\t3\t891717742\n", "u.data")
    summary = import_interactions(udata, tmp_path / "b", columns=ColumnMapping(user="1", item="2", time="4"),
                                  options=ImportOptions(header=False))
    events = _read(tmp_path / "b" / "events")
    assert summary.events == 2 and list(events["item_id"]) == [242, 302]


def test_matches_import_movielens_on_a_movielens_ratings_file(tmp_path):
    ratings = tmp_path / "ratings.csv"
    ratings.write_text("".join(BUNDLED_RATINGS.read_text().splitlines(keepends=True)[:3001]))
    import_interactions(ratings, tmp_path / "a", columns=ColumnMapping(event_type="rating"))
    import_movielens(ratings, tmp_path / "b")
    keys = {"events": ["ts", "user_id", "item_id"], "catalog": ["item_id"]}
    for kind, key in keys.items():
        mine = _read(tmp_path / "a" / kind).sort_values(key).reset_index(drop=True)
        theirs = _read(tmp_path / "b" / kind).sort_values(key).reset_index(drop=True)
        pd.testing.assert_frame_equal(mine, theirs)


# ----------------------------------------------------------------------------- bad rows


BAD_LOG = (
    "user_id,item_id,timestamp\n"      # line 1
    "1,10,1704067200\n"                # 2 good
    "2,x10,1704067200\n"               # 3 unparseable id
    "3,11,yesterday\n"                 # 4 unparseable timestamp
    "4,12\n"                           # 5 wrong number of fields
    "\n"                               # 6 blank line
    ",13,1704067200\n"                 # 7 missing value
    "5,14,99999999999999999\n"         # 8 out of range: 10^17 seconds is long after the year 9999
    "6,15,NULL\n"                      # 9 missing value (a null marker)
    "7,16,1704067300\n"                # 10 good
)


def test_every_kind_of_bad_row_is_counted_with_its_line_and_reported(tmp_path):
    messages: list[str] = []
    summary = import_interactions(_write(tmp_path, BAD_LOG), tmp_path / "out", progress=messages.append,
                                  options=ImportOptions(time_format="s", item_ids="int", max_bad_share=0.9))
    assert summary.rows == 9 and summary.events == 2
    assert summary.bad == {BLANK_LINE: 1, MISSING_VALUE: 2, UNPARSEABLE_ID: 1, UNPARSEABLE_TIMESTAMP: 1,
                           TIMESTAMP_OUT_OF_RANGE: 1, WRONG_FIELD_COUNT: 1}
    lines = {reason: [e.line for e in examples] for reason, examples in summary.examples.items() if examples}
    assert lines == {UNPARSEABLE_ID: [3], UNPARSEABLE_TIMESTAMP: [4], WRONG_FIELD_COUNT: [5], BLANK_LINE: [6],
                     MISSING_VALUE: [7, 9], TIMESTAMP_OUT_OF_RANGE: [8]}
    assert str(summary.examples[UNPARSEABLE_ID][0]) == "line 3, item_id 'x10'"
    assert "1 unparseable id" in str(summary) and "\n" not in str(summary)
    assert any(m.startswith("warning: 7 of 9 rows") and "line 3, item_id 'x10'" in m for m in messages)
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert report["bad_rows_by_reason"] == summary.bad
    assert report["bad_row_examples"][UNPARSEABLE_TIMESTAMP] == [
        {"line": 4, "column": "timestamp", "value": "yesterday"}]


def test_line_numbers_stay_right_across_blocks_and_flushes(tmp_path):
    """Many small blocks, malformed lines in some of them, rows written out every 50: the same events as one
    pass, and each bad row's line is its line in the file."""
    lines = ["user_id,item_id,timestamp"]
    for k in range(1, 2001):
        lines.append(f"{k % 37},{k % 101},{1704067200 + k * 600}" if k % 333 else f"{k},{k}")
    lines[1500] = "1,oops,1704067200"
    csv = _write(tmp_path, "\n".join(lines) + "\n")
    small = import_interactions(csv, tmp_path / "small", options=ImportOptions(block_size=2048, flush_rows=50))
    big = import_interactions(csv, tmp_path / "big")
    assert [e.line for e in small.examples[WRONG_FIELD_COUNT]] == [334, 667, 1000, 1333, 1666]
    assert [e.line for e in small.examples[UNPARSEABLE_ID]] == [1501]
    assert small.bad == big.bad and small.events == big.events == 2000 - 6 - 1
    cols = ["dt", "ts", "user_id", "item_id"]
    pd.testing.assert_frame_equal(_read(tmp_path / "small" / "events").sort_values(cols).reset_index(drop=True),
                                  _read(tmp_path / "big" / "events").sort_values(cols).reset_index(drop=True))
    assert len(list((tmp_path / "small" / "events" / "dt=2024-01-01").glob("*.parquet"))) > 1


def test_above_the_bad_row_limit_the_command_exits_2_with_one_line_and_writes_nothing(tmp_path, caplog):
    csv = _write(tmp_path, BAD_LOG)
    out = tmp_path / "out"
    code = main(["import-interactions", "--csv", str(csv), "--out", str(out), "--time-format", "s",
                 "--item-ids", "int"])
    assert code == ExitCode.BAD_INPUT
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0]
    assert "7 of 9 rows (77.78%) are bad, more than the limit of 1.00% (--max-bad-share)" in errors[0]
    assert "1 unparseable id (first: line 3, item_id 'x10')" in errors[0]
    assert not (out / "events").exists() and not list(out.glob(".import-*")) and not (out / REPORT_NAME).exists()


def test_a_mapping_that_fits_no_row_fails_on_the_timestamps_naming_the_column(tmp_path):
    csv = _write(tmp_path, "user,item,time\n1,2,soon\n3,4,later\n")
    with pytest.raises(InputDataError, match="timestamps of column 'time' are neither numbers nor ISO 8601"):
        import_interactions(csv, tmp_path / "out")


# ----------------------------------------------------------------------------- columns, files, output


@pytest.mark.parametrize("header, columns, message", [
    ("user_id,user,item,ts", ColumnMapping(), "columns user_id, user could each be the user"),
    ("person,item,ts", ColumnMapping(), "no user column recognised among person, item, ts"),
    ("user,item,ts", ColumnMapping(item="product"), "no column 'product' for the item"),
    ("user,item,ts", ColumnMapping(user="item", item="item"), "column 'item' is mapped to two roles"),
    ("user,item,ts", ColumnMapping(event_type="view", event_type_column="user"), "not both"),
])
def test_a_mapping_that_does_not_fit_the_header_is_refused_naming_it(tmp_path, header, columns, message):
    csv = _write(tmp_path, f"{header}\n" + ",".join(["1"] * len(header.split(","))) + "\n")
    with pytest.raises(InputDataError, match=message):
        import_interactions(csv, tmp_path / "out", columns=columns)


def test_refuses_to_write_over_a_dataset_unless_asked_and_an_overwrite_drops_a_stale_id_map(tmp_path):
    strings = _write(tmp_path, "user,item,ts\nalice,a,1704067200\n", "strings.csv")
    numbers = _write(tmp_path, "user,item,ts\n1,2,1704153600\n", "numbers.csv")
    out = tmp_path / "out"
    import_interactions(strings, out)
    assert (out / "ids" / "user_ids.parquet").exists()
    with pytest.raises(InputDataError, match="already holds 2 date partitions"):
        import_interactions(numbers, out)
    assert [p.name for p in (out / "events").iterdir()] == ["dt=2024-01-01"]   # untouched
    import_interactions(numbers, out, overwrite=True)
    assert [p.name for p in (out / "events").iterdir()] == ["dt=2024-01-02"]
    assert not (out / "ids" / "user_ids.parquet").exists()


def test_the_refusal_comes_before_reading_the_file(tmp_path):
    out = tmp_path / "out"
    (out / "events" / "dt=2024-01-01").mkdir(parents=True)
    with pytest.raises(InputDataError, match="already holds"):
        import_interactions(tmp_path / "not-there.csv", out)


def test_a_file_that_is_not_utf8_names_the_encoding_option(tmp_path):
    csv = tmp_path / "latin.csv"
    csv.write_bytes("user,item,ts,title\n1,2,1704067200,Caf\xe9\n".encode("latin-1"))
    with pytest.raises(InputDataError, match="not UTF-8.*--encoding latin-1"):
        import_interactions(csv, tmp_path / "a", columns=ColumnMapping(title="title"))
    import_interactions(csv, tmp_path / "b", columns=ColumnMapping(title="title"),
                        options=ImportOptions(encoding="latin-1"))
    assert _read(tmp_path / "b" / "catalog")["title"].tolist() == ["Café"]


@pytest.mark.parametrize("path_text, message", [("missing.csv", "does not exist"), ("", "is empty")])
def test_a_missing_or_empty_file_is_named(tmp_path, path_text, message):
    path = tmp_path / (path_text or "empty.csv")
    if not path_text:
        path.write_text("")
    with pytest.raises(InputDataError, match=message):
        import_interactions(path, tmp_path / "out")


def test_progress_says_what_was_recognised_and_when_all_is_read(tmp_path):
    csv = _write(tmp_path, "user_id,item_id,timestamp\n1,2,1704067200\n")
    messages: list[str] = []
    import_interactions(csv, tmp_path / "out", progress=messages.append)
    assert messages[0].startswith(f"reading {csv}")
    assert "user <- user_id, item <- item_id, time <- timestamp" in messages[0]
    assert any(m.endswith("all read") and "read 1 rows" in m for m in messages)


def test_formats_are_decided_on_the_first_rows_that_have_a_time(tmp_path):
    blank_start = "user_id,item_id,timestamp\n" + "1,2,\n" * 3000 + "1,2,1704067200\n"
    summary = import_interactions(_write(tmp_path, blank_start), tmp_path / "out",
                                  options=ImportOptions(block_size=4096, max_bad_share=1.0))
    assert summary.time_format == "s" and summary.events == 1 and summary.bad[MISSING_VALUE] == 3000
