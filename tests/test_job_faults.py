"""Faults during a run: failed and crashed tasks, a SIGKILL mid-write, an unreachable MLflow, bad output.

One published run of the module's dataset is the "previous partition" that each test copies into
its own output root; inputs are shared read-only. Everything runs on the shared Spark session
except the SIGKILL test, which needs a process of its own to kill.
"""
import datetime as dt
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pyarrow.parquet as pq
import pytest

import jobkit
from jobkit import N_USERS, RUN_DATE
from recsys.errors import ExitCode
from recsys.processes import free_port   # nothing listens there: an unreachable server

pytestmark = [pytest.mark.spark, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
PART = f"dt={RUN_DATE}"


@pytest.fixture(scope="module")
def base(spark, tmp_path_factory):
    from recsys.pipelines.nightly import run_nightly

    store = jobkit.make_store(tmp_path_factory.mktemp("store"))
    data = jobkit.write_dataset(tmp_path_factory.mktemp("data"))
    result = run_nightly(spark, jobkit.config(data, store), RUN_DATE)
    return SimpleNamespace(store=store, data=data, result=result, partition=data / "recommendations" / PART)


def _with_old_partition(base, root: Path) -> dict[str, bytes]:
    """Copy the module's published partition into ``root``'s output; returns its snapshot."""
    shutil.copytree(base.partition, root / "recommendations" / PART)
    return jobkit.snapshot(root / "recommendations" / PART)


def _users(partition: Path) -> list[int]:
    return sorted(pq.read_table(partition, columns=["user_id"]).column("user_id").to_pylist())


@pytest.mark.parametrize("fault", ["fail_first_attempt", "kill_worker_first_attempt"])
def test_a_task_that_fails_or_loses_its_python_worker_is_retried_and_the_output_is_complete(
        spark, base, tmp_path, monkeypatch, fault):
    from recsys.hooks import Hooks
    from recsys.pipelines.nightly import run_nightly

    result = run_nightly(spark, jobkit.config(tmp_path, base.store, inputs=base.data), RUN_DATE,
                         hooks=Hooks(faults=(fault,)))
    assert result.exit_code == ExitCode.OK
    assert _users(tmp_path / "recommendations" / PART) == list(range(1, N_USERS + 1))   # every user once
    m = result.metrics
    assert m["task_retries"] == m["tasks"] >= 4       # each task failed once, then succeeded
    # the failed attempt took its Python worker down with it, so the retry loaded the model again,
    # although this session's workers had it cached from the module's first run
    assert m["model_misses"] >= 1
    assert m["model_hits"] + m["model_misses"] == m["tasks"]
    assert result.manifest.metrics["task_retries"] == m["tasks"]


def test_a_python_worker_killed_on_every_attempt_fails_the_job_in_one_line_and_publishes_nothing(
        spark, base, tmp_path, monkeypatch, caplog):
    """A worker that a memory limit kills each time: Spark gives up on the task with the driver's JVM stack, which
    names nothing an operator can act on. The job says which process died and what to raise, in one line."""
    from mlflow import MlflowClient

    from recsys.cli.runs import list_runs

    before = _with_old_partition(base, tmp_path)
    out = tmp_path / "recommendations"
    monkeypatch.setenv("RECSYS_FAULT_INJECTION", "kill_worker_every_attempt")
    with caplog.at_level("DEBUG", logger="recsys"):
        code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE),
                                               *jobkit.recommend_args(tmp_path, base.store, inputs=base.data)])
    assert code == ExitCode.UNEXPECTED_ERROR == 1
    errors = jobkit.errors_logged(caplog)
    assert len(errors) == 1, errors
    assert re.fullmatch(r"Spark gave up on task \d+ of stage [\d.]+ after 4 attempts: a Python worker on the "
                        r"driver \(local mode\) died without an error \(killed, .*spark\.executor\.memoryOverhead.*",
                        errors[0])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]     # no traceback
    assert any(r.exc_info and "Python worker exited unexpectedly" in str(r.exc_info[1])       # kept for --verbose
               for r in caplog.records if r.levelno == logging.DEBUG)
    last = caplog.records[-1].getMessage()
    assert f"finished with exit code 1 (unexpected error, a retry may help): {errors[0]}" in last
    assert jobkit.partitions(out) == [PART] and jobkit.snapshot(out / PART) == before
    assert not (out / "_locks" / f"{PART}.lock").exists()
    # `recsys runs` and the MLflow run say the same line first (not py4j's "An error occurred while calling oNN")
    [failed] = [r for r in list_runs(jobkit.config(tmp_path, base.store, inputs=base.data), date=RUN_DATE)
                if r["status"] == "failed"]
    assert failed["error"] == errors[0][:300], failed
    tags = MlflowClient(base.store.tracking_uri).get_run(failed["run_id"]).data.tags
    assert tags["recsys.error"].splitlines()[1].startswith("An error occurred while calling")   # Spark's error below
    assert tags["mlflow.note.content"].endswith(f"nothing published: {errors[0]}")


