"""``recsys night``: training when due, then the night's lists, in one process and one Spark session.

Three nights of the small dataset of tests/jobkit.py through the command line, in this process on the shared
session (``jobkit.cli``): the first trains (due: nothing trained yet) and publishes with the new version; the
next is not due (``train.every_nights=2``) and publishes with the same version; the third is due, its training
fails on bad input, and the night still publishes, with the version holding the alias, exit 0, saying why.
One read of the events window a night where ``recsys train`` and ``recsys recommend`` read it twice. And a
night whose training process dies (SIGKILL at the ``fitting`` pause point): its retry publishes with the alias
holder instead of training again; ``recsys train`` by hand takes the same mark (exit 4 while a training of the
date runs; a dead one's MLflow run ended). tests/test_airflow_dag.py runs the same command as the DAG's ``night`` task.
"""
import dataclasses
import datetime as dt
import json
import logging

import pytest

import jobkit
from jobkit import N_USERS, RUN_DATE

pytestmark = [pytest.mark.spark]
SLOW = pytest.mark.slow     # the two that train and publish (about a minute together); the last one is quick

# 24 users: the gate judges on 10 or more; the store's first version records no training date, so the first
# training is judged on all users and, with tolerance 1, moves the alias
TRAINING = ["train.epochs=2", "train.device=cpu", "train.every_nights=2", "train.model.sasrec.dim=8",
            "train.model.sasrec.layers=1", "train.model.sasrec.heads=1", "train.model.sasrec.max_len=8",
            "train.gate_min_users=10", "train.gate_tolerance=1"]


def _manifest(root, date: dt.date) -> dict:
    return json.loads((root / "recommendations" / f"dt={date}" / "_manifest.json").read_text())


def _alias_holder(store) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store.tracking_uri, registry_uri=store.tracking_uri)
    return str(client.get_model_version_by_alias(store.model_name, "champion").version)


def _night(monkeypatch, spark, root, store, date: dt.date, *extra: str) -> int:
    return jobkit.cli(monkeypatch, spark, ["night", "--date", str(date),
                                           *jobkit.recommend_args(root, store, *TRAINING, *extra)])


def _runs(root, store) -> list[dict]:
    """What `recsys runs` lists for the test's store, newest first."""
    from recsys.cli.runs import list_runs

    return list_runs(jobkit.config(root, store, *TRAINING))


def _runs_table(rows: list[dict]) -> str:
    from recsys.cli.runs import format_table

    return format_table(rows)


def _kept_rdds(spark) -> int:
    """How many RDDs Spark keeps (persisted) in this session."""
    return spark.sparkContext._jsc.getPersistentRDDs().size()


@SLOW
def test_a_night_trains_when_due_publishes_with_what_it_trained_and_survives_a_failed_training(
        spark, tmp_path, monkeypatch, caplog, capsys):
    from recsys.data import readers

    jobkit.write_dataset(tmp_path)
    store = jobkit.make_store(tmp_path / "store")
    caplog.set_level(logging.INFO, logger="recsys")
    reads = jobkit.record_calls(monkeypatch, readers, "read_events")     # every listing and read of the events
    kept_before = _kept_rdds(spark)

    # night 1: nothing trained yet, so training is due; the lists come from the version it registered. Training
    # and the night's histories share one read of the window, which Spark keeps for the night and no longer
    assert _night(monkeypatch, spark, tmp_path, store, RUN_DATE) == 0
    assert len(reads) == 1 and _kept_rdds(spark) == kept_before
    out = capsys.readouterr().out
    assert "trained model version 2" in out and f"published {RUN_DATE}" in out
    assert _alias_holder(store) == "2"
    first = _manifest(tmp_path, RUN_DATE)
    assert first["model"]["version"] == "2" and first["counts"]["rows"] == N_USERS
    final = caplog.records[-1].getMessage()
    assert final.startswith("recsys night finished with exit code 0") and "trained model version 2" in final

    # night 2: one night after, train.every_nights=2: not due, the same version scores
    second_date = RUN_DATE + dt.timedelta(days=1)
    caplog.clear()
    assert _night(monkeypatch, spark, tmp_path, store, second_date) == 0
    final = caplog.records[-1].getMessage()
    assert f"training not due: the last training finished for {RUN_DATE}" in final
    assert _manifest(tmp_path, second_date)["model"]["version"] == "2"
    assert len(reads) == 2 and _kept_rdds(spark) == kept_before     # the night's own read, nothing kept

    # night 3: due again; a training that cannot build its vocabulary fails (exit 2 for `recsys train`) and the
    # night publishes with the alias holder, exit 0, its outcome naming the failure and the setting
    third_date = RUN_DATE + dt.timedelta(days=2)
    caplog.clear()
    assert _night(monkeypatch, spark, tmp_path, store, third_date, "train.min_item_count=1000000") == 0
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "recsys night" in r.getMessage()]
    assert len(warnings) == 1 and "training failed (exit 2" in warnings[0] and "train.min_item_count" in warnings[0]
    final = caplog.records[-1].getMessage()
    assert final.startswith("recsys night finished with exit code 0") and "training failed (exit 2" in final
    assert _manifest(tmp_path, third_date)["model"]["version"] == "2" == _alias_holder(store)
    assert jobkit.errors_logged(caplog) == []       # the night succeeded: no ERROR line for the operator to chase
    assert len(reads) == 3 and _kept_rdds(spark) == kept_before     # the failed training's read served the night
    # and beside the night in MLflow and `recsys runs` (its training failed before opening a run of its own)
    rows = _runs(tmp_path, store)
    assert [r["date"] for r in rows] == [str(third_date), str(second_date), str(RUN_DATE)]
    why = rows[0]["training_failed"]
    assert "training failed (exit 2" in why and "train.min_item_count" in why
    assert rows[1]["training_failed"] is None and rows[2]["training_failed"] is None
    assert "training failed (exit 2" in _runs_table(rows).splitlines()[1]


