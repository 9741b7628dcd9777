"""Logging for every command: one format, and credentials redacted from whatever any library logs.

Kept apart from the stage timing (:mod:`recsys.pipelines.timing`) because every entry point sets
logging up, including those that run no pipeline (``recsys serve``, ``recsys runs``).
"""
from __future__ import annotations

import logging

from recsys.uris import redact_text


class RedactingFilter(logging.Filter):
    """Removes credentials from every record a handler writes, whichever library logged it.

    MLflow, urllib3 and friends quote the URL they could not reach; a tracking URI with
    ``user:password@`` or ``?token=`` would otherwise end up in scheduler logs.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True


def configure_logging(verbose: bool = False) -> None:
    """Root logging at INFO (DEBUG with ``verbose``), every handler redacting, chatty libraries at WARNING."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    for noisy in ("py4j", "urllib3", "alembic", "mlflow.store", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
