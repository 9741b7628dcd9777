"""The whole night in one process: training when the schedule says it is due, then the nightly job.

``recsys night`` (``jobs/night.py`` under spark-submit; the Airflow DAG's ``night`` task) runs ``recsys train
--if-due`` and ``recsys recommend`` in one Spark session: one JVM and one Python start-up instead of two, the
Python workers that training's Spark jobs started are the ones that score, and the events window is read once:
training's read is kept (:class:`recsys.data.readers.KeptWindow`) until the night has built its histories from
it. The semantics:

- training runs only when ``train.every_nights`` says it is due (as ``recsys train --if-due``);
- a training that fails, for any reason, does not stop the night: the lists are scored with the version
  that holds the model alias, and the night's outcome says why training failed;
- the night's exit code is the nightly job's (0 published or skipped, 3 refused by the guard, 4 date
  locked, ...), so a scheduler retries exactly what it would retry for ``recsys recommend``; a retry
  after a training that finished does not train again (the training is no longer due);
- a training that takes the whole process down (killed, out of memory) cannot report itself: it leaves its
  mark (:class:`TrainingAttempt`), and the next attempt of the same night publishes with the alias holder
  instead of training again, so that a training that dies every time still never costs the night its lists.

The Airflow DAG and the crontab example run it; ``recsys train --if-due`` and ``recsys recommend`` as two
scheduler tasks are the alternative where a failed training must be a failed task of its own.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
from dataclasses import dataclass
from urllib.parse import quote

from pyspark.sql import SparkSession

from recsys import fs as rfs
from recsys.config import Config
from recsys.data.readers import KeptWindow
from recsys.errors import ConfigError, ExitCode, LockHeld, RecsysError, RunStatus, first_line
from recsys.hooks import NO_HOOKS, Hooks
from recsys.pipelines.nightly import NightlyResult, run_dates
from recsys.learning.shards import training_window
from recsys.pipelines.train import TrainResult, run_training, training_due
from recsys.processes import process_alive, process_start_time
from recsys.redaction import redact_uri
from recsys.tracking import store as tracking
from recsys.tracking import tags

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


RUNS_WITH_HOLDER = "the night runs with the version that holds the model alias"


@dataclass(frozen=True)
class EarlierAttempt:
    """What an earlier attempt's mark says: why its training did not end (one clause), whether its process still
    runs (on this host), and when it started its training (None: the mark could not be read)."""

    why: str
    running: bool
    started_at: dt.datetime | None


@dataclass(frozen=True)
class TrainingAttempt:
    """The mark a night's training (or ``recsys train``'s: :func:`claim_training`) leaves while it runs, under
    ``paths.work`` (shared by every machine of a cluster, like the shards): ``night-training/<model name>/<date>.json``,
    with the process that started it.

    Removed when training returns or raises; still there at the next attempt of the night only if the process
    died in training (SIGKILL, the kernel's out-of-memory killer, a lost machine), or if another process is
    training that date now. Either way that attempt does not train: a scheduler's retries would otherwise
    repeat a training that dies every time and never publish the night.
    """

    fs: object
    path: str
    work: str            # paths.work as configured: what a mark that cannot be written names

    @classmethod
    def of(cls, cfg: Config, date: dt.date) -> "TrainingAttempt":
        fs, base = rfs.resolve(cfg.paths.work)
        return cls(fs, rfs.join(base, "night-training", quote(cfg.mlflow.model_name, safe=""), f"{date}.json"),
                   cfg.paths.work)

    def left_by_another(self) -> EarlierAttempt | None:
        """What the mark an earlier attempt left says (read once); None without a mark."""
        if not rfs.exists(self.fs, self.path):
            return None
        try:
            mark = json.loads(rfs.read_text(self.fs, self.path))
            who = f"process {mark['pid']} on {mark['host']}, started {mark['started_at']}"
            started_at = dt.datetime.fromisoformat(mark["started_at"])
            here = mark["host"] == socket.gethostname()
            alive = here and process_alive(int(mark["pid"]), mark.get("pid_started"))
        except (OSError, ValueError, KeyError, TypeError):
            who, started_at, here, alive = "an unreadable mark", None, None, False
        if alive:
            state = "is still running (training this date now?)"
        elif here:
            state = "died before its training ended"
        elif here is None:
            state = "did not end its training"
        else:   # a retry on another machine (a new driver pod, say): most likely the first one died
            state = "did not end its training (on another host: if it still runs there, it is training this date)"
        return EarlierAttempt(f"an earlier attempt of this night ({who}) {state}", alive, started_at)

    def start(self) -> None:
        """Leave the mark; ConfigError naming ``paths.work`` and its value when it cannot be written."""
        mark = {"pid": os.getpid(), "pid_started": process_start_time(), "host": socket.gethostname(),
                "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        try:
            rfs.write_text_atomic(self.fs, self.path, json.dumps(mark))
        except OSError as exc:
            raise ConfigError(f"cannot write the training's mark under paths.work={redact_uri(self.work)!r} "
                              f"({first_line(exc, with_type=True, limit=300)}): give paths.work a directory or URI "
                              "that the driver and every executor can write (docs/cluster.md)") from None

    def end(self) -> None:
        try:
            if rfs.exists(self.fs, self.path):
                self.fs.delete_file(self.path)
        except OSError as exc:   # the training's outcome stands; only the next attempt of this night is affected
            log.warning("could not remove %s (%s): a rerun of this night will not train", redact_uri(self.path), exc)


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
    failure: str | None = None        # why training failed, in one clause (the night's MLflow run is tagged with it)
    try:   # the cadence reads the tracking store: an unreachable one fails training, not the night
        reason = training_due(cfg, date)
        attempt = TrainingAttempt.of(cfg, date)
        earlier = attempt.left_by_another() if reason is None else None
        if reason is not None:
            note = f"training not due: {reason}"
            log.info("recsys night %s: %s", date, note)
        elif earlier is not None:
            failure = f"training not tried again: {earlier.why}"
            if not earlier.running:   # one attempt without training is enough: a later rerun of the date trains again
                _end_dead_trainings(cfg, date, earlier)
                attempt.end()
            note = (f"{failure}; {RUNS_WITH_HOLDER} (`recsys train --date {date}` trains by hand, and its log says "
                    f"why it stops)")
            log.warning("recsys night %s: %s", date, note)
        else:
            attempt.start()
            try:
                training = run_training(spark, cfg, date, hooks=hooks, kept=kept)
            finally:
                attempt.end()
            note = training.summary()
    except RecsysError as exc:
        failure = f"training failed (exit {int(exc.exit_code)}: {exc.exit_code.meaning}): {first_line(exc)}"
        note = f"{failure}; {RUNS_WITH_HOLDER}"
        log.warning("recsys night %s: %s", date, note)
    except Exception as exc:  # a bug or an infrastructure failure in training must not cost the night its lists
        failure = f"training failed unexpectedly ({first_line(exc, with_type=True)}, traceback above)"
        note = f"{failure}; {RUNS_WITH_HOLDER}"
        log.warning("recsys night %s: %s", date, note, exc_info=True)
    [nightly] = run_dates(spark, cfg, [date], force=force, hooks=hooks, kept=kept if kept.read else None)
    if failure is not None and nightly.status == RunStatus.PUBLISHED and nightly.run_id is not None:
        _note_failed_training(cfg, date, nightly.run_id, failure)
    return NightResult(training=training, training_note=note, training_failed=failure is not None, nightly=nightly)


def claim_training(cfg: Config, date: dt.date) -> TrainingAttempt:
    """The date's training mark, taken for ``recsys train`` (by hand, or a scheduler's training task): the same
    mark a night's training leaves, so that a night and a training by hand never train one date at once, and a
    training of either kind that died is found by the next.

    A live attempt (this host's process still runs) refuses with :class:`LockHeld` (exit 4: retry later); a dead
    one's RUNNING MLflow training runs are ended as KILLED, saying why, and this one trains: unlike a night's
    retry, which publishes with the alias holder instead, a training asked for by name is what its caller wants.
    The caller ends the mark (:meth:`TrainingAttempt.end`) when its training returns or raises."""
    attempt = TrainingAttempt.of(cfg, date)
    earlier = attempt.left_by_another()
    if earlier is not None and earlier.running:
        raise LockHeld(f"not training {date}: {earlier.why}; retry once it has ended (its mark: "
                       f"{redact_uri(attempt.path)})")
    if earlier is not None:
        log.warning("recsys train %s: %s; training again", date, earlier.why)
        _end_dead_trainings(cfg, date, earlier, "recsys train")
    attempt.start()
    return attempt


def _end_dead_trainings(cfg: Config, date: dt.date, earlier: EarlierAttempt, who: str = "recsys night") -> None:
    """End as KILLED the MLflow training runs the dead attempt left RUNNING (from its mark's start on)."""
    if earlier.started_at is None:
        return
    try:
        ended = tracking.end_dead_trainings(cfg.mlflow, date, earlier.started_at, earlier.why)
    except Exception as exc:   # the store is the night's to judge later; this only tidies the dead run
        log.warning("%s %s: the dead training's MLflow run could not be ended: %s", who, date,
                    first_line(exc, with_type=True))
        return
    for run_id in ended:
        log.info("%s %s: ended the dead training's MLflow run %s as KILLED", who, date, run_id)


def _note_failed_training(cfg: Config, date: dt.date, run_id: str, failure: str) -> None:
    """Tag the night's MLflow run with why its training failed: with training and the lists in one scheduler
    task, a failed training is no failed task; this puts it beside the night in MLflow and in ``recsys runs``.
    A training that fails on bad input leaves no training run of its own (it fails before opening one)."""
    error = tracking.note_on_run(cfg.mlflow, run_id, {}, {tags.TRAINING_FAILED: failure})
    if error is not None:
        log.warning("recsys night %s: the MLflow run %s could not be tagged with the training's failure: %s",
                    date, run_id, error)
