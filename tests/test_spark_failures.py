"""Spark's "gave up on a task" errors read into one line (recsys.spark.failures.infrastructure_failure), and
py4j's refused connection told from a metastore's.

The messages are Spark 4's own, as a driver received them from a standalone cluster on loopback (a Master and
a Worker from the pip package, ``spark.task.maxFailures=2``, 512m executors): an executor whose heap ran out, an
executor JVM killed with SIGKILL (as a container's memory limit does) in a stage without and with a shuffle
before it, and a Python worker killed in a pandas UDF. The job's own path, a Python worker killed on every
attempt in local mode, runs end to end in tests/test_job_faults.py.
"""
from __future__ import annotations

import pytest
from py4j.clientserver import ClientServer, JavaParameters, PythonParameters
from py4j.java_gateway import GatewayParameters, JavaGateway

from recsys.processes import free_port
from recsys.publish.table import is_metastore_failure
from recsys.spark.failures import infrastructure_failure, lost_jvm_connection

PREFIX = "An error occurred while calling o48.collectToPython.\n: org.apache.spark.SparkException: "
STACK = "\n\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:3122)\n"

HEAP = ("Job aborted due to stage failure: Task 0 in stage 0.0 failed 2 times, most recent failure: Lost task 0.2 in "
        "stage 0.0 (TID 4) (127.0.0.1 executor 2): java.lang.OutOfMemoryError: Java heap space")
KILLED = ("Job aborted due to stage failure: Task 0 in stage 0.0 failed 2 times, most recent failure: Lost task 0.1 in "
          "stage 0.0 (TID 1) (127.0.0.1 executor 1): ExecutorLostFailure (executor 1 exited caused by one of the "
          "running tasks) Reason: Command exited with code 137")
SHUFFLE_LOST = ("Job aborted due to stage failure: ResultStage 2 (collect at /tmp/exdie.py:21) has failed the maximum "
                "allowable number of times: 4. Most recent failure reason: org.apache.spark.shuffle."
                "MetadataFetchFailedException: Missing an output location for shuffle 0 partition 0")
PYTHON_WORKER = ("Job aborted due to stage failure: Task 0 in stage 0.0 failed 2 times, most recent failure: Lost task "
                 "0.1 in stage 0.0 (TID 2) (127.0.0.1 executor 0): org.apache.spark.SparkException: Python worker "
                 "exited unexpectedly (crashed). Consider setting 'spark.sql.execution.pyspark.udf.faulthandler."
                 "enabled' or'spark.python.worker.faulthandler.enabled' configuration to 'true' for the better "
                 "Python traceback.")


@pytest.mark.parametrize("message, says, setting", [
    (HEAP, "Spark gave up on task 0 of stage 0.0 after 2 attempts: executor 2 ran out of Java heap "
           "(java.lang.OutOfMemoryError)", "spark.executor.memory"),
    (KILLED, "Spark gave up on task 0 of stage 0.0 after 2 attempts: executor 1 was killed (Command exited with "
             "code 137), most often by its container's memory limit", "spark.executor.memoryOverhead"),
    (KILLED.replace("code 137", "code 52"), "Spark gave up on task 0 of stage 0.0 after 2 attempts: executor 1 ran "
                                            "out of Java heap (exit code 52)", "spark.executor.memory"),
    (SHUFFLE_LOST, "Spark gave up on stage 2 after 4 attempts: executors were lost while it ran", "exit code 137"),
    (PYTHON_WORKER, "Spark gave up on task 0 of stage 0.0 after 2 attempts: a Python worker on executor 0 died "
                    "without an error", "spark.executor.memoryOverhead"),
])
def test_a_task_whose_process_died_is_named_with_the_setting_to_raise(message, says, setting):
    line = infrastructure_failure(RuntimeError(PREFIX + message + STACK))
    assert line.startswith(says) and setting in line, line
    assert "\n" not in line


def test_an_executor_lost_for_another_reason_points_at_its_log():
    line = infrastructure_failure(RuntimeError(KILLED.replace("Command exited with code 137", "Worker shutting down")))
    assert line.endswith("executor 1 was lost (Worker shutting down): its log on the cluster says why")


