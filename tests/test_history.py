"""History building and input reading on tiny Spark fixtures."""
import datetime as dt
import shutil

import pyarrow as pa
import pytest

from recsys.data import history as hist
from recsys.data.contracts import EVENTS_SCHEMA, CATALOG_SCHEMA, write_partition
from recsys.data.readers import KeptWindow, read_catalog_snapshot, read_events_window
from recsys.errors import InputDataError

pytestmark = [pytest.mark.spark, pytest.mark.slow]   # about 25 s of Spark jobs on 2 cores
UTC = dt.timezone.utc


def ts(day, hour=12, minute=0):
    return dt.datetime(2024, 5, day, hour, minute, tzinfo=UTC)


def write_events(root, rows_by_day):
    for day, rows in rows_by_day.items():
        table = pa.Table.from_pylist(
            [dict(user_id=u, item_id=i, event_type=e, ts=t) for u, i, e, t in rows], schema=EVENTS_SCHEMA)
        write_partition(table, root, dt.date(2024, 5, day))


def test_histories_dedupe_order_by_latest_time_and_keep_the_newest(spark, tmp_path):
    events = tmp_path / "events"
    write_events(events, {
        1: [(1, 10, "view", ts(1)), (1, 11, "view", ts(1, 13)), (2, 10, "view", ts(1))],
        2: [(1, 10, "click", ts(2)), (1, 12, "view", ts(2, 9))],
        3: [(1, 13, "view", ts(3))],          # on the run date: excluded
    })
    window = read_events_window(spark, str(events), dt.date(2024, 5, 3), window_days=7)
    out = hist.build_histories(hist.drop_null_ids(window), max_items=2, tie_break_seed=7)
    got = {r.user_id: r.history for r in out.collect()}
    # user 1: 11 (day1 13h), 12 (day2 9h), 10 (day2 12h, deduped to its latest) -> newest two, oldest first
    assert got == {1: [12, 10], 2: [10]}


def test_window_excludes_events_older_than_window_days(spark, tmp_path):
    events = tmp_path / "events"
    write_events(events, {1: [(1, 10, "view", ts(1))], 9: [(1, 11, "view", ts(9))]})
    window = read_events_window(spark, str(events), dt.date(2024, 5, 10), window_days=3)
    assert [r.item_id for r in window.collect()] == [11]


def test_a_window_never_opens_a_file_outside_it(spark, tmp_path):
    """Partitions before the window and from the date on hold files that are not Parquet: the night's read of
    its window never opens them (only the window's partitions are listed for files and checked); the same
    files inside a window fail the read, naming the file, so opening one would show."""
    events = tmp_path / "events"
    write_events(events, {5: [(1, 10, "view", ts(5))], 7: [(1, 11, "view", ts(7))]})
    for day in (1, 8, 9):                       # before the window of 2024-05-08 and 3 days; on and after the date
        partition = events / f"dt=2024-05-{day:02d}"
        partition.mkdir()
        (partition / "part-00000.parquet").write_bytes(b"not a parquet file")
    window = read_events_window(spark, str(events), dt.date(2024, 5, 8), window_days=3)
    assert sorted(r.item_id for r in window.collect()) == [10, 11]
    with pytest.raises(InputDataError, match="dt=2024-05-01"):
        read_events_window(spark, str(events), dt.date(2024, 5, 8), window_days=10)


def test_event_type_filter(spark, tmp_path):
    events = tmp_path / "events"
    write_events(events, {1: [(1, 10, "view", ts(1)), (1, 11, "purchase", ts(1))]})
    window = read_events_window(spark, str(events), dt.date(2024, 5, 2), 7, event_types=("purchase",))
    assert [r.item_id for r in window.collect()] == [11]


def test_a_kept_window_is_read_once_kept_on_local_disk_for_its_own_key_and_released(spark, tmp_path):
    """On disk, not in the heap: the stages that pass over the window need the heap themselves (at 1M users a
    window kept in a 1g local driver's memory ran training's shard write out of heap: docs/performance.md)."""
    events = tmp_path / "events"
    write_events(events, {1: [(1, 10, "view", ts(1))], 2: [(1, 11, "view", ts(2))]})
    date = dt.date(2024, 5, 3)
    with KeptWindow(spark, str(events), date, 7) as kept:
        assert not kept.read
        window = kept.events(str(events), date, 7)
        assert sorted(r.item_id for r in window.collect()) == [10, 11]
        level = window.storageLevel
        assert level.useDisk and not level.useMemory and not level.useOffHeap
        shutil.rmtree(events)                       # later passes read the kept copy, not the source
        assert kept.events(str(events), date, 7) is window and window.count() == 2
        assert kept.events(str(events), date, 6) is None     # another window: its stage reads its own
    assert not window.is_cached