def _recommend_paused_at_writing(base, root: Path) -> subprocess.Popen:
    """``recsys recommend`` of the module's data into ``root`` in a process of its own, its tasks holding at the
    pause point ``writing`` (which they print on stderr, relayed by the JVM)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RECSYS_PAUSE_AT": "writing", "RECSYS_PAUSE_MAX_S": "300",
           "RECSYS_SHUFFLE_PARTITIONS": "4", "PYSPARK_PYTHON": sys.executable}
    env.pop("RECSYS_FAULT_INJECTION", None)
    argv = [sys.executable, "-m", "recsys.cli", "recommend", "--date", str(RUN_DATE),
            *jobkit.recommend_args(root, base.store, "spark.master=local[2,4]", "spark.conf.spark.ui.enabled=false",
                                   inputs=base.data)]
    return subprocess.Popen(argv, env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, errors="replace")


def test_a_job_killed_while_writing_leaves_the_old_partition_and_a_rerun_succeeds(spark, base, tmp_path, caplog):
    from mlflow import MlflowClient

    from recsys.cli.runs import list_runs
    from recsys.pipelines.nightly import run_nightly

    before = _with_old_partition(base, tmp_path)
    out = tmp_path / "recommendations"
    proc = _recommend_paused_at_writing(base, tmp_path)
    tree: list[psutil.Process] = []
    try:
        for line in proc.stderr:       # the JVM relays the workers' stderr; EOF if the job dies first
            if "recsys-pause: writing" in line:
                tree = jobkit.descendants(proc.pid)          # JVM, Python daemon and workers
                os.kill(proc.pid, signal.SIGKILL)      # the job process, mid-write
                break
        else:
            pytest.fail("the job ended without reaching the pause point")
    finally:
        jobkit.kill_tree(proc, tree)                   # what is left of the job goes with its container
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    # what a reader sees now: the old partition, byte for byte, and nothing else
    assert jobkit.partitions(out) == [PART]
    assert jobkit.snapshot(out / PART) == before
    assert spark.read.parquet(str(out)).count() == N_USERS
    assert len(jobkit.runs(out)) == 2                          # the killed run's partial output, out of sight
    lock = json.loads((out / "_locks" / f"{PART}.lock").read_text())   # and its lock, whose process is gone,
    dead = lock["mlflow_run_id"]                               # naming the MLflow run it could not end
    client = MlflowClient(base.store.tracking_uri)
    assert client.get_run(dead).info.status == "RUNNING"
    assert client.get_run(dead).data.tags["recsys.job_run"] == lock["run"]

    cfg = jobkit.config(tmp_path, base.store, inputs=base.data)
    caplog.clear()
    with caplog.at_level("WARNING"):
        result = run_nightly(spark, cfg, RUN_DATE)
    assert "taking over the lock" in caplog.text and "is gone" in caplog.text
    assert "never published" in caplog.text                   # its run directory removed
    assert result.exit_code == ExitCode.OK
    # the dead run's MLflow run no longer claims to be running: KILLED, saying who found it dead and when
    killed = client.get_run(dead)
    assert killed.info.status == "KILLED" and killed.info.end_time >= killed.info.start_time
    assert killed.data.tags["recsys.found_dead_by"] == result.manifest.job_run
    found_at = dt.datetime.fromisoformat(killed.data.tags["recsys.found_dead_at"])
    assert 0 <= (dt.datetime.now(dt.timezone.utc) - found_at).total_seconds() < 600
    assert f"ended MLflow run {dead} of the dead run {lock['run']} as KILLED" in caplog.text
    rows = list_runs(cfg, date=RUN_DATE)           # what `recsys runs --date` prints, newest first
    assert [(r["run_id"], r["status"]) for r in rows[:2]] == [(result.run_id, "published"), (dead, "killed")]
    assert f"is gone; found dead by run {result.manifest.job_run}" in rows[1]["error"]
    assert not [r for r in rows if r["status"] == "running"]
    assert jobkit.snapshot(out / PART) != before
    assert json.loads((out / PART / "_manifest.json").read_text())["job_run"] == result.manifest.job_run
    assert _users(out / PART) == list(range(1, N_USERS + 1))
    assert not (out / "_locks" / f"{PART}.lock").exists()
    assert len(jobkit.runs(out)) == 2 and f"{PART}/run={result.manifest.job_run}" in jobkit.runs(out)


def test_a_job_whose_spark_jvm_is_killed_mid_write_exits_1_naming_it_and_leaves_the_old_partition(base, tmp_path):
    """The kernel's out-of-memory killer takes the JVM, not the job's Python: Python is left with a refused
    connection. The job says what happened in one line, releases its lock and publishes nothing."""
    before = _with_old_partition(base, tmp_path)
    out = tmp_path / "recommendations"
    proc = _recommend_paused_at_writing(base, tmp_path)
    tree: list[psutil.Process] = []
    jvm = None
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if jvm is None and "recsys-pause: writing" in line:
                tree = jobkit.descendants(proc.pid)          # JVM, Python daemon and workers
                jvm = next(p for p in tree if p.name() == "java")
                jvm.kill()                             # SIGKILL, as the out-of-memory killer sends it
        proc.wait(timeout=120)
    finally:
        jobkit.kill_tree(proc, tree)                   # the paused workers the JVM left behind
        proc.stderr.close()
    assert jvm is not None, "".join(lines[-20:])
    log = "".join(lines)
    said = (f"the Spark JVM (pid {jvm.pid}) was killed by signal 9: often the machine's or container's memory "
            "limit (the kernel's out-of-memory killer")
    assert proc.returncode == ExitCode.UNEXPECTED_ERROR == 1, log[-3000:]
    errors = [ln for ln in lines if " ERROR recsys" in ln]
    assert len(errors) == 1 and said in errors[0], log[-3000:]
    assert "this is a bug" not in log          # the cause, not a traceback of py4j's refused connection,
    assert "Exception while sending command" not in log     # nor py4j's own records of each refused call
    # the last record logged is the outcome (pyspark's accumulator server may still print a broken connection)
    records = [ln for ln in lines if re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d [A-Z]+ ", ln)]
    assert f"recsys recommend finished with exit code 1 (unexpected error, a retry may help): {said}" in records[-1]
    assert jobkit.partitions(out) == [PART] and jobkit.snapshot(out / PART) == before
    assert not (out / "_locks" / f"{PART}.lock").exists()     # Python lived on: it gave the date back


def test_a_jvm_that_ran_out_of_heap_is_named_with_the_setting_and_a_live_one_changes_nothing(spark, monkeypatch,
                                                                                               caplog):
    """Spark exits a JVM whose heap ran out with 52 (SparkExitCode.OOM): its process as this process's gateway
    sees it, a real process that ended so. While the JVM lives, failures are reported as before."""
    from pyspark import SparkContext

    from recsys.cli.main import run_command
    from recsys.errors import InputDataError

    def fails(exc):
        def func(args):
            raise exc
        return func

    args = SimpleNamespace()
    assert run_command(fails(InputDataError("no events")), args) == ExitCode.BAD_INPUT    # the JVM lives
    assert args.outcome == "no events"
    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(52)"])
    ended.wait(timeout=30)
    monkeypatch.setattr(SparkContext._gateway, "proc", ended)
    caplog.clear()
    with caplog.at_level("ERROR"):
        assert run_command(fails(ConnectionRefusedError(111, "Connection refused")), args) == 1
    assert args.outcome.startswith(f"the Spark JVM (pid {ended.pid}) ran out of Java heap")
    assert "--set spark.conf.spark.driver.memory=4g" in args.outcome
    assert jobkit.errors_logged(caplog) == [args.outcome]         # one line, no traceback


def test_a_jvm_still_dying_when_its_connection_is_refused_is_waited_for_and_named(spark, monkeypatch):
    """A killed process closes its sockets before its parent can see it end: py4j's refused connection can reach
    the job first. The job waits for the JVM's exit (here a process killed a moment after the error) and names it;
    another server's refused connection (an unreachable MLflow) does not wait."""
    import threading

    from py4j.protocol import Py4JNetworkError
    from pyspark import SparkContext

    from recsys.spark.failures import jvm_gone

    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(SparkContext._gateway, "proc", dying)
    killer = threading.Timer(0.3, dying.kill)
    refused = ConnectionRefusedError(111, "Connection refused")
    py4j_refused = Py4JNetworkError("An error occurred while trying to connect to the Java server", cause=refused)
    try:
        killer.start()
        assert jvm_gone(refused) is None            # not py4j's: answered at once, the process still running
        assert jvm_gone(py4j_refused) == (f"the Spark JVM (pid {dying.pid}) was killed by signal 9: often the "
                                          "machine's or container's memory limit (the kernel's out-of-memory "
                                          "killer, which its log names: dmesg)")
    finally:
        killer.cancel()
        dying.kill()
        dying.wait()
    assert jvm_gone(RuntimeError("a bug")).startswith("the Spark JVM")    # ended: named whatever the error


