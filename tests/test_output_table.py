"""The catalog table: a reader of the table through a publish (and a kill at each step) sees old or new.

The publisher runs in a child process with its own Spark session on the test session's metastore service
(a Derby network server: two JVMs share the catalog, as the job, the backend and a notebook do), held at
a pause point, then killed or released. The reader is this process's shared session, querying the table
in a loop on a thread while the child publishes: every answer must be one whole night, the old one or
the new one. The nights are real Parquet files (the output schema) written by pyarrow into run
directories, one model version each, so a mix would show as two versions or a wrong count.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import jobkit
import storekit
from recsys.errors import ConfigError
from recsys.publish.published import published, read_pointer
from recsys.publish.publisher import PartitionLayout, publish, recover
from recsys.publish.table import OutputTable, open_table

pytestmark = [pytest.mark.spark]

DATE = dt.date(2024, 5, 8)
OLD_USERS, NEW_USERS = 30, 40
REPO = Path(__file__).resolve().parent.parent


def _night(layout: PartitionLayout, version: str, users: int) -> None:
    jobkit.write_night(layout.run_dir, version, users)


_manifest = jobkit.night_manifest


def _answer(spark, table: str) -> tuple:
    rows = spark.sql(f"select model_version, count(*) as n from {table} where dt = '{DATE}' group by model_version").collect()
    return tuple(sorted((r["model_version"], r["n"]) for r in rows))


OLD, NEW = (("1", OLD_USERS),), (("2", NEW_USERS),)


@pytest.fixture()
def published_old(spark, tmp_path):
    out = str(tmp_path / "recommendations")
    table = open_table(spark, jobkit.table_name(tmp_path), out)
    old = PartitionLayout(out, DATE, "20240508T000000Z-old")
    _night(old, "1", OLD_USERS)
    publish(old, _manifest(old.run_key, "1"), "exchange", table=table)
    assert _answer(spark, table.name) == OLD
    return out, table


_CHILD = """
import datetime, sys
from pyspark.sql import SparkSession
from recsys.config import load_hooks
from recsys.spark import metastore
from recsys.publish.manifest import Manifest, ModelRef
from recsys.publish.publisher import PartitionLayout, publish
from recsys.publish import retention
from recsys.publish.table import OutputTable
out, name, run, url, scratch, what = sys.argv[1:7]
store = metastore.Metastore(__import__("pathlib").Path(scratch), url, (metastore.DERBY_CLIENT_JAR,), None)
builder = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
for k, v in {**metastore.metastore_settings(store), **metastore.launch_settings(store)}.items():
    builder = builder.config(k, v)
spark = builder.getOrCreate()
table = OutputTable(spark, name, out)
date = datetime.date(2024, 5, 8)
if what == "retention":
    retention.retire_dates(out, date, 1, table, "retention", load_hooks())
else:
    publish(PartitionLayout(out, date, run), Manifest(run_id=run, job_run=run, model=ModelRef(version="2")), "exchange",
            load_hooks(), table)