def test_time_ties_are_broken_by_a_seeded_hash_not_by_item_id(spark):
    rows = [(1, item, dt.datetime(2024, 5, 1, tzinfo=UTC)) for item in range(1, 41)]
    df = spark.createDataFrame(rows, "user_id long, item_id long, ts timestamp")
    orders = [hist.build_histories(df, max_items=100, tie_break_seed=s).first().history for s in (1, 2)]
    assert sorted(orders[0]) == list(range(1, 41))
    assert orders[0] != sorted(orders[0]) and orders[0] != sorted(orders[0], reverse=True)
    assert orders[0] != orders[1]      # the seed matters
    again = hist.build_histories(df, max_items=100, tie_break_seed=1).first().history
    assert again == orders[0]          # and is reproducible


def test_null_ids_are_dropped_and_counted(spark):
    from pyspark.sql import Observation

    df = spark.createDataFrame(
        [(1, 10, "v", dt.datetime(2024, 5, 1)), (None, 10, "v", dt.datetime(2024, 5, 1)), (2, None, "v", dt.datetime(2024, 5, 1))],
        "user_id long, item_id long, event_type string, ts timestamp")
    obs = Observation("q")
    kept = hist.drop_null_ids(df.observe(obs, *hist.input_quality_metrics()))
    assert kept.count() == 1
    assert obs.get == {"events_read": 3, "dropped_null_user_id": 1, "dropped_null_item_id": 1, "dropped_null_ts": 0}


def test_latest_catalog_snapshot_on_or_before_the_date(spark, tmp_path):
    catalog = tmp_path / "catalog"
    for day, items in ((1, [1, 2]), (5, [1, 2, 3]), (9, [4])):
        table = pa.Table.from_pylist([dict(item_id=i, available=True, title=f"t{i}", category="c") for i in items],
                                     schema=CATALOG_SCHEMA)
        write_partition(table, catalog, dt.date(2024, 5, day))
    snap = read_catalog_snapshot(spark, str(catalog), dt.date(2024, 5, 7))
    assert snap.date == dt.date(2024, 5, 5)
    assert sorted(r.item_id for r in snap.frame.collect()) == [1, 2, 3]
    with pytest.raises(InputDataError, match="no catalog snapshot on or before 2024-04-30"):
        read_catalog_snapshot(spark, str(catalog), dt.date(2024, 4, 30))
    with pytest.raises(InputDataError, match="older than catalog.max_age_days=1"):
        read_catalog_snapshot(spark, str(catalog), dt.date(2024, 5, 7), max_age_days=1)


def test_missing_input_path_is_a_clear_input_error(spark, tmp_path):
    with pytest.raises(InputDataError, match="events path .* does not exist"):
        read_events_window(spark, str(tmp_path / "nope"), dt.date(2024, 5, 1), 7)


def test_schema_drift_names_the_column(spark, tmp_path):
    events = tmp_path / "events"
    bad = pa.table({"user": pa.array([1], pa.int64()), "item_id": pa.array([1], pa.int64()),
                    "event_type": pa.array(["v"]), "ts": pa.array([ts(1)], pa.timestamp("us", tz="UTC"))})
    write_partition(bad, events, dt.date(2024, 5, 1))
    with pytest.raises(InputDataError, match=r"lacks column\(s\) \['user_id'\]"):
        read_events_window(spark, str(events), dt.date(2024, 5, 2), 7)


def test_touched_items_are_split_into_known_and_new_and_the_personal_frequency_list_is_as_of_the_since_time(spark):
    """Since day 3: user 1 repeats 10 and finds 12; user 2 is new since; user 3 touched nothing since."""
    rows = [(1, 11, ts(1, 8)), (1, 11, ts(1, 9)), (1, 11, ts(1, 10)),   # 3 events before
            (1, 10, ts(1)), (1, 10, ts(2)), (1, 10, ts(3)),                # 2 before (latest day 2), 1 since
            (1, 16, ts(1, 8)), (1, 16, ts(1, 9)),                          # 2 before (latest day 1)
            (1, 14, ts(2)), (1, 13, ts(2)),                                # 1 each at the same time: 13 first
            (1, 15, ts(1)),                                                # 1, earlier: cut off at 5
            (1, 12, ts(4)),                                                # new since
            (2, 20, ts(4)), (3, 30, ts(1))]
    df = spark.createDataFrame(rows, "user_id long, item_id long, ts timestamp")
    out = {r.user_id: r for r in hist.build_histories(df, max_items=2, tie_break_seed=1, touched_since=ts(3, 0),
                                                      frequency_items=5).collect()}
    assert sorted(out[1].touched_items) == [10, 12] and out[1].touched_known_items == [10]
    assert out[1].personal_frequency_items == [11, 10, 16, 13, 14]
    assert out[1].history == [10, 12]          # max_items cuts the history, not the other columns
    assert (out[2].touched_items, out[2].touched_known_items, out[2].personal_frequency_items) == ([20], [], [])
    assert (out[3].touched_items, out[3].touched_known_items, out[3].personal_frequency_items) == ([], [], [30])
    # without a length the list is not built; without a since time none of the three is
    assert "personal_frequency_items" not in hist.build_histories(df, max_items=2, tie_break_seed=1,
                                                                  touched_since=ts(3, 0)).columns
    assert not {"touched_items", "touched_known_items"} & set(hist.build_histories(df, max_items=2,
                                                                                   tie_break_seed=1).columns)
    with pytest.raises(ValueError, match="frequency_items=0"):
        hist.build_histories(df, max_items=2, tie_break_seed=1, touched_since=ts(3, 0), frequency_items=0)


