"""The nightly job end to end on tiny data: train -> recommend -> publish -> MLflow, in one Spark session."""
import datetime as dt
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobkit
from recsys.config import load_config
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition
from recsys.errors import ExitCode

pytestmark = [pytest.mark.spark, pytest.mark.slow]

RUN_DATE = dt.date(2024, 5, 8)
UTC = dt.timezone.utc
N_USERS, N_ITEMS, TOP_N = 40, 30, 5
UNKNOWN_ONLY_USER = 900        # interacts (on the last day) only with an item the model never saw
UNAVAILABLE = {3, 7, 11}       # in the model's vocabulary, but not available in the snapshot used


def _write_dataset(root: Path) -> None:
    rng = np.random.default_rng(0)
    for day in range(1, 8):  # 2024-05-01 .. 2024-05-07: all before the run date
        rows = []
        for user in range(1, N_USERS + 1):
            for item in rng.choice(np.arange(1, N_ITEMS + 1), size=3, replace=False):
                rows.append(dict(user_id=user, item_id=int(item), event_type="view",
                                 ts=dt.datetime(2024, 5, day, int(rng.integers(0, 24)), tzinfo=UTC)))
        if day == 7:  # data-quality cases: an unknown-only user and rows with null ids
            rows.append(dict(user_id=UNKNOWN_ONLY_USER, item_id=5000, event_type="view", ts=dt.datetime(2024, 5, 7, tzinfo=UTC)))
            rows.append(dict(user_id=None, item_id=1, event_type="view", ts=dt.datetime(2024, 5, 7, tzinfo=UTC)))
            rows.append(dict(user_id=1, item_id=None, event_type="view", ts=dt.datetime(2024, 5, 7, tzinfo=UTC)))
        write_partition(pa.Table.from_pylist(rows, schema=EVENTS_SCHEMA), root / "events", dt.date(2024, 5, day))
    # events on the run date itself must not count
    late = [dict(user_id=999, item_id=1, event_type="view", ts=dt.datetime(2024, 5, 8, 1, tzinfo=UTC))]
    write_partition(pa.Table.from_pylist(late, schema=EVENTS_SCHEMA), root / "events", RUN_DATE)
    for day, unavailable in ((1, set()), (6, UNAVAILABLE), (9, {1, 2})):  # dt=05-09 is after the run date
        rows = [dict(item_id=i, available=i not in unavailable, title=f"Item {i}", category="c")
                for i in range(1, N_ITEMS + 1)]
        write_partition(pa.Table.from_pylist(rows, schema=CATALOG_SCHEMA), root / "catalog", dt.date(2024, 5, day))


@pytest.fixture(scope="module")
def job(spark, tmp_path_factory):
    from recsys.pipelines.nightly import run_nightly
    from recsys.pipelines.train import run_training

    root = tmp_path_factory.mktemp("job")
    _write_dataset(root)
    cfg = load_config(overrides=[
        *jobkit.metastore_overrides(root),
        f"paths.events={root / 'events'}", f"paths.catalog={root / 'catalog'}",
        f"paths.output={root / 'recommendations'}", f"paths.work={root / 'work'}", f"paths.driver_scratch={root / 'driver'}",
        f"mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}", f"mlflow.artifact_location={root / 'artifacts'}",
        "history.window_days=30", f"scoring.top_n={TOP_N}", "scoring.chunk_size=3", "scoring.partitions=6",
        "train.epochs=2", "train.model.sasrec.dim=16", "train.model.sasrec.layers=1", "train.model.sasrec.heads=1", "train.model.sasrec.max_len=8",
        # the lists hold only unseen items (what the tests below check): on this data a user's repeats are chance,
        # and whether the learned blend lets known items compete turns on the tiny model's last digits
        "train.repeats.learn=false",
    ])
    trained = run_training(spark, cfg, dt.date(2024, 5, 7))   # before the unknown-only user's event
    other_date = run_nightly(spark, cfg, RUN_DATE + dt.timedelta(days=1))
    first = run_nightly(spark, cfg, RUN_DATE)
    result = run_nightly(spark, cfg, RUN_DATE, force=True)   # a forced rerun replaces the date's partition
    return dict(cfg=cfg, root=root, trained=trained, first=first, result=result, other=other_date, spark=spark)


