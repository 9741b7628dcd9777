"""Errors a scheduler can act on: each expected failure maps to one documented exit code.

Expected failures (bad input, bad configuration, a held lock, failed validation) are raised as
:class:`RecsysError` subclasses and reported as one line without a traceback; anything else is
a bug or an infrastructure fault and exits with UNEXPECTED_ERROR and a traceback.
"""
from __future__ import annotations

import re
from enum import Enum, IntEnum

from recsys.redaction import redact_text


class ExitCode(IntEnum):
    """A command's exit code and what it means for a scheduler (retry, alert, nothing): the contract
    of docs/operations.md, and the words of the job's last log line."""

    meaning: str

    def __new__(cls, value: int, meaning: str) -> "ExitCode":
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    OK = 0, "success"
    UNEXPECTED_ERROR = 1, "unexpected error, a retry may help"
    BAD_INPUT = 2, "bad input or configuration, fix it: a retry will not help"
    VALIDATION_FAILED = 3, "output failed validation, nothing published: investigate, a retry will not help"
    LOCK_HELD = 4, "the date is locked by another run, nothing published: retry later"
    TRACKING_FAILED = 5, "published, but the MLflow run was not recorded: no need to rerun"
    INTERRUPTED = 130, "interrupted"     # Ctrl-C or SIGINT: the shell's 128 + 2


class RunStatus(str, Enum):
    """What one date's nightly run ended as: the ``recsys.status`` tag, ``NightlyResult.status`` and
    the words ``recsys runs`` prints."""

    PUBLISHED = "published"
    SKIPPED = "skipped"            # already published with the same model version and configuration
    FAILED = "failed"
    KILLED = "killed"              # the process died before the run could end; a later run of the date found it dead

    def __str__(self) -> str:
        return self.value


# py4j.protocol.Py4JJavaError's first line: "... calling o48.collectToPython." or, static, "... calling z:org.apache..."
_PY4J_CALL = re.compile(r"An error occurred while calling [\w.$:]+\.?")


def first_line(exc: BaseException, *, with_type: bool = False, limit: int = 500) -> str:
    """The first non-empty line of an error's message (:func:`first_line_of`), credentials redacted, at most
    ``limit`` characters.

    The one way an error is quoted in a log line, a tag, an HTTP answer or another error's message:
    Spark and MLflow errors run to pages, and the first line is the one that says what happened.
    An empty message gives the error's type name; ``with_type`` puts ``Type: `` in front.
    """
    line = first_line_of(str(exc))
    name = type(exc).__name__
    text = (f"{name}: {line}" if line else name) if with_type else (line or name)
    return redact_text(text)[:limit]


def first_line_of(text: str) -> str:
    r"""The first non-empty line of an error's text, stripped; "" for none. Py4J's errors from the JVM open with
    the call that failed and give the JVM's error on the next line: that one is the first line here.

    >>> first_line_of("An error occurred while calling o48.collectToPython.\n: org.apache.spark.SparkException: "
    ...               "Job aborted due to stage failure: ...\n\tat org.apache.spark.scheduler...")
    'org.apache.spark.SparkException: Job aborted due to stage failure: ...'
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and _PY4J_CALL.fullmatch(lines[0]):
        return lines[1].removeprefix(":").strip() or lines[0]
    return lines[0] if lines else ""


class RecsysError(Exception):
    """Base of the failures the job expects and explains in one line."""

    exit_code: ExitCode = ExitCode.UNEXPECTED_ERROR


class ConfigError(RecsysError):
    exit_code = ExitCode.BAD_INPUT


class InputDataError(RecsysError):
    exit_code = ExitCode.BAD_INPUT


class ModelNotFoundError(RecsysError):
    exit_code = ExitCode.BAD_INPUT


class GateError(RecsysError):
    """The training gate could not compare with the alias holder; the new version is registered, the alias did not move."""

    exit_code = ExitCode.BAD_INPUT


class TrainingProcessFailed(RecsysError):
    """A data-parallel training process failed or was killed mid-epoch: nothing was registered; a retry may help."""

    exit_code = ExitCode.UNEXPECTED_ERROR


class ValidationFailed(RecsysError):
    exit_code = ExitCode.VALIDATION_FAILED

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report or {}


class GuardRefused(ValidationFailed):
    """The guard refused the night (a figure crossed its ``fail`` threshold): nothing published, exit 3.

    ``report`` is the guard's verdict (every check, with figure, threshold and margin); ``figures`` the
    night's figures, recorded in the failed MLflow run.
    """

    def __init__(self, message: str, report: dict | None = None, figures: dict | None = None):
        super().__init__(message, report)
        self.figures = figures or {}


class LockHeld(RecsysError):
    """Another live run holds the date's lock (or took it over from this one): retry later."""

    exit_code = ExitCode.LOCK_HELD


class TrackingUnavailable(RecsysError):
    """The MLflow store cannot be reached and no earlier resolution of the model alias is remembered.

    An infrastructure fault, not bad input: a later retry can succeed, hence UNEXPECTED_ERROR (1),
    but the cause is known, so it is reported in one line.
    """

    exit_code = ExitCode.UNEXPECTED_ERROR


class SparkUnavailable(RecsysError):
    """The Spark Connect server named by ``spark.remote`` (or ``SPARK_REMOTE``) does not answer.

    An infrastructure fault: a retry can succeed (exit 1), but the cause is known, so one line says it
    instead of the client's ten minutes of silent retries.
    """

    exit_code = ExitCode.UNEXPECTED_ERROR


class TrackingFailed(RecsysError):
    exit_code = ExitCode.TRACKING_FAILED
