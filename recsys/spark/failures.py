"""Why Spark failed a job, in one line an operator can act on, where the error Python receives hides it.

Two kinds of failure reach the job's Python as errors that name the symptom, not the cause:

- the Spark JVM this process launched is gone (:func:`jvm_gone`): every later call fails with a refused
  connection;
- Spark gave up on a task after ``spark.task.maxFailures`` attempts because the process running it died
  (:func:`infrastructure_failure`): an executor lost to its memory limit, a Python worker killed, or the
  shuffle files of executors lost that way. The error is a ``Job aborted due to stage failure`` with the
  driver's JVM stack, which says nothing an operator can use; Spark's message names the cause on its first
  line, and that is what is read here. A task that failed on an exception of its own is left alone: its
  traceback is the report.

Neither imports pyspark: a command that did not start Spark gets None from both.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import traceback

from recsys.errors import RecsysError
from recsys.logs import in_py4j

SPARK_OOM_EXIT = 52   # org.apache.spark.util.SparkExitCode.OOM: a JVM's uncaught java.lang.OutOfMemoryError


JVM_EXIT_WAIT_S = 5.0   # how long a refused gateway connection waits for the JVM's process to be seen ending


def jvm_gone(exc: BaseException | None = None) -> str | None:
    """Why the Spark JVM this process launched is gone, in one line; None while it runs, or where this process
    launched none (under ``spark-submit`` the JVM is the parent: ``spark-submit.sh`` says why it ended).

    A local JVM that dies (its heap exhausted: Spark exits it with code 52; killed, often by the kernel's
    out-of-memory killer) leaves Python with errors that hide the cause: ``Connection refused``,
    ``Py4JJavaError: <exception str() failed>``. Asked once a command has failed, this names the cause and the
    setting. ``exc``: that failure. A killed process closes its sockets before its parent can see it end, so a
    failure that is a refused or broken gateway connection waits up to ``JVM_EXIT_WAIT_S`` for the JVM's exit
    (a JVM that lives on costs that wait on a command that failed anyway: twice for a night or a training, asked
    once when the failed run is recorded and once when the command exits).
    """
    context = sys.modules.get("pyspark.core.context")
    gateway = getattr(getattr(context, "SparkContext", None), "_gateway", None)
    proc = getattr(gateway, "proc", None)
    if proc is None:
        return None
    code = proc.poll()
    if code is None and exc is not None and lost_jvm_connection(exc):
        try:
            code = proc.wait(timeout=JVM_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
    if code is None:
        return None
    if code == SPARK_OOM_EXIT:
        return (f"the Spark JVM (pid {proc.pid}) ran out of Java heap (java.lang.OutOfMemoryError; exit code 52): "
                "give it more with spark.conf's spark.driver.memory (Spark's default 1g; in local mode that one JVM "
                "runs every task), e.g. --set spark.conf.spark.driver.memory=4g; its log above names the stage")
    if code < 0:
        killer = (": often the machine's or container's memory limit (the kernel's out-of-memory killer, which "
                  "its log names: dmesg)") if -code == signal.SIGKILL else ""
        return f"the Spark JVM (pid {proc.pid}) was killed by signal {-code}{killer}"
    return f"the Spark JVM (pid {proc.pid}) exited with code {code} while the job ran: its log above says why"


def lost_jvm_connection(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised from or while handling, is py4j's refused or broken connection
    to the JVM (its ``Py4JNetworkError``, or a ``ConnectionError`` raised inside py4j): not another server's, such
    as an unreachable MLflow's or metastore's, which says nothing about the JVM."""
    while exc is not None:
        if type(exc).__name__ == "Py4JNetworkError" or (isinstance(exc, ConnectionError) and _raised_in_py4j(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _raised_in_py4j(exc: BaseException) -> bool:
    return any(in_py4j(frame.filename) for frame in traceback.extract_tb(exc.__traceback__))


_ABORTED = re.compile(r"Job aborted due to stage failure: ([^\n]*)")
_TASK = re.compile(r"Task (\d+) in stage (\S+) failed (\d+) times")
_STAGE = re.compile(r"(?:Result|ShuffleMap)?Stage (\d+) .*?has failed the maximum allowable number of times: (\d+)")
_EXECUTOR = re.compile(r"executor (\w+)\)")                       # "(TID 8) (10.0.0.5 executor 3): ..."
_LOST = re.compile(r"ExecutorLostFailure \(executor (\w+) exited[^)]*\)(?: Reason: (.*))?")
_KILLED = ("code 137", "SIGKILL", "OOMKilled", "exceeding", "memory limit", "killed by")

_PYTHON_ROOM = ("the Python workers (the model, a chunk of users and its score tile) live outside the JVM heap: "
                "give them room with spark.executor.memoryOverhead (or spark.executor.pyspark.memory), or hold less "
                "with a smaller scoring.max_tile_mb or scoring.chunk_size")
_HEAP = ("give executors more heap with spark.executor.memory (--executor-memory), or fewer tasks each "
         "(spark.executor.cores): the tasks of an executor share its heap")


def infrastructure_failure(exc: BaseException) -> str | None:
    """One line naming why Spark gave up on a task, where the process running it died; None for anything else.

    Read from Spark's message (classic and Connect errors carry the same text): ``Job aborted due to stage
    failure: Task 1 in stage 2.0 failed 4 times, most recent failure: Lost task 1.3 ... (10.0.0.5 executor 3):
    <cause>``. The causes named: an executor's ``java.lang.OutOfMemoryError``; ``ExecutorLostFailure`` (exit code
    52: its heap; 137 or a container manager's kill: a memory limit; else its own log); a Python worker that
    ``exited unexpectedly (crashed)``; shuffle output missing because the executors that wrote it were lost.

    >>> print(infrastructure_failure(RuntimeError("Job aborted due to stage failure: Task 3 in stage 7.0 failed 4 "
    ...     "times, most recent failure: Lost task 3.3 in stage 7.0 (TID 40) (10.0.0.5 executor 2): "
    ...     "ExecutorLostFailure (executor 2 exited caused by one of the running tasks) Reason: Command exited with "
    ...     "code 52")))
    Spark gave up on task 3 of stage 7.0 after 4 attempts: executor 2 ran out of Java heap (exit code 52): give ...
    >>> infrastructure_failure(RuntimeError("Job aborted due to stage failure: Task 0 in stage 1.0 failed 4 times, "
    ...     "most recent failure: Lost task 0.3 in stage 1.0 (TID 9) (10.0.0.5 executor 1): "
    ...     "org.apache.spark.api.python.PythonException: Traceback (most recent call last): ...")) is None
    True
    """
    found = None
    while exc is not None and found is None:     # the error, or one it was raised from or while handling
        found = _ABORTED.search(str(exc))
        # `raise ... from None` hides the context: an error we translated (a read failure: bad input) stays ours
        exc = exc.__cause__ if exc.__cause__ is not None else None if exc.__suppress_context__ else exc.__context__
    if found is None:
        return None
    line = found.group(1)
    cause = _cause(line)
    if cause is None:
        return None
    task, stage = _TASK.search(line), _STAGE.search(line)
    if task is not None:
        head = f"task {task.group(1)} of stage {task.group(2)} after {task.group(3)} attempts"
    elif stage is not None:
        head = f"stage {stage.group(1)} after {stage.group(2)} attempts"
    else:
        head = "a stage"
    return f"Spark gave up on {head}: {cause}"


def _cause(line: str) -> str | None:
    """What the failure line says the process that ran the task died of, with what to do; None: not that."""
    executor = _EXECUTOR.search(line)
    where = f"executor {executor.group(1)}" if executor is not None else "an executor"
    if where == "executor driver":
        where = "the driver (local mode)"
    lost = _LOST.search(line)
    if lost is not None:
        reason = (lost.group(2) or "no reason given").strip()[:200]
        if "code 52" in reason or "OutOfMemoryError" in reason:
            return f"executor {lost.group(1)} ran out of Java heap (exit code 52): {_HEAP}"
        if any(k in reason for k in _KILLED):
            return (f"executor {lost.group(1)} was killed ({reason}), most often by its container's memory limit: "
                    f"{_PYTHON_ROOM}; or raise spark.executor.memory if its heap grew")
        return f"executor {lost.group(1)} was lost ({reason}): its log on the cluster says why"
    if "java.lang.OutOfMemoryError" in line:
        return f"{where} ran out of Java heap (java.lang.OutOfMemoryError): {_HEAP}"
    if "Python worker exited unexpectedly" in line:
        return (f"a Python worker on {where} died without an error (killed, most often by a memory limit, or a "
                f"native crash: spark.python.worker.faulthandler.enabled=true prints its stack): {_PYTHON_ROOM}")
    if "Missing an output location for shuffle" in line or "FetchFailed" in line:
        return ("executors were lost while it ran, and the shuffle files they held with them: the cluster manager's "
                "and the executors' logs say why (exit code 137: a memory limit, 52: the heap)")
    return None


def spark_cause(exc: BaseException) -> str | None:
    """The one line for a failed command whose cause Spark hid (:func:`jvm_gone`, :func:`infrastructure_failure`);
    None for the rest. An error of ours already says what it is, whatever Spark text it quotes."""
    return jvm_gone(exc) or (None if isinstance(exc, RecsysError) else infrastructure_failure(exc))


def recorded_error(exc: BaseException, cause: str | None) -> str:
    """The error's text as a run records it (MLflow's error tag, whose first line ``recsys runs`` shows): ``cause``,
    :func:`spark_cause`'s line, first where Spark hid the cause, then the error."""
    return f"{cause}\n{exc}" if cause else str(exc)