def _published(job, date=RUN_DATE):
    return pq.read_table(Path(job["cfg"].paths.output) / f"dt={date}").to_pylist()


def _histories(job):
    """Each user's window items, read straight from the input files (independent of the job's code)."""
    events = pq.read_table(Path(job["cfg"].paths.events)).to_pylist()
    seen = {}
    for e in events:
        if e["user_id"] is not None and e["item_id"] is not None and e["ts"] < dt.datetime(2024, 5, 8, tzinfo=UTC):
            seen.setdefault(e["user_id"], set()).add(e["item_id"])
    return seen


def test_every_user_with_history_has_one_row_of_distinct_available_unseen_items_by_score(job):
    rows = _published(job)
    seen = _histories(job)
    assert sorted(r["user_id"] for r in rows) == sorted(seen)        # exactly one row per user in the window
    available = set(range(1, N_ITEMS + 1)) - UNAVAILABLE               # the snapshot of 05-06, not 05-09
    for row in rows:
        items = [r["item_id"] for r in row["recommendations"]]
        scores = [r["score"] for r in row["recommendations"]]
        assert len(items) == len(set(items))
        assert scores == sorted(scores, reverse=True)
        assert set(items) <= available
        if row["source"] == "model":
            assert not set(items) & seen[row["user_id"]]
            expected = min(TOP_N, len(available - seen[row["user_id"]]))
            assert len(items) == expected
        assert row["model_version"] == job["trained"].version


def test_users_without_known_items_get_the_marked_popularity_fallback(job):
    rows = {r["user_id"]: r for r in _published(job)}
    assert rows[UNKNOWN_ONLY_USER]["source"] == "popularity"
    assert len(rows[UNKNOWN_ONLY_USER]["recommendations"]) == TOP_N
    assert all(r["source"] == "model" for u, r in rows.items() if u != UNKNOWN_ONLY_USER)
    m = job["result"].metrics
    assert (m["fallback_users"], m["users_scored"]) == (1, N_USERS)
    assert m["dropped_null_user_id"] == 1 and m["dropped_null_item_id"] == 1
    assert m["unknown_items"] == 1


def test_the_model_is_loaded_once_per_python_worker_not_per_batch_or_partition(job):
    m = job["other"].metrics                            # the first run that uses this model version
    assert m["tasks"] >= 6 > m["workers"] >= 1          # more tasks than workers, so reuse is exercised
    assert m["model_misses"] == m["workers"]            # one load per worker ...
    assert m["model_loads_per_worker_max"] == 1         # ... and never a second on any worker
    assert m["model_hits"] == m["tasks"] - m["model_misses"]
    assert m["chunks"] > m["tasks"]                     # several chunks per task, still one load


def test_later_runs_in_the_session_reuse_the_warm_workers(job):
    for run in (job["first"], job["result"]):
        m = run.metrics
        assert m["model_loads_per_worker_max"] <= 1
        assert m["model_hits"] + m["model_misses"] == m["tasks"]
        assert m["model_hits"] >= m["tasks"] - m["workers"]
    # another catalog snapshot than the previous run: the candidate matrix is rebuilt, the weights are not
    assert job["first"].metrics["scorer_misses"] >= 1