def test_an_unreachable_mlflow_still_publishes_with_the_remembered_model_and_exits_5(
        spark, base, tmp_path, monkeypatch, caplog, capsys):
    from recsys.tracking.last_model import recall, remember

    uri = f"http://bob:s3cret@127.0.0.1:{free_port()}/"
    # what the previous night left in paths.driver_scratch, when this server answered: the version the
    # module's run resolved, bound to this store (the memo is only used with the store it came from)
    model, why = recall(base.data / "driver", base.store.model_name, "champion", base.store.tracking_uri)
    assert why is None, why
    remember(tmp_path / "driver", model, uri)
    started = time.monotonic()
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE),
                                           *jobkit.recommend_args(tmp_path, base.store, f"mlflow.tracking_uri={uri}",
                                                                  inputs=base.data)])
    elapsed = time.monotonic() - started
    assert code == ExitCode.TRACKING_FAILED == 5
    assert elapsed < 90, f"an unreachable store must cost seconds, took {elapsed:.0f}s"
    manifest_text = (tmp_path / "recommendations" / PART / "_manifest.json").read_text()
    manifest = json.loads(manifest_text)
    assert manifest["run_id"] is None and manifest["tracking"]["error"]
    assert manifest["model"]["version"] == base.store.version
    assert manifest["model"]["resolution"].startswith("remembered")
    assert manifest["metrics"]["users_scored"] == N_USERS and "stage_score_s" in manifest["timings"]
    assert _users(tmp_path / "recommendations" / PART) == list(range(1, N_USERS + 1))
    assert "MLflow is unreachable" in caplog.text and "could not be recorded" in caplog.text
    logged = caplog.text + capsys.readouterr().err
    assert "s3cret" not in logged and "s3cret" not in manifest_text and "bob:" not in manifest_text


