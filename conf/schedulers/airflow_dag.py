"""Airflow 3 DAG: each logical date, the night (training when due, then the lists) as one job, then the export.

Install Airflow in its own virtualenv (never in the job's .venv) and point its dags folder here,
or copy this file; then set, as Airflow Variables (or AIRFLOW_VAR_<NAME> environment variables):

- ``recsys_home``: the checkout with ``spark-submit.sh`` and its ``.venv`` (default /opt/recsys);
- ``recsys_conf``: the job's YAML config, relative to recsys_home or absolute (default conf/production.yaml);
- ``recsys_spark_master``: the Spark master (default local[*,4]).

Two tasks per date, ``night >> export``:

- ``night`` runs ``jobs/night.py --date <ds>`` (``recsys night``): one Spark job that trains on the events
  before the date when ``train.every_nights`` (the job's config, the one place the cadence is set) says
  training is due, moves the model alias if the new version is not worse, and then publishes the date's
  lists, reading the events window once for both. A training that fails never costs the night its lists:
  they come from the version holding the alias, and the log's last line says why training failed (so does
  the training's MLflow run). A retry never repeats a training that finished (it is no longer due), nor
  one whose process died (killed, out of memory): the retry publishes with the alias holder instead.
- ``export`` runs ``jobs/export.py --date <ds> --if-configured`` once ``night`` succeeded: the date's
  published lists into Redis as a new version, then one switch of the pointer readers follow (docs/export.md).
  Without ``export.redis_url`` in the config it exits 0 saying so. The same exit-code rules as ``night``:
  1 (Redis unreachable, nothing switched) and 4 (another export holds the lock) are retried; 2 (not
  published, failed validation, or a date older than the one Redis serves: readers would move back a night,
  which only ``recsys export --allow-older`` by hand does) fails at once; 5 (served, figures not recorded in
  MLflow) succeeds with a warning.

What ``night`` does with the job's exit code, the nightly job's (docs/operations.md, "Exit codes"):

- 0: success (published, or already published the same way and skipped);
- 5: success, with a warning in the task log: the partition is published, only the MLflow run
  is missing (the manifest holds its figures); rerunning would recompute the same thing;
- 2 (bad input or configuration) and 3 (output failed validation): the task fails at once,
  without retries, since neither fixes itself;
- 1 (unexpected, e.g. infrastructure) and 4 (the date is locked by another run): retried, up to
  ``retries`` times, ``retry_delay`` apart.

Runs never overlap: ``max_active_runs=1`` (and the job itself takes a per-date lock, so even a
manually triggered second run of a date exits 4 and is retried later). ``catchup=True`` creates
the missed dates' runs oldest first, and with one active run at a time they run oldest first.
"""
from __future__ import annotations

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowException, AirflowFailException

# The job's exit codes are recsys.errors.ExitCode's, taken from recsys where this Airflow can import it.
# Airflow usually runs in a virtualenv of its own, without recsys: there the copy below is used, and
# tests/test_airflow_dag_codes.py fails as soon as it and ExitCode differ.
try:
    from recsys.errors import ExitCode

    EXIT_CODES = {code.name: int(code) for code in ExitCode}
except ImportError:
    EXIT_CODES = {"OK": 0, "UNEXPECTED_ERROR": 1, "BAD_INPUT": 2, "VALIDATION_FAILED": 3, "LOCK_HELD": 4,
                  "TRACKING_FAILED": 5, "INTERRUPTED": 130}

NOT_RETRIED = {
    EXIT_CODES["BAD_INPUT"]: "bad input data or configuration: fix the input or the config, then clear the task",
    EXIT_CODES["VALIDATION_FAILED"]: "the output failed validation, nothing was published: investigate, then clear "
                                     "the task",
}
PUBLISHED_NOT_RECORDED = EXIT_CODES["TRACKING_FAILED"]


class RecsysJobOperator(BashOperator):
    """BashOperator that hands a failed job's exit code to ``on_failure``, which decides what Airflow does."""

    def __init__(self, **kwargs):
        super().__init__(skip_on_exit_code=None, **kwargs)

    def execute(self, context):
        try:
            return super().execute(context)
        except AirflowException:
            process = getattr(self.subprocess_hook, "sub_process", None)
            return self.on_failure(process.returncode if process is not None else None)

    def on_failure(self, code):
        raise NotImplementedError


class NightlyJobOperator(RecsysJobOperator):
    """Maps the nightly job's documented exit codes to Airflow's retry semantics."""

    def on_failure(self, code):
        if code in NOT_RETRIED:
            raise AirflowFailException(f"recsys exited with code {code}, not retried: {NOT_RETRIED[code]}") from None
        if code == PUBLISHED_NOT_RECORDED:
            self.log.warning("recsys exited with code %s: recommendations published, but the MLflow run could not "
                             "be recorded (the partition's _manifest.json holds the figures); not rerun", code)
            return None
        raise AirflowException(f"recsys exited with code {code}: retried")   # 1, 4 and anything else


class ExportJobOperator(NightlyJobOperator):
    """``recsys export``: the nightly job's rules; its exit code 5 means the lists are served, only their
    figures are missing from MLflow."""

    def on_failure(self, code):
        if code == PUBLISHED_NOT_RECORDED:
            self.log.warning("recsys export exited with code %s: the lists are exported and served, but their "
                             "figures could not be recorded in MLflow (they are in Redis, with the version); not "
                             "rerun", code)
            return None
        return super().on_failure(code)


with DAG(
    dag_id="recsys_nightly",
    schedule="15 2 * * *",
    start_date=pendulum.datetime(2024, 5, 1, tz="UTC"),
    catchup=True,            # missed dates run oldest first, one at a time
    max_active_runs=1,       # never two runs at once (and never two of one date)
    default_args={"retries": 2, "retry_delay": pendulum.duration(minutes=10)},
    tags=["recsys"],
) as dag:
    night = NightlyJobOperator(
        task_id="night",            # training when due, then the lists: one job, one read of the events window
        cwd="{{ var.value.get('recsys_home', '/opt/recsys') }}",
        bash_command=(
            "./spark-submit.sh --master '{{ var.value.get('recsys_spark_master', 'local[*,4]') }}' "
            "jobs/night.py --date {{ ds }} "
            "--conf '{{ var.value.get('recsys_conf', 'conf/production.yaml') }}'"
        ),
        execution_timeout=pendulum.duration(hours=8),
        max_active_tis_per_dag=1,
    )
    export = ExportJobOperator(
        task_id="export",           # after the night succeeded (exit 0, or 5: published, not recorded)
        cwd="{{ var.value.get('recsys_home', '/opt/recsys') }}",
        bash_command=(
            "./spark-submit.sh --master '{{ var.value.get('recsys_spark_master', 'local[*,4]') }}' "
            "jobs/export.py --date {{ ds }} --if-configured "
            "--conf '{{ var.value.get('recsys_conf', 'conf/production.yaml') }}'"
        ),
        execution_timeout=pendulum.duration(hours=2),
        max_active_tis_per_dag=1,
    )
    night >> export