def test_success_marker_and_manifest_tie_the_partition_to_the_mlflow_run(job):
    from mlflow import MlflowClient

    part = Path(job["cfg"].paths.output) / f"dt={RUN_DATE}"
    assert (part / "_SUCCESS").is_file()
    manifest = json.loads((part / "_manifest.json").read_text())
    result = job["result"]
    assert manifest["run_id"] == result.run_id
    assert manifest["catalog_snapshot"] == "2024-05-06"
    assert manifest["model"]["version"] == job["trained"].version
    assert manifest["counts"]["rows"] == N_USERS + 1
    run = MlflowClient(job["cfg"].mlflow.tracking_uri).get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["date"] == str(RUN_DATE)
    assert run.data.params["model_version"] == job["trained"].version
    assert run.data.params["catalog_snapshot"] == "2024-05-06"
    for metric in ("users_scored", "fallback_users", "catalog_available_items", "catalog_coverage", "users_per_s",
                   "model_load_s", "model_hits", "model_misses", "stage_score_s", "dropped_null_user_id",
                   "unknown_items"):
        assert metric in run.data.metrics, metric
    artifacts = {a.path for a in MlflowClient(job["cfg"].mlflow.tracking_uri).list_artifacts(result.run_id)}
    assert {"config.yaml", "manifest.json", "recommendations_sample.csv", "plots"} <= artifacts
    plots = {a.path for a in MlflowClient(job["cfg"].mlflow.tracking_uri).list_artifacts(result.run_id, "plots")}
    assert plots == {"plots/score_distribution.png", "plots/popularity_long_tail.png", "plots/guard_trend.png"}


def test_a_rerun_replaces_its_date_and_leaves_other_dates_alone(job):
    root = Path(job["cfg"].paths.output)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith("_")) == ["dt=2024-05-08", "dt=2024-05-09"]
    manifest = json.loads((root / f"dt={RUN_DATE}" / "_manifest.json").read_text())
    assert manifest["run_id"] == job["result"].run_id != job["first"].run_id
    other = json.loads((root / "dt=2024-05-09" / "_manifest.json").read_text())
    assert other["run_id"] == job["other"].run_id
    assert not list((root / "_staging").glob("*/*")) if (root / "_staging").exists() else True
    # both runs of the date are kept (output.keep_runs: 2); the other date has its one run
    runs = sorted(p.name for p in (root / "_runs" / f"dt={RUN_DATE}").glob("run=*"))
    assert runs == sorted(f"run={r.manifest.job_run}" for r in (job["first"], job["result"]))


def test_the_night_is_published_to_the_table_and_a_reader_of_the_table_counts_it(job, spark):
    table = jobkit.table_name(job["root"])
    rows = spark.sql(f"select count(*) from {table} where dt = '{RUN_DATE}'").first()[0]
    assert rows == N_USERS + 1 == job["result"].manifest.counts.rows
    location = spark.sql(f"describe formatted {table} partition (dt = '{RUN_DATE}')").collect()
    where = next(r[1] for r in location if r[0] == "Location")
    assert where.endswith(f"/_runs/dt={RUN_DATE}/run={job['result'].manifest.job_run}") == True
    assert where.replace("file:", "") == job["result"].location    # the run directory, never the path view
    dates = [r[0] for r in spark.sql(f"show partitions {table}").collect()]
    assert dates == ["dt=2024-05-08", "dt=2024-05-09"]
    by_table = {r["user_id"]: r["recommendations"] for r in spark.sql(
        f"select user_id, recommendations from {table} where dt = '{RUN_DATE}'").toArrow().to_pylist()}
    assert by_table == {r["user_id"]: r["recommendations"] for r in _published(job)}   # the same night as the path


def test_training_registered_a_version_and_pointed_the_alias_at_it(job):
    from mlflow import MlflowClient

    cfg = job["cfg"]
    mv = MlflowClient(cfg.mlflow.tracking_uri).get_model_version_by_alias(cfg.mlflow.model_name, cfg.mlflow.alias)
    assert str(mv.version) == job["trained"].version
    assert job["trained"].promoted
    assert job["result"].exit_code == ExitCode.OK


