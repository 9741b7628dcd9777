"""Progress lines while a long stage runs: tasks done/total, users so far, users/s and time left.

A stage logs when it starts and when it ends; scoring a million users takes minutes in between,
and a scheduler's log that says nothing for minutes looks like a hung job. While a stage runs, a
daemon thread logs one line every ``progress.interval_s`` seconds (0: off):

    [recommend 2024-05-08] score users: 23/64 tasks, 351,200 of 1,000,000 users (35%), 11,840 users/s, about 55s left

Where the figures come from:

- **classic sessions**: tasks from Spark's status tracker (the jobs started since the stage
  began; their stages' task counts). Users from the stage metrics in Spark's status store: rows
  read by the stage's last running stage (its input or shuffle read). Measured: these advance only
  when a task finishes, not while it runs, so the lines are as fine as the stage's tasks; the
  nightly job sizes its scoring tasks for that (``scoring.users_per_task``,
  :func:`recsys.scoring.stage.scoring_tasks`). The time left comes from the users still to read
  at the stage's pace (:class:`Pace`), else from the tasks still to run.
- **Spark Connect**: there is no status tracker on the client; the server streams per-stage task
  counts and bytes read with each operation (``SparkSession.registerProgressHandler``), so the
  lines show tasks and bytes, and say that user counts are not available over Spark Connect.

The reporter only reads; it never touches the job's data or its Spark jobs, and a failure to read
progress is logged once at debug level, never raised.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("recsys")


@dataclass
class Snapshot:
    tasks_done: int = 0
    tasks_total: int = 0
    rows: int | None = None          # rows read so far by the stage's last running stage (classic only)
    bytes_read: int | None = None    # Spark Connect's per-stage figure
    note: str | None = None          # what is not available, said once per line


class _ClassicSource:
    """Spark's status tracker (tasks) and the status store's live stage metrics (rows), on a classic session."""

    def __init__(self, spark: Any):
        self.sc = spark.sparkContext
        self.tracker = self.sc.statusTracker()
        self.jobs: set[int] = set()
        self.known_before = set(self.tracker.getActiveJobsIds())   # not ours: started before the stage
        self._rows_broken = False

    def snapshot(self) -> Snapshot:
        for job_id in self.tracker.getActiveJobsIds():
            if job_id not in self.known_before:
                self.jobs.add(job_id)
        snap = Snapshot()
        last_stages = set()
        for job_id in sorted(self.jobs):
            job = self.tracker.getJobInfo(job_id)
            if job is None:
                continue
            finished = job.status in ("SUCCEEDED", "FAILED")
            if job.stageIds:
                last_stages.add(max(job.stageIds))
            for stage_id in job.stageIds:
                stage = self.tracker.getStageInfo(stage_id)
                if stage is None:
                    continue
                snap.tasks_done += stage.numCompletedTasks
                # a finished job's skipped stages never run: count only what completed
                snap.tasks_total += stage.numCompletedTasks if finished else stage.numTasks
        snap.rows = self._rows(last_stages)
        return snap

    def _rows(self, stage_ids: set[int]) -> int | None:
        """Rows read so far by the running last stages of our jobs, from the status store (JVM)."""
        if self._rows_broken or not stage_ids:
            return None
        try:
            active = self.sc._jsc.sc().statusStore().activeStages()
            rows = None
            for i in range(active.size()):
                stage = active.apply(i)
                if stage.stageId() in stage_ids:
                    rows = (rows or 0) + int(stage.inputRecords()) + int(stage.shuffleReadRecords())
            return rows
        except Exception as exc:   # an internal API: if a Spark version moves it, fall back to tasks only
            self._rows_broken = True
            log.debug("live row counts unavailable: %s", exc)
            return None


class _ConnectSource:
    """Per-stage task counts streamed by a Spark Connect server with each operation."""

    def __init__(self, spark: Any):
        self.spark = spark
        self.stages: dict[tuple[str, int], tuple[int, int, int]] = {}
        self.lock = threading.Lock()
        self.registered = False
        try:
            spark.registerProgressHandler(self._handler)
            self.registered = True
        except Exception as exc:   # older clients have no progress handler
            log.debug("Spark Connect progress handler unavailable: %s", exc)

    def _handler(self, stages: Any, inflight_tasks: int, operation_id: str | None = None, done: bool = False,
                 **_: Any) -> None:
        with self.lock:
            for s in stages or []:
                self.stages[(operation_id or "", s.stage_id)] = (s.num_completed_tasks, s.num_tasks, s.num_bytes_read)

    def close(self) -> None:
        if self.registered:
            try:
                self.spark.removeProgressHandler(self._handler)
            except Exception:
                pass

    def snapshot(self) -> Snapshot:
        if not self.registered:
            return Snapshot(note="no progress over this Spark Connect client (no progress handler)")
        with self.lock:
            values = list(self.stages.values())
        return Snapshot(tasks_done=sum(v[0] for v in values), tasks_total=sum(v[1] for v in values),
                        bytes_read=sum(v[2] for v in values),
                        note="user counts are not available over Spark Connect")


def format_line(label: str, snap: Snapshot, *, elapsed: float, expected_users: int | None,
                users_per_s: float | None) -> str:
    parts = [f"{snap.tasks_done}/{snap.tasks_total} tasks" if snap.tasks_total else "no tasks started yet"]
    if snap.rows is not None and expected_users:
        parts.append(f"{snap.rows:,} of {expected_users:,} users ({100 * snap.rows / expected_users:.0f}%)")
    elif snap.rows is not None:   # a stage not counted in users (e.g. reading events): rows, not users
        parts.append(f"{snap.rows:,} rows read")
    if users_per_s is not None and expected_users:
        parts.append(f"{users_per_s:,.0f} users/s")
    if snap.bytes_read:   # a Connect server reports 0 for stages that read a shuffle: say nothing then
        parts.append(f"{snap.bytes_read / 1e6:,.1f} MB read")
    left = _time_left(snap, elapsed=elapsed, expected_users=expected_users, users_per_s=users_per_s)
    parts.append(f"about {_duration(left)} left" if left is not None else "time left unknown yet")
    parts.append(f"{_duration(elapsed)} so far")
    if snap.note:
        parts.append(snap.note)
    return f"{label}: " + ", ".join(parts)


def _time_left(snap: Snapshot, *, elapsed: float, expected_users: int | None, users_per_s: float | None) -> float | None:
    if snap.rows is not None and expected_users and users_per_s:
        return max(expected_users - snap.rows, 0) / users_per_s
    if snap.tasks_total and snap.tasks_done:
        return elapsed / snap.tasks_done * (snap.tasks_total - snap.tasks_done)
    return None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Pace:
    """The users/s behind a progress line: since the first line that counted users, once a later
    line has counted more; before that, the average since the stage began.

    Rows advance in steps as tasks finish, so the rate of the last interval swings between 0 and
    several times the true pace; the average since the start is steady, but it includes what comes
    before the first task ends (the read of a shuffle, the model's load on every worker) and made
    the early estimates long; the pace since the first counted line comes closer (measured:
    docs/operations.md, "Progress lines").
    """

    def __init__(self, started: float):
        self.started = started
        self._first: tuple[float, int] | None = None

    def users_per_s(self, now: float, rows: int | None) -> float | None:
        if not rows or now <= self.started:
            return None
        if self._first is None:
            self._first = (now, rows)
        first_at, first_rows = self._first
        if now > first_at and rows > first_rows:
            return (rows - first_rows) / (now - first_at)
        return rows / (now - self.started)


class LiveProgress:
    """Context manager: a progress line every ``interval_s`` while the block runs (0 or no session: nothing)."""

    def __init__(self, spark: Any | None, label: str, interval_s: float, expected_users: int | None = None):
        self.spark, self.label, self.interval_s, self.expected_users = spark, label, interval_s, expected_users
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._source: Any = None
        self.lines: list[str] = []

    def __enter__(self) -> "LiveProgress":
        if self.spark is None or self.interval_s <= 0:
            return self
        try:
            from recsys.spark.session import is_connect

            self._source = _ConnectSource(self.spark) if is_connect(self.spark) else _ClassicSource(self.spark)
        except Exception as exc:
            log.debug("no progress lines for %s: %s", self.label, exc)
            return self
        self._thread = threading.Thread(target=self._loop, name=f"progress {self.label}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if isinstance(self._source, _ConnectSource):
            self._source.close()

    def _loop(self) -> None:
        started = time.monotonic()
        pace = Pace(started)
        failed = False
        while not self._stop.wait(self.interval_s):
            try:
                snap = self._source.snapshot()
            except Exception as exc:
                if not failed:
                    log.debug("progress of %s unavailable: %s", self.label, exc)
                    failed = True
                continue
            now = time.monotonic()
            rate = pace.users_per_s(now, snap.rows)
            line = format_line(self.label, snap, elapsed=now - started, expected_users=self.expected_users,
                               users_per_s=rate)
            self.lines.append(line)
            log.info("%s", line)
