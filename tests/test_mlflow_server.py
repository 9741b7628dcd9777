"""Train and the nightly job against a real ``mlflow server`` over HTTP, and the server going away mid-run.

The server runs on loopback on a free port with its own sqlite backend store and a proxied
artifact store (``--artifacts-destination``: clients upload and download artifacts through the
server, as with a remote team server). The module trains (registers a version, moves the alias),
runs the job (resolves the alias and downloads the model over HTTP, records the run), stops the
server while a job is held at a pause point (exit code 5: published, not recorded), restarts it,
and checks the next run records normally and ``recsys runs`` tells the three apart.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import jobkit
from jobkit import N_USERS, RUN_DATE
from recsys.errors import ExitCode
from recsys.processes import free_port

pytestmark = [pytest.mark.spark, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
PART = f"dt={RUN_DATE}"


class MlflowServer:
    """``mlflow server`` on 127.0.0.1: started, stopped and restarted on the same port and stores."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> None:
        self.log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            # MLflow 3 servers also start a job runner with a dozen huey worker processes (GenAI judges and
            # such): nothing the job uses, and on a 2-core CI machine a real cost
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}: "
                                   f"{(self.root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)   # polling a condition with a deadline, not waiting for time to pass
        raise RuntimeError(f"mlflow server did not answer on {self.uri} within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)     # the server and its uvicorn worker
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.proc = None
        self.log.close()


@pytest.fixture(scope="module")
def served(spark, tmp_path_factory):
    """A running server, a dataset, a config pointing at the server over HTTP, and a trained, aliased version."""
    from recsys.config import load_config
    from recsys.pipelines.train import run_training

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        root = tmp_path_factory.mktemp("served")
        data = jobkit.write_dataset(root)
        store = jobkit.Store(root, server.uri, "recsys-served", "", root)
        overrides = jobkit.overrides(root, store, "mlflow.artifact_location=null", "progress.interval_s=0") + [
            "train.epochs=1", "train.model.sasrec.dim=8", "train.model.sasrec.layers=1", "train.model.sasrec.heads=1",
            "train.model.sasrec.max_len=8"]
        cfg = load_config(overrides=overrides)
        trained = run_training(spark, cfg, RUN_DATE)
        yield server, root, data, overrides, trained
    finally:
        server.stop()


def _client(server):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)


def _set_args(overrides: list[str]) -> list[str]:
    return [a for item in overrides for a in ("--set", item)]


def test_training_registers_over_http_and_moves_the_alias(served):
    server, _, _, _, trained = served
    mv = _client(server).get_model_version_by_alias("recsys-served", "champion")
    assert str(mv.version) == trained.version == "1"
    assert mv.source.startswith("mlflow-artifacts:/")           # proxied: the files live behind the server
    assert mv.run_id == trained.run_id
    run = _client(server).get_run(trained.run_id)         # what the UI shows on the training run's page
    assert run.data.tags["mlflow.note.content"].startswith(f"Trained sasrec on the events before {RUN_DATE}")
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["events 2024-05-01..2024-05-07"]
    experiment = _client(server).get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"   # not opened as GenAI


