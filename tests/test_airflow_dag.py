"""The Airflow DAG in conf/schedulers/, loaded and run by a real Apache Airflow 3 (its own virtualenv).

One DAG run's night trains a model and publishes a date, and its export puts it into the session's Redis, end
to end through ``spark-submit.sh`` (the tasks' real command lines, so a DAG whose arguments stop matching
spark-submit.sh's or the job's fails here); a run for a date whose input is bad (exit code 2) ends failed
after one try, with no retry; a run whose date another run holds (exit code 4) goes up for retry, and its
night, one after the training, skips training as not due (``train.every_nights=2``). Airflow runs with its
own temporary AIRFLOW_HOME and sqlite database; ``airflow dags test`` runs the DAG in-process.

The DAG sees only the night's exit code, so what a night does inside one task is not run again here: a night
whose training fails or is refused by the gate still publishes with the alias holder and exits 0
(tests/test_night.py, tests/test_gate.py); a night whose training takes its process down publishes on its
retry (tests/test_night.py); each exit code's handling by the DAG's operators is tests/test_airflow_dag_codes.py's;
the export with no Redis configured is tests/test_export.py's.

Cost: a cold cache installs Airflow first (about 2-3 minutes, once per machine, see airflowkit);
warm, the module takes a couple of minutes (four spark-submit runs of a small dataset).
"""
import datetime as dt
import json
import sqlite3
import subprocess

import pytest
import yaml

import airflowkit
import jobkit
from jobkit import N_USERS, RUN_DATE

pytestmark = [pytest.mark.slow]
BAD_DATE = "2024-06-20"     # after the DAG's start date; no events in its 30-day window: exit code 2
DAG_ID, TASK_ID, EXPORT_TASK = "recsys_nightly", "night", "export"
EXPORT_PREFIX = "airflow"
# 24 users: the gate judges on 10 or more (the default 100 would keep the store's first version, which
# records no training date, and so is judged on all 24); any judged version moves the alias (tolerance 1)
TRAINING = ["train.epochs=2", "train.device=cpu", "train.every_nights=2", "train.model.sasrec.dim=8",
            "train.model.sasrec.layers=1", "train.model.sasrec.heads=1", "train.model.sasrec.max_len=8",
            "train.gate_min_users=10", "train.gate_tolerance=1"]


def _conf_file(path, overrides: list[str]) -> None:
    """The job's --conf YAML for these overrides (what an operator would keep in conf/production.yaml)."""
    tree: dict = {}
    for item in overrides:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(tree))


@pytest.fixture(scope="module")
def airflow(tmp_path_factory, redis_server):
    """(airflow executable, environment, workdir) with a migrated sqlite database and the repo's dags folder."""
    executable = airflowkit.ensure_airflow()
    root = tmp_path_factory.mktemp("airflow")
    store = jobkit.make_store(root / "store")
    data = jobkit.write_dataset(root / "data")
    conf = root / "recsys.yaml"
    _conf_file(conf, jobkit.overrides(data, store, "scoring.partitions=2", *TRAINING,
                                      f"export.redis_url={redis_server.url}", f"export.prefix={EXPORT_PREFIX}"))
    env = airflowkit.airflow_env(root / "home", airflowkit.REPO / "conf" / "schedulers",
                                 recsys_home=str(airflowkit.REPO), recsys_conf=str(conf),
                                 recsys_spark_master="local[2]")
    env["RECSYS_SHUFFLE_PARTITIONS"] = "4"
    subprocess.run([str(executable), "db", "migrate"], env=env, check=True, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return executable, env, root, data


def _dags_test(airflow, date: str, **variables: str) -> tuple[int | None, str]:
    """(exit code, output) of ``airflow dags test`` for ``date``; (None, output) if the task went up for retry.

    ``dags test`` waits out a retry's delay (10 minutes) in-process, so a retried task is seen in the
    output and the run is stopped there rather than waited for. ``variables``: Airflow Variables for
    this run only (e.g. ``recsys_conf``).
    """
    executable, env, root, _ = airflow
    env = {**env, **{f"AIRFLOW_VAR_{name.upper()}": value for name, value in variables.items()}}
    proc = subprocess.Popen([str(executable), "dags", "test", DAG_ID, date], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            # dags test's own loop, reading the task back from its database once the retry state is committed
            if "unrunnable tasks" in line and "[up_for_retry]" in line:
                proc.kill()                   # the task's process has ended; only the retry's wait is left
                proc.wait(timeout=60)
                return None, "".join(lines)
        return proc.wait(timeout=600), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        proc.stdout.close()


def _task_instances(airflow, date: str, task_id: str = TASK_ID) -> list[tuple[str, int]]:
    _, _, root, _ = airflow
    with sqlite3.connect(root / "home" / "airflow.db") as db:
        return db.execute(
            "select ti.state, ti.try_number from task_instance ti join dag_run r on r.run_id = ti.run_id "
            "and r.dag_id = ti.dag_id where ti.dag_id = ? and ti.task_id = ? and date(r.logical_date) = ?",
            (DAG_ID, task_id, date)).fetchall()


def _alias_holder(airflow) -> str:
    """The version holding the model alias in the test's MLflow store."""
    from mlflow import MlflowClient

    _, _, root, _ = airflow
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'store' / 'mlflow.db'}",
                          registry_uri=f"sqlite:///{root / 'store' / 'mlflow.db'}")
    return str(client.get_model_version_by_alias("recsys-test", "champion").version)