def test_a_model_remembered_from_another_tracking_store_is_never_published_when_mlflow_is_unreachable(
        spark, base, tmp_path, monkeypatch, caplog):
    """The sequence that once published a toy model as "version 1" with exit 5: one store's resolution is
    remembered in the driver's scratch (the module's run left it there, as tests/test_submit_log.py once
    did in the checkout), then a forced run against another, unreachable store finds it."""
    from recsys.tracking.store import tracking_store_id

    memo = next((base.data / "driver" / "models").rglob("last-resolved@champion.json"))   # its files are still there
    target = tmp_path / "driver" / memo.relative_to(base.data / "driver")
    target.parent.mkdir(parents=True)
    shutil.copy(memo, target)
    before = _with_old_partition(base, tmp_path)
    uri = f"http://127.0.0.1:{free_port()}/"
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE), "--force",
                                           *jobkit.recommend_args(tmp_path, base.store, f"mlflow.tracking_uri={uri}",
                                                                  inputs=base.data)])
    errors = jobkit.errors_logged(caplog)
    assert code == ExitCode.UNEXPECTED_ERROR == 1 and len(errors) == 1, caplog.text
    assert (f"came from the tracking store {tracking_store_id(base.store.tracking_uri)}, not this run's "
            f"{tracking_store_id(uri)}" in errors[0]), errors[0]
    assert "Retry when the tracking store is back" in errors[0] and "Traceback" not in caplog.text
    assert "scoring with the last resolved version" not in caplog.text
    out = tmp_path / "recommendations"
    assert jobkit.partitions(out) == [PART] and jobkit.snapshot(out / PART) == before   # nothing published
    assert not list(out.glob("_staging/*/*")) and not list(out.glob("_locks/*.lock"))
    assert len(jobkit.runs(out)) == 1                          # only the published run's directory