def test_the_nightly_job_resolves_over_http_and_records_everything(served, spark, monkeypatch, capsys):
    server, root, _, overrides, trained = served
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE), *_set_args(overrides)])
    assert code == ExitCode.OK
    manifest = json.loads((root / "recommendations" / PART / "_manifest.json").read_text())
    assert manifest["model"]["version"] == trained.version and manifest["model"]["resolution"] == "registry"
    assert manifest["tracking"]["error"] is None and manifest["tracking"]["uri"] == server.uri

    client = _client(server)
    run = client.get_run(manifest["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["model_version"] == trained.version and run.data.params["date"] == str(RUN_DATE)
    assert run.data.metrics["users_scored"] == N_USERS and run.data.metrics["stage_score_s"] > 0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | \
        {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"manifest.json", "config.yaml", "plots/score_distribution.png", "plots/popularity_long_tail.png"} <= artifacts
    stored = json.loads(Path(client.download_artifacts(run.info.run_id, "manifest.json", str(root))).read_text())
    assert stored["run_id"] == run.info.run_id
    # what makes the run readable on its own: the note, the inputs, the model version's link back
    assert run.data.tags["mlflow.note.content"].startswith(f"Published recommendations for {RUN_DATE}: {N_USERS} users")
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"events 2024-05-01..2024-05-07", "catalog 2024-05-01"}
    assert all(len(d.dataset.digest) == 16 for d in inputs.values())
    mv = client.get_model_version("recsys-served", trained.version)
    assert mv.tags[f"recsys.used_by.{RUN_DATE}"] == run.info.run_id


def _held_job(root: Path, overrides: list[str], point: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RECSYS_PAUSE_AT": point, "RECSYS_PAUSE_MAX_S": "300",
           "RECSYS_SHUFFLE_PARTITIONS": "4", "PYSPARK_PYTHON": sys.executable}
    argv = [sys.executable, "-m", "recsys.cli", "recommend", "--date", str(RUN_DATE), "--force",
            *_set_args(overrides + ["spark.master=local[2]", "spark.conf.spark.ui.enabled=false"])]
    return subprocess.Popen(argv, env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, errors="replace")


def test_the_server_stopped_mid_run_gives_exit_5_and_a_restarted_server_records_the_next_run(
        served, spark, monkeypatch, capsys):
    server, root, _, overrides, trained = served
    proc = _held_job(root, overrides, "staged")
    stderr: list[str] = []
    try:
        for line in proc.stderr:          # the run has started its MLflow run and scored; held before validating
            stderr.append(line)
            if line.startswith("recsys-pause: staged"):
                server.stop()                                   # the tracking server goes away mid-run
                os.kill(proc.pid, signal.SIGUSR1)               # and the job carries on
                break
        else:
            pytest.fail("the job ended before its pause point:\n" + "".join(stderr)[-4000:])
        stderr.extend(proc.stderr)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stderr.close()
        if server.proc is None:
            server.start()
    log = "".join(stderr)
    assert code == ExitCode.TRACKING_FAILED == 5, log[-4000:]
    manifest = json.loads((root / "recommendations" / PART / "_manifest.json").read_text())
    assert manifest["tracking"]["error"] and manifest["run_id"]           # started, then could not be finished
    assert manifest["counts"]["rows"] == N_USERS and "stage_score_s" in manifest["timings"]
    assert "recsys recommend finished with exit code 5 (published, but the MLflow run was not recorded" in log
    unrecorded = manifest["run_id"]

    # restarted (same stores): `recsys runs` shows the outage's run for what it was
    capsys.readouterr()
    assert jobkit.cli(monkeypatch, spark, ["runs", "--json", *_set_args(overrides)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert (rows[0]["run_id"], rows[0]["status"], rows[0]["exit_code"]) == (unrecorded, "published, not recorded", 5)

    # and the next run records normally
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE), "--force", *_set_args(overrides)])
    assert code == ExitCode.OK
    manifest = json.loads((root / "recommendations" / PART / "_manifest.json").read_text())
    client = _client(server)
    assert manifest["tracking"]["error"] is None
    assert client.get_run(manifest["run_id"]).info.status == "FINISHED"
    assert client.get_run(unrecorded).info.status == "RUNNING"            # what the outage left behind

    capsys.readouterr()
    assert jobkit.cli(monkeypatch, spark, ["runs", "--json", *_set_args(overrides)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["status"], r["exit_code"]) for r in rows[:2]] == [
        (manifest["run_id"], "published", 0), (unrecorded, "running", None)]
    assert rows[0]["users"] == N_USERS and rows[0]["users_per_s"] > 0 and rows[0]["stages_s"]["score"] >= 0