print("done", flush=True)
"""


def _child(out: str, table: OutputTable, run: str, tmp_path: Path, what: str = "publish") -> list[str]:
    return [sys.executable, "-c", _CHILD, out, table.name, run, jobkit.METASTORE_URL, str(tmp_path / "child"), what]


class Reader(threading.Thread):
    """Queries the table in a loop (bounded) until told to stop; keeps every answer."""

    def __init__(self, spark, table: str, limit: int = 2000):
        super().__init__(daemon=True)
        self.spark, self.table, self.limit = spark, table, limit
        self.answers: list[tuple] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and len(self.answers) < self.limit:
            try:
                self.answers.append(_answer(self.spark, self.table))
            except Exception as exc:   # a reader that fails is a finding too
                self.errors.append(str(exc).splitlines()[0])


_POINTS = [("before_swap", OLD), ("after_table", NEW), ("after_pointer", NEW), ("after_swap", NEW)]


@pytest.mark.slow
@pytest.mark.parametrize("point, expect", _POINTS, ids=[p[0] for p in _POINTS])
def test_a_reader_of_the_table_through_a_publish_killed_at_each_step_sees_the_old_or_the_new_night(
        spark, published_old, tmp_path, point, expect):
    out, table = published_old
    new = PartitionLayout(out, DATE, "20240508T010000Z-new")
    _night(new, "2", NEW_USERS)
    reader = Reader(spark, table.name)
    reader.start()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    try:
        storekit.kill_at(_child(out, table, new.run_key, tmp_path), point, env, timeout_s=300)
        at_kill = _answer(spark, table.name)
    finally:
        reader.stop.set()
        reader.join(timeout=120)
    assert at_kill == expect                                       # the commit point is the table's partition
    assert reader.errors == [] and reader.answers
    assert set(reader.answers) <= {OLD, NEW}                       # never a mix, never a partial night
    assert reader.answers == sorted(reader.answers, key=lambda a: a != OLD)   # old, then new: no flicker back

    # the next run of the date recovers: the pointer and the path view follow the table
    recover(PartitionLayout(out, DATE, "20240508T020000Z-next"), table, "exchange")
    night = published(out, DATE, table)
    assert (night.run == new.run_key) == (expect == NEW) and read_pointer(out, DATE).run == night.run
    view = json.loads((Path(out) / f"dt={DATE}" / "_manifest.json").read_text())
    assert view["job_run"] == night.run and _answer(spark, table.name) == expect


@pytest.mark.slow
def test_a_reader_sees_the_new_night_from_the_moment_the_table_switches(spark, published_old, tmp_path):
    """Held after the table switched, the path view is still the old night; released, the publish completes."""
    out, table = published_old
    new = PartitionLayout(out, DATE, "20240508T010000Z-new")
    _night(new, "2", NEW_USERS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable, "RECSYS_PAUSE_AT": "after_table",
           "RECSYS_PAUSE_MAX_S": "300"}
    proc = subprocess.Popen(_child(out, table, new.run_key, tmp_path), env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("recsys-pause: after_table"):
                break
        assert _answer(spark, table.name) == NEW
        view = pq.read_table(Path(out) / f"dt={DATE}").column("model_version").unique().to_pylist()
        assert view == ["1"]                                       # readers of paths: still the old night
        os.kill(proc.pid, signal.SIGUSR1)                          # let it finish
        assert proc.stdout.read().strip() == "done"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert pq.read_table(Path(out) / f"dt={DATE}").column("model_version").unique().to_pylist() == ["2"]


@pytest.mark.slow
def test_retention_killed_after_dropping_a_partition_leaves_every_date_published_or_gone(spark, published_old, tmp_path):
    out, table = published_old
    old_day = dt.date(2024, 5, 1)
    early = PartitionLayout(out, old_day, "20240501T000000Z-early")
    _night(early, "0", 5)
    publish(early, _manifest(early.run_key, "0"), "exchange", table=table)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    storekit.kill_at(_child(out, table, "x", tmp_path, "retention"), "retention", env, timeout_s=300)
    assert table.dates() == [DATE]                                 # the old date left the table first
    assert _answer(spark, table.name) == OLD                       # the published date untouched
    from recsys.publish import retention

    retention.retire_dates(out, DATE, 1, table)                    # the next pass finishes it
    assert not (Path(out) / "_runs" / f"dt={old_day}").exists() and not (Path(out) / f"dt={old_day}").exists()


def test_a_table_located_elsewhere_is_refused_naming_both(spark, published_old, tmp_path):
    out, table = published_old
    with pytest.raises(ConfigError, match="is located at .* not at paths.output"):
        open_table(spark, table.name, str(tmp_path / "elsewhere"))


def test_a_table_created_anew_registers_every_date_the_pointers_name(spark, published_old, tmp_path):
    from recsys.publish.publisher import register_dates

    out, table = published_old
    spark.sql(f"drop table {table.name}")                          # a new metastore, or a table added later
    fresh = open_table(spark, table.name, out)
    assert fresh.created and fresh.dates() == []
    assert register_dates(out, fresh) == [f"registered dt={DATE} (run 20240508T000000Z-old) in table {table.name}"]
    assert _answer(spark, table.name) == OLD
