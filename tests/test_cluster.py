"""The job on a real Spark standalone cluster whose executors share nothing with the driver.

A Master and two Workers (one core each) on loopback, started from the pip package's ``spark-class``.
The Workers run in a private mount namespace where the driver's checkout, its virtualenv and its
private directory (local scratch, MLflow store and artifacts) are hidden (tests/clusterkit.py), so
the recsys sources, the Python environment and the model can only reach the executors through Spark:
``--py-files``, ``--archives`` (``./spark-submit.sh --pack``) and ``addFile``. The data roots live in
a shared directory, as an object store would be. The module runs every job once (fixture ``runs``)
and each test checks one promise about the result; the cluster is stopped even when a run fails.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import clusterkit
import jvmkit
from recsys.spark import packing

# the module's fixture runs every job (a few minutes on an idle 2-core machine; much longer on a busy one)
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(3600)]

CHECKOUT = clusterkit.CHECKOUT
END = dt.date(2024, 3, 10)              # last day with events
DATE = END + dt.timedelta(days=1)       # the date trained on and recommended for
SUBMIT_TIMEOUT = 1200       # per submit: about a minute on an idle 2-core machine, far more on a loaded one


STARTED: list[subprocess.Popen] = []     # every submit, so that none outlives a fixture that failed
LOGS: Path | None = None   # each submit's command, exit code and output are kept here, for reading after a failure
# --pack's archive (about 350 MiB, 40 s to build; minutes on a busy machine) is kept between sessions and fresh
# clones: the default cache is outside the checkout and keyed by the environment's content (recsys.spark.packing)
PACK_CACHE = packing.default_cache_dir()


def _start(args: list[str], *, env: dict | None = None) -> subprocess.Popen:
    """Start a submit; its output goes to files under LOGS (a pipe nobody reads while it runs beside
    another would fill and stall it). :func:`_finish` waits for it."""
    cmd = [str(CHECKOUT / "spark-submit.sh"), *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_", "RECSYS_"))}
    full_env.update(SPARK_LOCAL_IP="127.0.0.1", RECSYS_PACK_CACHE=str(PACK_CACHE), **(env or {}))
    if "SPARK_SUBMIT_OPTS" in os.environ:     # the drivers' JVM options of every test JVM (tests/jvmkit.py)
        full_env["SPARK_SUBMIT_OPTS"] = os.environ["SPARK_SUBMIT_OPTS"]
    name = next((Path(a).stem for a in args if a.endswith(".py")), "submit")
    log = LOGS / f"{len(list(LOGS.glob('*.log'))):02d}-{name}.log"
    log.write_text(f"{cmd}\n")
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen(cmd, cwd=CHECKOUT, env=full_env, stdout=out, stderr=err, text=True,
                                start_new_session=True)
    proc.log, proc.started = log, time.monotonic()
    STARTED.append(proc)
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        clusterkit.killpg(proc, signal.SIGKILL)
        proc.wait()


def _output(proc: subprocess.Popen) -> tuple[str, str]:
    """(stdout, stderr) of a submit started by :func:`_start`, as far as it has written them."""
    return tuple(proc.log.with_suffix(suffix).read_text(errors="replace") for suffix in (".out", ".err"))


def _finish(proc: subprocess.Popen, timeout: float = SUBMIT_TIMEOUT) -> tuple[subprocess.CompletedProcess, float]:
    """Wait for a submit started by :func:`_start`: (its result, seconds from start to exit)."""
    try:
        proc.wait(timeout=timeout)
    finally:
        _kill(proc)
    seconds = time.monotonic() - proc.started
    done = subprocess.CompletedProcess(proc.args, proc.returncode, *_output(proc))
    with proc.log.open("a") as log:
        log.write(f"exit {done.returncode} after {seconds:.1f}s (output: .out and .err beside)\n")
    return done, seconds


def _submit(args: list[str], *, env: dict | None = None, timeout: float = SUBMIT_TIMEOUT):
    return _finish(_start(args, env=env), timeout)


@contextlib.contextmanager
def _none_left_running():
    """Kill whatever submit is still running when the block ends (a fixture that failed midway)."""
    try:
        yield
    finally:
        for proc in STARTED:
            _kill(proc)


def _sets(items: list[str]) -> list[str]:
    out = []
    for item in items:
        out += ["--set", item]
    return out


def _published(output: Path) -> dict[int, list[int]]:
    rows = pq.read_table(output / f"dt={DATE}").to_pylist()
    return {r["user_id"]: [x["item_id"] for x in r["recommendations"]] for r in rows}


def _error_lines(stderr: str) -> list[str]:
    """The job's own error lines (its log format: ``TIME ERROR recsys.<module>: ...``) and the launcher's."""
    return [line for line in stderr.splitlines()
            if re.search(r" ERROR recsys[.:]", line) or line.startswith(("spark-submit.sh:", "recsys pack:"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not clusterkit.namespaces_work():
        pytest.skip("needs mount namespaces (unshare -m: root, or unprivileged user namespaces) to hide the "
                    "driver's files from the Workers")
    global LOGS
    root = tmp_path_factory.mktemp("cluster")
    LOGS = root / "logs"
    LOGS.mkdir()
    shared, private = root / "shared", root / "driver-private"
    read_only = shared / "read-only-for-executors"
    for d in (shared, private, read_only):
        d.mkdir(parents=True)
    secret = private / "driver-only.txt"
    secret.write_text("the executors must not read this")
    data = shared / "data"
    subprocess.run([sys.executable, "-m", "recsys.cli", "sample-data", "--out", str(data), "--users", "200",
                    "--items", "60", "--days", "10", "--end-date", str(END)], cwd=root, check=True,
                   capture_output=True, timeout=300)
    # every path in the test's directories: the jobs run from the checkout (relative job files), whose
    # .recsys/ the embedded defaults would write into; each nightly run sets its own paths.output below
    base = [f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}",
            f"paths.output={shared / 'out'}", f"paths.work={shared / 'work'}",
            f"paths.driver_scratch={private / 'scratch'}",
            f"mlflow.tracking_uri=sqlite:///{private / 'mlflow.db'}", f"mlflow.artifact_location={private / 'artifacts'}",
            "history.window_days=60", "scoring.top_n=10", "scoring.chunk_size=64", "scoring.device=cpu",
            "train.epochs=1", "train.model.sasrec.dim=16", "train.model.sasrec.layers=1",
            "train.model.sasrec.heads=1", "train.model.sasrec.max_len=10",
            # each run has its own output root, and a table belongs to one: the cluster runs publish the paths
            # (the table is tested in test_output_table and test_nightly_job)
            "output.table=null", f"output.metastore.dir={private / 'metastore'}"]
    # Jobs start only once both executors have registered (all 2 cores): otherwise a fast job (the
    # probe) can run every task on the executor that unpacked its environment first, and the
    # "both executors answered" check fails for a reason that is not the one it tests.
    spark_conf = ["--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.memory=1g",
                  "--conf", "spark.executor.memory=1g", "--conf", "spark.task.maxFailures=4",
                  "--conf", "spark.cores.max=2", "--conf", "spark.scheduler.minRegisteredResourcesRatio=1.0",
                  "--conf", "spark.scheduler.maxRegisteredResourcesWaitingTime=120s",
                  "--conf", f"spark.executor.extraJavaOptions={jvmkit.C1_ONLY}"]     # as every test JVM (tests/jvmkit.py)
    out: dict = {"root": root, "shared": shared, "private": private, "secret": secret, "times": {}}
    hidden = [CHECKOUT, Path(sys.prefix), private]
    with clusterkit.start(root / "cluster", hidden=hidden, read_only=[read_only], fake_gpus=True) as cluster, \
            _none_left_running():
        out["cluster"] = cluster
        master = ["--master", cluster.url, *spark_conf]

        # what the Workers' mount namespace (so every executor and Python worker) can read of the driver's files
        out["readable"] = [{str(p): worker.can_read(p) for p in (CHECKOUT / "pyproject.toml", CHECKOUT,
                                                                  Path(sys.prefix) / "pyvenv.cfg", secret,
                                                                  private / "scratch", data / "events")}
                           for worker in cluster.workers]

        # The local-mode runs, what the cluster's are compared with, run beside the cluster's: each in a store of its
        # own (sqlite admits one writer at a time), so the two never wait on each other's MLflow writes.
        # Training data-parallel in local mode, under a model name of its own, beside the cluster's:
        dp_sets = base + ["train.processes=2", "train.refit=false"]
        local_dp = _start(
            ["--master", "local[2]", "--conf", "spark.driver.memory=1g", "jobs/train.py", "--date", str(DATE),
             *_sets(dp_sets + ["mlflow.model_name=recsys-dp-local", f"paths.work={shared / 'work-local'}",
                               f"paths.driver_scratch={private / 'scratch-local'}",
                               f"mlflow.tracking_uri=sqlite:///{private / 'mlflow-local.db'}",
                               f"mlflow.artifact_location={private / 'artifacts-local'}"])])

        # training data-parallel: two processes started by TorchDistributor on the two executors (a barrier
        # stage), each reading its own shards from the shared work directory; the version it registers is the
        # one the nightly runs below score with. The local one above is what its validation NDCG is compared with.
        train, out["times"]["train_2_processes"] = _submit(["--pack", *master, "jobs/train.py", "--date", str(DATE),
                                                            *_sets(dp_sets)])
        out["train"] = train
        out["local_dp_train"], out["times"]["train_2_processes_local"] = _finish(local_dp)
        assert train.returncode == 0, train.stderr[-4000:]     # the nightly runs would only repeat the failure

        # the night in local mode, beside the cluster's, scoring with the version the cluster training registered:
        # from a copy of the store as the training left it, with its artifacts where they are
        shutil.copy(private / "mlflow.db", private / "mlflow-local-night.db")
        local_night = _start(
            ["--master", "local[2]", "--conf", "spark.driver.memory=1g", "jobs/nightly_recommendations.py",
             "--date", str(DATE),
             *_sets(base + [f"paths.output={shared / 'out-local'}", f"paths.work={shared / 'work-local'}",
                            f"paths.driver_scratch={private / 'scratch-local'}",
                            f"mlflow.tracking_uri=sqlite:///{private / 'mlflow-local-night.db'}",
                            "scoring.partitions=4"])])
        # this run asks for Spark's GPU scheduling (each Worker offers one fake GPU; scoring stays on the CPU)
        cluster_run, out["times"]["cluster"] = _submit(
            ["--pack", *master, "--conf", "spark.executor.resource.gpu.amount=1",
             "--conf", "spark.task.resource.gpu.amount=1", "jobs/nightly_recommendations.py", "--date", str(DATE),
             *_sets(base + [f"paths.output={shared / 'out-cluster'}", "scoring.partitions=4"])])
        out["cluster_run"] = cluster_run
        out["local_run"], out["times"]["local"] = _finish(local_night)
        assert cluster_run.returncode == 0, cluster_run.stderr[-4000:]   # the rest would only repeat the failure

        # bad input at the cluster edge: each must end quickly, in one line, with its exit code
        edge = {}
        # (no --pack: the job must stop at its write check, before any Python runs on an executor)
        edge["unwritable_work"] = _submit(
            [*master, "jobs/nightly_recommendations.py", "--date", str(DATE),
             *_sets(base + [f"paths.output={shared / 'out-unwritable'}", f"paths.work={read_only / 'work'}"])])
        edge["unreachable_master"] = _submit(
            ["--pack", "--master", f"spark://127.0.0.1:{clusterkit.free_port()}", "jobs/nightly_recommendations.py",
             "--date", str(DATE), *_sets(base + [f"paths.output={shared / 'out-edge'}"])])
        edge["missing_archive"] = _submit(
            [f"--pack={root / 'no-such-env.tar.gz'}", *master, "jobs/nightly_recommendations.py", "--date",
             str(DATE), *_sets(base + [f"paths.output={shared / 'out-edge'}"])])
        corrupt = root / "corrupt-env.tar.gz"
        corrupt.write_bytes(b"\x1f\x8b\x08\x00" + os.urandom(4096))
        edge["corrupt_archive"] = _submit(
            [f"--pack={corrupt}", *master, "jobs/nightly_recommendations.py", "--date", str(DATE),
             *_sets(base + [f"paths.output={shared / 'out-edge'}"])])
        out["edge"] = edge

        # one Worker is SIGKILLed while it scores: the job holds the first scoring task's first attempt
        # after its first rows went to the writer (RECSYS_PAUSE_AT=writing, recsys.hooks), the test finds the executor
        # that printed the pause line and kills its whole Worker; the task is retried on the other one.
        proc = _start(["--pack", *master, "jobs/nightly_recommendations.py", "--date", str(DATE),
                       *_sets(base + [f"paths.output={shared / 'out-killed'}", "scoring.partitions=0"])],
                      env={"RECSYS_PAUSE_AT": "writing", "RECSYS_PAUSE_MAX_S": "300"})
        victim = _wait_for_pause(cluster, proc, deadline=time.monotonic() + SUBMIT_TIMEOUT)
        cluster.kill_worker(victim)
        out["killed_run"], out["times"]["killed"] = _finish(proc)
    return out


def _wait_for_pause(cluster: clusterkit.Cluster, proc: subprocess.Popen, deadline: float) -> clusterkit.Worker:
    """The Worker whose executor printed ``recsys-pause: writing`` (polled, with a deadline)."""
    while time.monotonic() < deadline:
        for worker in cluster.workers:
            if any("recsys-pause: writing" in log.read_text(errors="replace") for log in worker.executor_logs()):
                return worker
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before pausing in a scoring task: "
                                 f"{_output(proc)[1][-4000:]}")
        time.sleep(0.2)
    raise AssertionError("no scoring task paused before the deadline")


def _manifest(output: Path) -> dict:
    return json.loads((output / f"dt={DATE}" / "_manifest.json").read_text())


def test_no_executor_can_read_the_driver_checkout_venv_or_scratch_and_each_gets_the_code_through_spark(runs):
    """The Workers' mount namespace, which every executor and Python worker inherits, hides the driver's files
    and still reads the shared data; so the code and its Python can only have come through Spark: each executor
    of a ``--pack`` application holds the shipped environment and the sources (``--py-files``) in its own
    directory. That the executors' Python workers ran that environment's interpreter is the manifest's to say
    (the test below)."""
    for readable in runs["readable"]:
        shared = {p: seen for p, seen in readable.items() if p.startswith(str(runs["shared"]))}
        assert shared and all(shared.values()), readable                  # the control: a readable path reads
        assert not any(seen for p, seen in readable.items() if p not in shared), readable
    assert runs["secret"].read_text()                                     # while the driver reads them fine
    for worker in runs["cluster"].workers:
        shipped = [d for d in worker.work_dir.glob("app-*/*") if (d / "environment" / "bin" / "python").exists()]
        assert len(shipped) == 3, worker.work_dir       # training, the night and the killed night, each on every Worker
        assert all((d / "recsys.zip").is_file() for d in shipped), shipped


def test_train_and_recommend_exit_0_on_the_cluster(runs):
    assert runs["train"].returncode == 0, runs["train"].stderr[-4000:]
    assert runs["cluster_run"].returncode == 0, runs["cluster_run"].stderr[-4000:]
    assert runs["local_run"].returncode == 0, runs["local_run"].stderr[-4000:]


def test_the_cluster_publishes_what_local_mode_publishes(runs):
    cluster = _published(runs["shared"] / "out-cluster")
    local = _published(runs["shared"] / "out-local")
    assert len(cluster) > 100
    assert cluster == local          # same users, same items in the same order


def test_every_executor_python_worker_loaded_the_model_once_from_the_shipped_environment_with_its_gpu(runs):
    manifest = _manifest(runs["shared"] / "out-cluster")
    workers = manifest["workers"]
    assert len(workers) == 2 and sum(w["tasks"] for w in workers) == manifest["metrics"]["tasks"] >= 2
    assert all(w["model_misses"] == 1 for w in workers), workers
    assert manifest["metrics"]["model_loads_per_worker_max"] == 1
    for w in workers:
        assert "/environment/bin/python" in w["python"] and not w["python"].startswith(str(CHECKOUT)), w
    assert sorted(w["gpus"] for w in workers) == ["0", "1"]          # the GPU Spark assigned to each task
    local = _manifest(runs["shared"] / "out-local")
    assert all(w["python"] == sys.executable or w["python"].startswith(sys.prefix) for w in local["workers"])


def test_a_worker_killed_while_scoring_still_gives_a_complete_identical_partition(runs):
    killed = runs["killed_run"]
    assert killed.returncode == 0, killed.stderr[-4000:]
    assert sum(w.killed for w in runs["cluster"].workers) == 1
    assert _published(runs["shared"] / "out-killed") == _published(runs["shared"] / "out-cluster")
    manifest = _manifest(runs["shared"] / "out-killed")
    assert manifest["metrics"]["task_retries"] >= 1                  # the killed task, retried and counted
    assert manifest["counts"]["rows"] == len(_published(runs["shared"] / "out-cluster"))


@pytest.mark.parametrize("case, code, says", [
    ("unwritable_work", 2, "the executors cannot write under paths.work"),
    ("unreachable_master", 1, "cannot reach the Spark master"),
    ("missing_archive", 2, "does not exist"),
    ("corrupt_archive", 2, "is not a readable tar archive"),
])
def test_bad_input_at_the_cluster_edge_fails_fast_in_one_line_and_publishes_nothing(runs, case, code, says):
    done, seconds = runs["edge"][case]
    assert done.returncode == code, done.stderr[-4000:]
    lines = _error_lines(done.stdout + done.stderr)      # the job logs to stdout, the launcher to stderr
    assert len(lines) == 1 and says in lines[0], (done.stdout + done.stderr)[-4000:]
    assert "Traceback" not in done.stderr
    assert seconds < (180 if case == "unwritable_work" else 30)
    for name in ("out-unwritable", "out-edge"):
        assert not list((runs["shared"] / name).glob("dt=*"))


def test_training_runs_data_parallel_on_the_executors(runs):
    """Two training processes on the two executors (TorchDistributor, gloo), each reading its own shards:
    the version is registered and gated as a single-process one, and the same run in local mode agrees."""
    dp, local = runs["train"], runs["local_dp_train"]
    assert dp.returncode == 0, dp.stderr[-4000:]
    assert local.returncode == 0, local.stderr[-4000:]
    assert "Started distributed training with 2 executor processes" in dp.stderr + dp.stdout
    assert "2 process(es), " in dp.stdout + dp.stderr
    score = {name: float(re.search(r"val_ndcg@10=([0-9.]+)", run.stdout).group(1)) for name, run in
             (("cluster", dp), ("local", local))}
    assert abs(score["cluster"] - score["local"]) < 0.05, score
    print(f"training with 2 processes: cluster {runs['times']['train_2_processes']:.0f}s, local mode "
          f"{runs['times']['train_2_processes_local']:.0f}s; val_ndcg@10 {score}")