def test_an_unreachable_mlflow_without_a_remembered_model_fails_in_one_line(spark, base, tmp_path, monkeypatch,
                                                                           caplog):
    uri = f"http://127.0.0.1:{free_port()}/"
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE),
                                           *jobkit.recommend_args(tmp_path, base.store, f"mlflow.tracking_uri={uri}",
                                                                  inputs=base.data)])
    errors = jobkit.errors_logged(caplog)
    assert code == ExitCode.UNEXPECTED_ERROR and len(errors) == 1
    assert "no earlier resolution" in errors[0] and "Retry when the tracking store is back" in errors[0]
    assert "Traceback" not in caplog.text and jobkit.partitions(tmp_path / "recommendations") == []


def test_output_failing_validation_is_not_published_and_the_mlflow_run_is_failed_with_the_report(
        spark, base, tmp_path, monkeypatch, caplog):
    from mlflow import MlflowClient
    from pyspark.sql import functions as F

    from recsys.pipelines import nightly_stages as stages

    real = stages.score_histories

    def reversed_lists(histories, spec, partitions=0):   # a scoring bug: worst items first
        scored, observation = real(histories, spec, partitions)
        return scored.withColumn("recommendations", F.reverse("recommendations")), observation

    monkeypatch.setattr(stages, "score_histories", reversed_lists)
    before = _with_old_partition(base, tmp_path)
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE),
                                           *jobkit.recommend_args(tmp_path, base.store, inputs=base.data)])
    errors = jobkit.errors_logged(caplog)
    assert code == ExitCode.VALIDATION_FAILED == 3
    assert len(errors) == 1 and "validation failed for 2024-05-08, nothing published: unordered_scores=" in errors[0]
    out = tmp_path / "recommendations"
    assert jobkit.partitions(out) == [PART] and jobkit.snapshot(out / PART) == before
    assert not list(out.glob("_staging/*/*")) and not list(out.glob("_locks/*.lock"))
    assert len(jobkit.runs(out)) == 1                          # only the published run's directory

    client = MlflowClient(base.store.tracking_uri)
    experiment = client.get_experiment_by_name("recsys")
    run = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
    assert run.info.status == "FAILED" and "unordered_scores" in run.data.tags["recsys.error"]
    report_path = client.download_artifacts(run.info.run_id, "validation_report.json", str(tmp_path))
    report = json.loads(Path(report_path).read_text())
    assert report["passed"] is False and report["violations"]["unordered_scores"] > 0