@SLOW
def test_a_night_whose_training_process_dies_publishes_with_the_alias_holder_on_its_retry(
        spark, tmp_path, monkeypatch, caplog):
    """A training that takes its process down (here SIGKILL once its MLflow run is open, as the kernel's
    out-of-memory killer would) cannot report itself: the scheduler retries the night, and the retry must publish
    with the alias holder rather than die in the same training again, night after night."""
    import os
    import sys
    from pathlib import Path

    import storekit
    from mlflow import MlflowClient

    jobkit.write_dataset(tmp_path)
    store = jobkit.make_store(tmp_path / "store")
    args = jobkit.recommend_args(tmp_path, store, *TRAINING)
    repo = Path(__file__).resolve().parent.parent
    env = jobkit.own_session_env("RECSYS_FAULT_INJECTION", PYTHONPATH=str(repo), PYSPARK_PYTHON=sys.executable,
                                 RECSYS_SHUFFLE_PARTITIONS="4")
    storekit.kill_at([sys.executable, "-m", "recsys.cli", "night", "--date", str(RUN_DATE), *args], "fitting", env,
                     timeout_s=300)
    marks = list((tmp_path / "work" / "night-training").rglob(f"{RUN_DATE}.json"))
    assert len(marks) == 1                                         # what the dead attempt left behind
    client = MlflowClient(store.tracking_uri)
    experiment_ids = [e.experiment_id for e in client.search_experiments()]
    dead = [r for r in client.search_runs(experiment_ids) if r.info.status == "RUNNING"]
    assert len(dead) == 1                                          # its training run, cut off

    # the retry: still due (nothing finished), but not tried again; the lists come from the holder, exit 0
    caplog.set_level(logging.INFO, logger="recsys")
    assert _night(monkeypatch, spark, tmp_path, store, RUN_DATE) == 0
    final = caplog.records[-1].getMessage()
    assert final.startswith("recsys night finished with exit code 0")
    assert "training not tried again: an earlier attempt of this night (process" in final
    assert "died before its training ended" in final
    assert _manifest(tmp_path, RUN_DATE)["model"]["version"] == store.version == _alias_holder(store)
    assert not marks[0].exists()                  # one retry without training: a later rerun of the date trains
    assert "died before its training ended" in _runs(tmp_path, store)[0]["training_failed"]
    killed = client.get_run(dead[0].info.run_id)   # the dead training's run no longer claims to be running
    assert killed.info.status == "KILLED" and killed.data.tags["recsys.status"] == "killed"
    assert "died before its training ended" in killed.data.tags["recsys.error"]
    assert f"ended the dead training's MLflow run {killed.info.run_id} as KILLED" in caplog.text


