"""Errors a scheduler can act on: each expected failure maps to one documented exit code.

Expected failures (bad input, bad configuration, a held lock, failed validation) are raised as
:class:`RecsysError` subclasses and reported as one line without a traceback; anything else is
a bug or an infrastructure fault and exits with UNEXPECTED_ERROR and a traceback.
"""
from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    UNEXPECTED_ERROR = 1
    BAD_INPUT = 2              # bad input data or configuration: fix it, rerunning will not help
    VALIDATION_FAILED = 3      # output failed validation; nothing was published
    LOCK_HELD = 4              # another run holds this date's lock; retry later
    TRACKING_FAILED = 5        # recommendations published, but the MLflow run could not be recorded


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


class ValidationFailed(RecsysError):
    exit_code = ExitCode.VALIDATION_FAILED

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report or {}


class LockHeld(RecsysError):
    """Another live run holds the date's lock (or took it over from this one): retry later."""

    exit_code = ExitCode.LOCK_HELD


class TrackingUnavailable(RecsysError):
    """The MLflow store cannot be reached and no earlier resolution of the model alias is remembered.

    An infrastructure fault, not bad input: a later retry can succeed, hence UNEXPECTED_ERROR (1),
    but the cause is known, so it is reported in one line.
    """

    exit_code = ExitCode.UNEXPECTED_ERROR


class TrackingFailed(RecsysError):
    exit_code = ExitCode.TRACKING_FAILED