LOAD_DAG = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(sys.argv[1])
dag = bag.dags.get("recsys_nightly")
task = dag.get_task("night") if dag else None
export = dag.get_task("export") if dag else None
print("RESULT " + json.dumps({
    "import_errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": sorted(bag.dags),
    "tasks": dag and sorted(dag.task_ids),
    "max_active_runs": dag and dag.max_active_runs, "catchup": dag and dag.catchup,
    "retries": task and task.retries, "bash_command": task and task.bash_command,
    "upstream": task and sorted(task.upstream_task_ids),
    "export_upstream": export and sorted(export.upstream_task_ids), "export_command": export and export.bash_command,
    "export_trigger_rule": export and str(getattr(export.trigger_rule, "value", export.trigger_rule)),
    "export_retries": export and export.retries}))
"""


def test_the_dag_loads_without_import_errors_and_its_command_line_parses_as_the_jobs(airflow):
    import re
    import shlex

    from recsys.cli.main import build_parser

    executable, env, root, _ = airflow
    run = subprocess.run([str(executable.parent / "python"), "-c", LOAD_DAG, env["AIRFLOW__CORE__DAGS_FOLDER"]],
                         env=env, cwd=root, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    dag = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert dag["import_errors"] == {} and dag["dags"] == [DAG_ID]
    assert dag["max_active_runs"] == 1 and dag["catchup"] is True and dag["retries"] >= 1
    # the night (training when due, then the lists) is one task, one job
    assert dag["tasks"] == [EXPORT_TASK, TASK_ID] and dag["upstream"] == []
    # the export after a night that succeeded, retried like it
    assert dag["export_upstream"] == [TASK_ID] and dag["export_trigger_rule"] == "all_success"
    assert dag["export_retries"] == dag["retries"]

    # each task's command, templates filled in: spark-submit.sh's options, then a job file and its arguments
    for command, job_file, sub in ((dag["bash_command"], "jobs/night.py", "night"),
                                   (dag["export_command"], "jobs/export.py", "export")):
        argv = shlex.split(re.sub(r"\{\{[^}]*\}\}", lambda m: "2024-05-08" if "ds" == m.group(0)[2:-2].strip() else "X",
                                  command))
        assert argv[0] == "./spark-submit.sh" and (airflowkit.REPO / "spark-submit.sh").is_file()
        job = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        assert argv[1:job] == ["--master", "X"] and (airflowkit.REPO / argv[job]).is_file()
        assert argv[job] == job_file
        args = build_parser().parse_args([sub, *argv[job + 1:]])      # exits 2 on an unknown argument
        assert str(args.date) == "2024-05-08" and args.conf == "X"
        if sub == "export":
            assert args.if_configured                                  # a config without Redis: nothing to do
        else:
            assert not args.force                                      # a retry never recomputes a published date


def test_one_dag_run_trains_publishes_and_exports_the_date_through_spark_submit(airflow, redis_server):
    _, _, _, data = airflow
    code, log = _dags_test(airflow, str(RUN_DATE))
    assert code == 0, log[-6000:]
    assert "recsys night finished with exit code 0" in log and "trained model version 2" in log
    assert _alias_holder(airflow) == "2"          # judged on all 24 users (the first version has no date)
    partition = data / "recommendations" / f"dt={RUN_DATE}"
    manifest = json.loads((partition / "_manifest.json").read_text())
    assert manifest["date"] == str(RUN_DATE) and manifest["counts"]["rows"] == N_USERS
    assert manifest["model"]["version"] == _alias_holder(airflow)   # scored with what the training left at the alias
    assert (partition / "_SUCCESS").is_file()
    assert f"--date {RUN_DATE}" in log                      # the logical date reached the job as --date
    assert _task_instances(airflow, str(RUN_DATE)) == [("success", 1)]
    # and the export: a version of the date in Redis, the pointer switched to it
    import redis

    from recsys.export import redis_store

    assert "recsys export finished with exit code 0" in log
    pointer = redis_store.read_pointer(redis.Redis.from_url(redis_server.url), redis_store.Keyspace(EXPORT_PREFIX))
    assert (pointer.date, pointer.run, pointer.users) == (RUN_DATE, manifest["job_run"], N_USERS)
    assert _task_instances(airflow, str(RUN_DATE), EXPORT_TASK) == [("success", 1)]


def test_a_run_on_bad_input_fails_at_once_without_a_retry(airflow):
    code, log = _dags_test(airflow, BAD_DATE)
    assert code is not None, "exit code 2 was retried:\n" + log[-4000:]
    assert code != 0
    assert "recsys exited with code 2, not retried" in log, log[-6000:]
    assert "finished with exit code 2" in log and "no events between" in log   # the job's reason, not a usage error
    assert _task_instances(airflow, BAD_DATE) == [("failed", 1)]
    assert [s for s, _ in _task_instances(airflow, BAD_DATE, EXPORT_TASK)] == ["upstream_failed"]   # nothing to export


def test_a_run_whose_date_is_locked_by_another_run_is_retried(airflow):
    from recsys.publish.lock import DateLock

    _, _, _, data = airflow
    with DateLock(str(data / "recommendations"), dt.date(2024, 5, 9), "another-run"):   # a live holder: this process
        code, log = _dags_test(airflow, "2024-05-09")
    assert code is None, f"exit code 4 was not retried (airflow exited {code}):\n" + log[-4000:]
    assert "finished with exit code 4" in log
    # one night after RUN_DATE's training, with train.every_nights=2: not due, skipped in one line
    assert "training not due: the last training finished for 2024-05-08" in log
    assert _task_instances(airflow, "2024-05-09") == [("up_for_retry", 1)]