def test_the_cause_is_found_in_the_error_a_wrapper_was_raised_from():
    try:
        try:
            raise RuntimeError(PREFIX + PYTHON_WORKER + STACK)
        except RuntimeError as inner:
            raise ValueError("writing the staged output failed") from inner
    except ValueError as outer:
        assert infrastructure_failure(outer).startswith("Spark gave up on task 0 of stage 0.0")


def test_an_error_translated_from_none_stays_the_translation():
    """``raise InputDataError(...) from None`` (a read failure the job explains): its hidden context is not read."""
    from recsys.errors import InputDataError

    try:
        try:
            raise RuntimeError(PREFIX + PYTHON_WORKER + STACK)
        except RuntimeError:
            raise InputDataError("events: Spark cannot read part-0.parquet") from None
    except InputDataError as translated:
        assert translated.__context__ is not None and infrastructure_failure(translated) is None


def test_py4j_s_first_line_gives_way_to_the_jvm_s_error_in_quotes():
    from recsys.errors import first_line

    for call in ("o48.collectToPython", "z:org.apache.spark.api.python.PythonRDD.collectAndServe"):
        text = f"An error occurred while calling {call}.\n: org.apache.spark.SparkException: " + HEAP + STACK
        assert first_line(RuntimeError(text)) == "org.apache.spark.SparkException: " + HEAP


@pytest.mark.parametrize("message", [
    # a task that raised an exception of its own: its traceback is the report
    "Job aborted due to stage failure: Task 1 in stage 3.0 failed 4 times, most recent failure: Lost task 1.3 in "
    "stage 3.0 (TID 14) (127.0.0.1 executor driver): org.apache.spark.api.python.PythonException: Traceback (most "
    "recent call last):\n  File \"core.py\", line 9\nValueError: a bug in a UDF",
    "Connection refused",
    "",
])
def test_anything_else_is_left_to_the_traceback(message):
    assert infrastructure_failure(RuntimeError(message)) is None


def test_an_error_of_ours_keeps_its_exit_code_and_words_whatever_spark_text_it_quotes():
    """A failure the job explains (bad input: exit 2) may quote Spark's message; it is not turned into exit 1."""
    from types import SimpleNamespace

    from recsys.cli.main import run_command
    from recsys.errors import ExitCode, InputDataError

    said = f"events: Spark cannot read part-0.parquet ({PYTHON_WORKER})"

    def fails(args):
        raise InputDataError(said)

    args = SimpleNamespace()
    assert run_command(fails, args) == ExitCode.BAD_INPUT
    assert args.outcome == said
    assert infrastructure_failure(InputDataError(said)) is not None     # the text alone would have been read so


def _py4j_refused(make_client) -> Exception:
    """The error py4j itself raises when the JVM's port refuses it: what every call meets once the JVM is gone."""
    client = make_client(free_port())
    try:
        client.jvm.java.lang.System.currentTimeMillis()
    except Exception as exc:
        return exc
    finally:
        client.shutdown()
    raise AssertionError("a closed port answered")


@pytest.mark.parametrize("make_client", [
    lambda port: ClientServer(java_parameters=JavaParameters(port=port), python_parameters=PythonParameters(port=0)),
    lambda port: JavaGateway(gateway_parameters=GatewayParameters(port=port)),
], ids=["pinned-thread client (pyspark's)", "gateway"])
def test_py4j_s_refused_connection_is_the_jvm_gone_not_the_metastore(make_client):
    refused = _py4j_refused(make_client)
    assert "refused" in f"{refused} {refused.__context__}"
    assert lost_jvm_connection(refused)
    assert not is_metastore_failure(refused)       # the words "Connection refused" alone no longer make it one
    # a metastore that refuses says so through the JVM, in its own words: still the metastore
    thrift = RuntimeError("org.apache.hadoop.hive.metastore.api.MetaException: Could not connect to meta store "
                          "using any of the URIs provided. Most recent failure: java.net.ConnectException: "
                          "Connection refused")
    assert is_metastore_failure(thrift) and not lost_jvm_connection(thrift)