@SLOW
def test_recsys_train_refuses_while_the_date_trains_and_ends_a_dead_trainings_run(spark, tmp_path, monkeypatch,
                                                                                    caplog):
    """``recsys train`` (by hand, or a scheduler's training task) takes the night's training mark: while another
    process trains the date it exits 4 and trains nothing (two trainings of one date would both register); after
    one that died (its mark left, its MLflow run RUNNING) it ends that run as KILLED, saying why, and trains."""
    from mlflow import MlflowClient

    from recsys.pipelines.night import TrainingAttempt
    from recsys.processes import process_start_time
    from recsys.tracking import store as tracking
    from recsys.tracking import tags

    jobkit.write_dataset(tmp_path)
    store = jobkit.make_store(tmp_path / "store")
    cfg = jobkit.config(tmp_path, store, *TRAINING)
    attempt = TrainingAttempt.of(cfg, RUN_DATE)
    mark = tmp_path / "work" / "night-training" / store.model_name / f"{RUN_DATE}.json"
    train = ["train", "--date", str(RUN_DATE), *jobkit.recommend_args(tmp_path, store, *TRAINING)]
    client = MlflowClient(tracking_uri=store.tracking_uri, registry_uri=store.tracking_uri)
    caplog.set_level(logging.INFO, logger="recsys")

    blocked = tmp_path / "a-file"       # a paths.work that cannot hold the mark: one line naming it, exit 2
    blocked.write_text("")
    assert jobkit.cli(monkeypatch, spark, [*train, "--set", f"paths.work={blocked / 'work'}"]) == 2
    assert any("cannot write the training's mark under paths.work=" in m for m in jobkit.errors_logged(caplog))

    attempt.start()                                    # a live training of the date: this process
    assert mark.exists()
    assert jobkit.cli(monkeypatch, spark, train) == 4
    refused = [m for m in jobkit.errors_logged(caplog) if f"not training {RUN_DATE}" in m]
    assert len(refused) == 1 and "is still running" in refused[0]
    assert mark.exists() and _alias_holder(store) == store.version       # its mark kept, nothing trained

    # a dead one: the mark names this pid with another start time (a process that reused the pid), and the
    # training run it left RUNNING, as a SIGKILL leaves them (tests/test_night.py's dying night does it for real)
    left = json.loads(mark.read_text())
    mark.write_text(json.dumps({**left, "pid_started": process_start_time() - 1000}))
    experiment_id = tracking.setup(cfg.mlflow, tracking.training_experiment(cfg.mlflow))   # as training opens it
    dead_run = client.create_run(experiment_id, tags={tags.JOB: tags.TRAIN_JOB, tags.DATE: str(RUN_DATE),
                                                      tags.MODEL_NAME: store.model_name}).info.run_id
    caplog.clear()
    assert jobkit.cli(monkeypatch, spark, train) == 0
    assert "died before its training ended; training again" in caplog.text
    assert f"ended the dead training's MLflow run {dead_run} as KILLED" in caplog.text
    killed = client.get_run(dead_run)
    assert killed.info.status == "KILLED" and killed.data.tags["recsys.status"] == "killed"
    assert "died before its training ended" in killed.data.tags["recsys.error"]
    assert not mark.exists()                                              # its own mark ended with it
    assert _alias_holder(store) != store.version                          # it trained, and the gate moved the alias


@SLOW
def test_the_night_exits_with_the_nightly_jobs_code_when_its_lists_cannot_be_made(spark, tmp_path, monkeypatch, caplog):
    """Bad input for the date (no events in its window): training fails, so does the night, with exit 2."""
    jobkit.write_dataset(tmp_path)
    store = jobkit.make_store(tmp_path / "store")
    late = dt.date(2024, 6, 20)                    # no events in the 30-day window before it
    assert _night(monkeypatch, spark, tmp_path, store, late) == 2
    assert any("no events between" in m for m in jobkit.errors_logged(caplog))
    assert not (tmp_path / "recommendations" / f"dt={late}").exists()
    assert _alias_holder(store) == store.version   # nothing trained, nothing moved


def test_night_result_exit_code_is_the_nightly_jobs():
    from recsys.errors import ExitCode
    from recsys.pipelines.night import NightResult
    from recsys.pipelines.nightly import NightlyResult

    fields = {f.name for f in dataclasses.fields(NightResult)}
    assert {"training", "training_note", "training_failed", "nightly"} <= fields
    nightly = NightlyResult(date=RUN_DATE, run_id=None, output_dir="x", manifest=jobkit.night_manifest("r", "1"),
                            exit_code=ExitCode.TRACKING_FAILED)
    night = NightResult(training=None, training_note="training failed", training_failed=True,
                        nightly=nightly)
    assert night.exit_code == ExitCode.TRACKING_FAILED


def test_a_training_mark_says_whether_its_process_runs_here_died_here_or_ran_elsewhere(tmp_path):
    """What the retry reads from an earlier attempt's mark: this host's live process (training now: the mark stays),
    this host's dead one, another host's (a retry in a new driver pod: most likely dead), an unreadable mark."""
    import os
    import socket

    import pyarrow.fs as pafs

    from recsys.pipelines.night import EarlierAttempt, TrainingAttempt
    from recsys.processes import process_start_time

    attempt = TrainingAttempt(pafs.LocalFileSystem(), str(tmp_path / "night-training" / "m" / "2024-05-08.json"),
                              str(tmp_path))
    assert attempt.left_by_another() is None
    attempt.start()                                          # this process: alive
    earlier = attempt.left_by_another()
    why, running = earlier.why, earlier.running
    assert running and f"process {os.getpid()} on {socket.gethostname()}" in why and "is still running" in why

    mark = json.loads((tmp_path / "night-training" / "m" / "2024-05-08.json").read_text())
    assert earlier.started_at == dt.datetime.fromisoformat(mark["started_at"])   # when the dead run's search starts
    assert mark["pid_started"] == process_start_time()
    for changes, says in (({"pid_started": mark["pid_started"] - 3600}, "died before its training ended"),
                          ({"host": "another-host"}, "on another host")):
        (tmp_path / "night-training" / "m" / "2024-05-08.json").write_text(json.dumps({**mark, **changes}))
        earlier = attempt.left_by_another()
        assert not earlier.running and says in earlier.why
    (tmp_path / "night-training" / "m" / "2024-05-08.json").write_text("{not json")
    assert attempt.left_by_another() == EarlierAttempt("an earlier attempt of this night (an unreadable mark) did "
                                                       "not end its training", False, None)
    attempt.end()
    assert attempt.left_by_another() is None and not (tmp_path / "night-training" / "m" / "2024-05-08.json").exists()