def _listing_tasks(spark, group: str, read) -> tuple[object, list[int]]:
    """What ``read`` returns and the task counts of the Spark stages it ran, in the job group ``group``."""
    sc = spark.sparkContext
    sc.setJobGroup(group, group)
    try:
        result = read()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    tracker = sc.statusTracker()
    stages = [s for job in tracker.getJobIdsForGroup(group) for s in tracker.getJobInfo(job).stageIds]
    return result, [tracker.getStageInfo(s).numTasks for s in stages]


def _daily_partitions(events, days: int, first: dt.date = dt.date(2024, 1, 1)):
    """``days`` daily partitions under ``events`` from ``first``, one event (one small file) each."""
    for n in range(days):
        day = first + dt.timedelta(days=n)
        write_partition(pa.Table.from_pylist([dict(user_id=1, item_id=n + 1, event_type="view",
                                                   ts=dt.datetime.combine(day, dt.time(12), tzinfo=UTC))],
                                             schema=EVENTS_SCHEMA), events, day)
    return events, first


def test_a_window_of_many_small_files_is_read_in_as_few_tasks_as_its_bytes_need(spark, tmp_path):
    """Spark counts every file as at least ``spark.sql.files.openCostInBytes`` (4 MiB): 200 one-row files are
    hundreds of MiB to it, split in several tasks, and a night that keeps the window scans every one of them at
    every stage. The reader coalesces to ``spark.sql.shuffle.partitions`` (4 in the tests' session), or to one
    task per ``spark.sql.files.maxPartitionBytes`` of the files when that is more."""
    events, first = _daily_partitions(tmp_path / "events", 200)
    date = first + dt.timedelta(days=200)
    scanned = spark.read.parquet(*sorted(str(p) for p in events.iterdir())).rdd.getNumPartitions()
    assert scanned > 4                                            # the control: Spark alone splits it further
    window = read_events_window(spark, str(events), date, window_days=200)
    assert window.rdd.getNumPartitions() == int(spark.conf.get("spark.sql.shuffle.partitions")) == 4
    assert window.count() == 200
    size = sum(f.stat().st_size for f in events.rglob("*.parquet"))
    spark.conf.set("spark.sql.files.maxPartitionBytes", str(size // 10))   # the bytes need 10 or 11 tasks
    try:
        window = read_events_window(spark, str(events), date, window_days=200)
        assert window.rdd.getNumPartitions() in (10, 11)
        assert window.count() == 200
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")


def test_a_window_of_many_daily_partitions_is_listed_by_a_few_dozen_tasks_not_one_per_partition(spark, tmp_path):
    """Spark lists a read of more than 32 paths with a job of one task per path; the session default
    (LISTING_SETTINGS, set by every session the job builds) caps that job, so 200 days list in at most 64."""
    from recsys.spark.session import LISTING_SETTINGS, apply_runtime_settings

    events, first = _daily_partitions(tmp_path / "events", 200)
    key, cap = next(iter(LISTING_SETTINGS.items()))
    assert spark.conf.get(key) == cap           # the tests' session is built as the job builds its own
    window, tasks = _listing_tasks(spark, "listing-capped", lambda: read_events_window(
        spark, str(events), first + dt.timedelta(days=200), window_days=200))
    assert window.count() == 200
    assert tasks and max(tasks) <= int(cap), tasks
    # without the cap Spark runs one listing task per partition (the behaviour the default exists for)
    spark.conf.set(key, "10000")
    try:
        _, uncapped = _listing_tasks(spark, "listing-uncapped", lambda: read_events_window(
            spark, str(events), first + dt.timedelta(days=200), window_days=200))
        assert max(uncapped) == 200, uncapped
        apply_runtime_settings(spark)                # a value someone set is theirs: not overwritten
        assert spark.conf.get(key) == "10000"
    finally:
        spark.conf.set(key, cap)
