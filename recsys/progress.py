"""Stage timing and progress lines: one log line per stage with its counts and seconds.

The timings double as the run's per-stage metrics (``stage_<name>_s``) and go into the manifest,
so the figures an operator sees in the log, in MLflow and next to the data are the same numbers.
"""
from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator

log = logging.getLogger("recsys")

# label(text) -> a context under which the work a stage starts carries ``text`` (e.g. the Spark UI's
# job description: ``functools.partial(recsys.spark_session.job_description, spark)``)
JobLabel = Callable[[str], AbstractContextManager]


class StageTimer:
    """Times named stages and logs one line per stage; ``label`` names the stage's work elsewhere too.

    Knows nothing of Spark: the pipeline hands in how to label a stage's jobs.
    """

    def __init__(self, label: JobLabel | None = None, job: str = "recsys"):
        self.label = label
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
        with self.label(f"{self.job}: {label}") if self.label is not None else nullcontext():
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
