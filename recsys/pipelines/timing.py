"""Stage timing: one log line per stage with its counts and seconds.

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
# job description: ``functools.partial(recsys.spark.session.job_description, spark)``)
JobLabel = Callable[[str], AbstractContextManager]


class StageTimer:
    """Times named stages and logs one line per stage; ``label`` names the stage's work elsewhere too.

    Knows nothing of Spark: the pipeline hands in how to label a stage's jobs, and how to report a
    running stage's progress (``progress(text, expected_users=N)``: a context manager, e.g.
    :class:`recsys.spark.task_progress.LiveProgress` bound to the session).
    """

    def __init__(self, label: JobLabel | None = None, job: str = "recsys",
                 progress: Callable[..., AbstractContextManager] | None = None):
        self.label = label
        self.progress = progress
        self.job = job
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    @contextmanager
    def stage(self, name: str, description: str | None = None,
              expected_users: int | None = None) -> Iterator[dict[str, Any]]:
        """Time a stage; the yielded dict collects counts that the closing log line reports.

        ``expected_users``: how many users the stage will go through, for the progress lines' share and time left.
        """
        counts: dict[str, Any] = {}
        label = description or name
        log.info("[%s] %s ...", self.job, label)
        start = time.perf_counter()
        with self.label(f"{self.job}: {label}") if self.label is not None else nullcontext(), \
                self.progress(f"[{self.job}] {label}", expected_users=expected_users) if self.progress is not None else nullcontext():
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

    def shares(self) -> dict[str, float]:
        """Each stage's share of the time since the timer started, and the share outside any stage:
        where a run's wall time went, in the manifest and MLflow next to the seconds."""
        total = self.total
        if total <= 0:
            return {}
        out = {f"stage_{k.replace(' ', '_')}_share": round(v / total, 4) for k, v in self.seconds.items()}
        out["outside_stages_share"] = round(max(0.0, 1 - sum(self.seconds.values()) / total), 4)
        return out

    def breakdown(self) -> dict[str, float]:
        """Seconds per stage plus ``outside_stages`` and ``total``, for the run's last log line."""
        total = self.total
        out = {k: round(v, 2) for k, v in self.seconds.items()}
        out["outside_stages"] = round(max(0.0, total - sum(self.seconds.values())), 2)
        out["total"] = round(total, 2)
        return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
