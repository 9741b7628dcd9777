"""A run found dead is ended as KILLED in MLflow, and ``recsys runs`` says so. A sqlite store, no Spark.

The job's own path (a SIGKILLed ``recsys recommend``, then the next run of the date) is
``test_job_faults::test_a_job_killed_while_writing_leaves_the_old_partition_and_a_rerun_succeeds``.
"""
from __future__ import annotations

import datetime as dt

import pytest

from recsys.config import load_config
from recsys.tracking import tags

DATE = "2024-05-08"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (setting one up costs seconds): each test has runs of its own."""
    from mlflow import MlflowClient

    from recsys.tracking.store import setup

    tmp_path = tmp_path_factory.mktemp("killed-runs")
    cfg = load_config(overrides=[f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                 f"mlflow.artifact_location={tmp_path / 'artifacts'}",
                                 f"paths.output={tmp_path / 'recommendations'}"])
    experiment_id = setup(cfg.mlflow)
    client = MlflowClient()

    def start(job_run: str, date: str = DATE):
        return client.create_run(experiment_id, run_name=f"recommend {date}", tags={
            tags.JOB: tags.NIGHTLY_JOB, tags.DATE: date, tags.JOB_RUN: job_run}).info.run_id

    return cfg, client, start


def test_the_dead_run_s_mlflow_run_is_killed_with_who_found_it_and_when(store):
    from recsys.cli.runs import format_table, list_runs
    from recsys.tracking.store import end_killed_run

    cfg, client, start = store
    dead = start("20240508T021500Z-dead0001")
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    ended = end_killed_run(cfg.mlflow, mlflow_run_id=dead, job_run="20240508T021500Z-dead0001",
                           found_by="20240508T030000Z-next0001", why="its process 4242 on node-1 is gone",
                           last_alive=dt.datetime.now(dt.timezone.utc))
    assert ended == dead
    run = client.get_run(dead)
    assert run.info.status == "KILLED" and run.info.end_time >= run.info.start_time
    t = run.data.tags
    assert t[tags.STATUS] == "killed" and t[tags.FOUND_DEAD_BY] == "20240508T030000Z-next0001"
    assert before <= dt.datetime.fromisoformat(t[tags.FOUND_DEAD_AT]) <= dt.datetime.now(dt.timezone.utc)
    assert "its process 4242 on node-1 is gone" in t[tags.ERROR] and "20240508T030000Z-next0001" in t[tags.NOTE]

    [row] = [r for r in list_runs(cfg, date=dt.date.fromisoformat(DATE)) if r["run_id"] == dead]
    assert (row["status"], row["exit_code"], row["found_dead_by"]) == ("killed", None, "20240508T030000Z-next0001")
    line = format_table([row]).splitlines()[1]
    assert line.split()[:2] == [DATE, "killed"] and "found dead by run 20240508T030000Z-next0001" in line


def test_without_an_id_in_the_lock_the_run_is_found_by_its_run_key_and_ended_runs_are_left_alone(store):
    from recsys.tracking.store import end_killed_run

    cfg, client, start = store
    dead, other = start("20240508T021500Z-dead0002"), start("20240508T021600Z-live0002")
    kwargs = dict(mlflow_run_id=None, found_by="20240508T030000Z-next0002", why="no heartbeat for 900s (ttl 600s)")
    assert end_killed_run(cfg.mlflow, job_run="20240508T021500Z-dead0002", **kwargs) == dead   # an older lock
    assert client.get_run(dead).info.status == "KILLED" and client.get_run(other).info.status == "RUNNING"

    client.set_terminated(other, "FINISHED")          # a run that ended before its lock was found stale
    assert end_killed_run(cfg.mlflow, job_run="20240508T021600Z-live0002", **kwargs) is None
    assert end_killed_run(cfg.mlflow, mlflow_run_id=other, job_run="x", found_by="y", why="z") is None
    assert client.get_run(other).info.status == "FINISHED" and tags.FOUND_DEAD_BY not in client.get_run(other).data.tags
    assert end_killed_run(cfg.mlflow, job_run="x' or tags.`recsys.job` = 'nightly", **kwargs) is None   # never a filter


def test_recsys_runs_names_a_run_whose_date_lock_was_best_effort(store):
    from recsys.cli.runs import format_run, format_table, list_runs, show_run

    cfg, client, start = store
    date = "2024-05-09"                                        # a date of its own in the module's store
    weak, strong = start("20240509T021500Z-weak0001", date), start("20240509T031500Z-strong01", date)
    client.set_tag(weak, tags.LOCK, "best effort")
    client.set_tag(strong, tags.LOCK, "compare-and-set")
    for run in (weak, strong):
        client.set_terminated(run, "FINISHED")
    rows = {r["run_id"]: r for r in list_runs(cfg, date=dt.date.fromisoformat(date))}
    assert len(rows) == 2 and rows[weak]["lock"] == "best effort" and rows[strong]["lock"] == "compare-and-set"
    table = format_table([rows[strong], rows[weak]]).splitlines()
    assert table[2].endswith("lock: best effort") and "lock:" not in table[1]   # only the weak lock is worth a word
    assert "lock: best effort (the store has no conditional writes" in format_run(show_run(cfg, weak))
