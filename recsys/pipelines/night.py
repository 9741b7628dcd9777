"""The whole night in one process: training when the schedule says it is due, then the nightly job.

``recsys night`` (``jobs/night.py`` under spark-submit) runs what the Airflow DAG runs as two tasks, in one
Spark session: one JVM and one Python start-up instead of two, the Python workers that training's
Spark jobs started are the ones that score, and the events window is read once: training's read is kept
(:class:`recsys.data.readers.KeptWindow`) until the night has built its histories from it. The semantics are
the DAG's:

- training runs only when ``train.every_nights`` says it is due (as ``recsys train --if-due``);
- a training that fails, for any reason, does not stop the night: the lists are scored with the version
  that holds the model alias, and the night's outcome says why training failed;
- the night's exit code is the nightly job's (0 published or skipped, 3 refused by the guard, 4 date
  locked, ...), so a scheduler retries exactly what it would retry for ``recsys recommend``; a retry
  after a training that finished does not train again (the training is no longer due).

Use it from cron or as one scheduler task when the two tasks' separate retries are not needed.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from pyspark.sql import SparkSession

from recsys.config import Config
from recsys.data.readers import KeptWindow
from recsys.errors import ExitCode, RecsysError, first_line
from recsys.hooks import NO_HOOKS, Hooks
from recsys.pipelines.nightly import NightlyResult, run_dates
from recsys.learning.shards import training_window
from recsys.pipelines.train import TrainResult, run_training, training_due

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NightResult:
    """What the night did: its training (or why there was none) and the nightly job's result."""

    training: TrainResult | None      # None: not due, or failed
    training_note: str                # one line: trained ... / not due: ... / failed (exit N): ...
    training_failed: bool
    nightly: NightlyResult

    @property
    def exit_code(self) -> ExitCode:
        """The nightly job's: a failed training is reported, not an exit code (the night ran without it)."""
        return self.nightly.exit_code


def run_night(spark: SparkSession, cfg: Config, date: dt.date, *, force: bool = False,
              hooks: Hooks = NO_HOOKS) -> NightResult:
    """Train ``date``'s model if due, then publish ``date``'s lists, in ``spark``.

    ``force`` is the nightly job's (recompute a date already published the same way); training is never
    forced past its gate here: ``recsys train --force`` does that, on purpose, by hand.
    """
    # training and the night's histories read the same window: read once, kept until the night has its histories
    kept = training_window(spark, cfg, date)
    try:
        return _train_then_publish(spark, cfg, date, force, hooks, kept)
    finally:
        kept.release()


def _train_then_publish(spark: SparkSession, cfg: Config, date: dt.date, force: bool, hooks: Hooks,
                        kept: KeptWindow) -> NightResult:
    training: TrainResult | None = None
    failed = False
    try:   # the cadence reads the tracking store: an unreachable one fails training, not the night
        reason = training_due(cfg, date)
        if reason is not None:
            note = f"training not due: {reason}"
            log.info("recsys night %s: %s", date, note)
        else:
            training = run_training(spark, cfg, date, hooks=hooks, kept=kept)
            note = training.summary()
    except RecsysError as exc:
        failed = True
        note = (f"training failed (exit {int(exc.exit_code)}: {exc.exit_code.meaning}): {first_line(exc)}; "
                f"the night runs with the version that holds the model alias")
        log.warning("recsys night %s: %s", date, note)
    except Exception as exc:  # a bug or an infrastructure failure in training must not cost the night its lists
        failed = True
        note = (f"training failed unexpectedly ({first_line(exc, with_type=True)}, traceback above); "
                f"the night runs with the version that holds the model alias")
        log.warning("recsys night %s: %s", date, note, exc_info=True)
    [nightly] = run_dates(spark, cfg, [date], force=force, hooks=hooks, kept=kept if kept.read else None)
    return NightResult(training=training, training_note=note, training_failed=failed, nightly=nightly)