def test_the_job_runs_over_spark_connect(job, tmp_path):
    """DataFrame API only: the same job through a Spark Connect client (a local Connect server here),
    with the workers' figures coming back as data."""
    import os
    import subprocess
    import sys

    cfg, root = job["cfg"], job["root"]
    date = "2024-05-10"
    overrides = [
        f"paths.events={cfg.paths.events}", f"paths.catalog={cfg.paths.catalog}", f"paths.output={cfg.paths.output}",
        f"paths.work={root / 'work-connect'}", f"paths.driver_scratch={root / 'driver-connect'}", f"mlflow.tracking_uri={cfg.mlflow.tracking_uri}",
        f"mlflow.artifact_location={cfg.mlflow.artifact_location}", "history.window_days=30", f"scoring.top_n={TOP_N}",
        "spark.remote=local[2]",
    ]
    args = [sys.executable, "-m", "recsys.cli", "recommend", "--date", date]
    for item in overrides:
        args += ["--set", item]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[Stage " not in done.stderr + done.stdout     # the local server's JVM shares the log: no progress bars
    manifest = json.loads((Path(cfg.paths.output) / f"dt={date}" / "_manifest.json").read_text())
    assert manifest["counts"]["rows"] == N_USERS + 2      # user 999's event of 05-08 is in this window
    assert manifest["metrics"]["model_misses"] >= 1 and manifest["metrics"]["tasks"] >= 1
    assert manifest["run_id"]


def test_training_reads_train_history_items_not_the_scoring_history_cap(job):
    """Scoring needs the recent items only; training learns from the longer history it is given."""
    from recsys.learning.shards import training_histories
    from recsys.sequences import Sequences

    def load_training_data(spark, cfg, date):   # the rows the shards hold, collected for the test's inspection only
        return Sequences.from_arrow(training_histories(spark, cfg, date).toArrow().column("history"))

    events = f"paths.events={job['cfg'].paths.events}"
    longer = load_config(overrides=[events, "history.window_days=30", "history.max_items=2", "train.history_items=50"])
    capped = load_config(overrides=[events, "history.window_days=30", "history.max_items=50", "train.history_items=2"])
    long_seqs = load_training_data(job["spark"], longer, RUN_DATE)
    short_seqs = load_training_data(job["spark"], capped, RUN_DATE)
    assert long_seqs.lengths.max() > 2
    assert short_seqs.lengths.max() == 2


def test_recsys_rollback_points_the_table_back_at_the_first_run_and_forward_again(job, spark, monkeypatch, capsys):
    cfg, first, forced = job["cfg"], job["first"].manifest.job_run, job["result"].manifest.job_run
    table = jobkit.table_name(job["root"])
    args = [a for item in [*jobkit.metastore_overrides(job["root"]), f"paths.events={cfg.paths.events}",
                           f"paths.catalog={cfg.paths.catalog}", f"paths.output={cfg.paths.output}",
                           f"paths.work={cfg.paths.work}", f"paths.driver_scratch={cfg.paths.driver_scratch}",
                           f"mlflow.tracking_uri={cfg.mlflow.tracking_uri}"] for a in ("--set", item)]
    assert jobkit.cli(monkeypatch, spark, ["rollback", "--date", str(RUN_DATE), "--list", *args]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [forced, first] and "published now" in listed[0]

    def location() -> str:
        rows = spark.sql(f"describe formatted {table} partition (dt = '{RUN_DATE}')").collect()
        return next(r[1] for r in rows if r[0] == "Location")

    assert jobkit.cli(monkeypatch, spark, ["rollback", "--date", str(RUN_DATE), *args]) == 0
    assert location().endswith(f"run={first}")
    manifest = json.loads((Path(cfg.paths.output) / f"dt={RUN_DATE}" / "_manifest.json").read_text())
    assert manifest["job_run"] == first                                # the path view follows
    assert jobkit.cli(monkeypatch, spark, ["rollback", "--date", str(RUN_DATE), "--to", forced, *args]) == 0
    assert location().endswith(f"run={forced}")
    assert jobkit.cli(monkeypatch, spark, ["rollback", "--date", str(RUN_DATE), "--to", "nope", *args]) == 2
