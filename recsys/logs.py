"""Logging for every command: one format, and credentials redacted from whatever any library logs.

Kept apart from the stage timing (:mod:`recsys.pipelines.timing`) because every entry point sets
logging up, including those that run no pipeline (``recsys serve``, ``recsys runs``).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from recsys.redaction import redact_text


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """``record`` with credentials removed from its message and from its traceback's text.

    MLflow, urllib3, pyarrow and friends quote the URL or path they could not reach; a tracking URI with
    ``user:password@`` or ``?token=``, or a secret the configuration holds (:mod:`recsys.redaction`),
    would otherwise end up in scheduler logs.
    """
    try:
        message = record.getMessage()
    except Exception:   # a bad format string: the handler reports it, as it would without redaction
        return record
    clean = redact_text(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact_text(record.stack_info)
    return record


class RedactingFilter(logging.Filter):
    """Redacts every record a handler writes (for handlers that logging set-up did not reach)."""

    def filter(self, record: logging.LogRecord) -> bool:
        redact_record(record)
        return True


def in_py4j(path: str) -> bool:
    """Whether a source file is py4j's (a log record's pathname, a traceback frame's filename)."""
    return f"{os.sep}py4j{os.sep}" in path


class Py4jRootRecordsFilter(logging.Filter):
    """Holds py4j's records below WARNING that it logs through the root logger, past the level its own logger has.

    py4j logs a failed call to the JVM with ``logging.info(..., exc_info=True)``, on the root logger: once the
    JVM is gone, every call (the objects Python frees at exit among them) adds a traceback of a refused
    connection, after the job's last line that said why (:func:`recsys.spark.failures.jvm_gone`).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and record.levelno < logging.WARNING and in_py4j(record.pathname))


class _RedactingFactory:
    """Wraps the log record factory, so that every record of every logger is clean from the start.

    A handler's filter is not enough: MLflow's loggers write through a handler of their own that does not
    propagate to the root, and any library may add one. A record is made only once a logger has decided to
    emit it, so this costs nothing for the DEBUG records of a run at INFO.
    """

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        return redact_record(self.wrapped(*args, **kwargs))


def configure_logging(verbose: bool = False) -> None:
    """Root logging at INFO (DEBUG with ``verbose``), every record redacted, chatty libraries at WARNING."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _RedactingFactory):
        logging.setLogRecordFactory(_RedactingFactory(factory))
    for handler in logging.getLogger().handlers:
        for kind in (RedactingFilter, Py4jRootRecordsFilter):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())
    for noisy in ("py4j", "urllib3", "alembic", "mlflow.store", "matplotlib", "httpx"):   # httpx: a line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
