"""Stage timing and progress lines: one log line per stage with its counts and seconds.

The timings double as the run's per-stage metrics (``stage_<name>_s``) and go into the manifest,
so the figures an operator sees in the log, in MLflow and next to the data are the same numbers.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator

log = logging.getLogger("recsys")


class StageTimer:
    def __init__(self, spark: Any | None = None, job: str = "recsys"):
        self.spark = spark
        self.job = job
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    @contextmanager
    def stage(self, name: str, description: str | None = None) -> Iterator[dict[str, Any]]:
        """Time a stage; the yielded dict collects counts that the closing log line reports."""
        counts: dict[str, Any] = {}
        label = description or name
        log.info("[%s] %s ...", self.job, label)
        start = time.perf_counter()
        if self.spark is not None:
            from recsys.spark_session import job_description

            ctx = job_description(self.spark, f"{self.job}: {label}")
        else:
            ctx = _null()
        with ctx:
            yield counts
        elapsed = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        detail = ", ".join(f"{k}={_fmt(v)}" for k, v in counts.items())
        log.info("[%s] %s done in %.1fs%s", self.job, label, elapsed, f": {detail}" if detail else "")

    @property
    def total(self) -> float:
        return time.perf_counter() - self._started

    def as_metrics(self) -> dict[str, float]:
        return {f"stage_{k.replace(' ', '_')}_s": round(v, 3) for k, v in self.seconds.items()}


@contextmanager
def _null() -> Iterator[None]:
    yield


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


class RedactingFilter(logging.Filter):
    """Removes credentials from every record a handler writes, whichever library logged it.

    MLflow, urllib3 and friends quote the URL they could not reach; a tracking URI with
    ``user:password@`` or ``?token=`` would otherwise end up in scheduler logs.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from recsys.uris import redact_text

        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True


def configure_logging(verbose: bool = False) -> None:
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
