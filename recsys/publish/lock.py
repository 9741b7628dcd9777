"""One lock per output date, so two runs (a scheduler retry, an overlapping backfill) never both publish it.

Layout under ``paths.output`` (``_locks`` starts with ``_``, so Spark and Hive readers skip it)::

    _locks/dt=YYYY-MM-DD.lock                   JSON: run, token, host, pid, process start time, ttl;
                                                once the run's MLflow run exists, also its id and
                                                tracking store; its modification time is the heartbeat
    _locks/dt=YYYY-MM-DD.lock.ended-<token>     tombstone: the lock with that token was released or
                                                taken over (kept an hour, then tidied)

Taking the lock creates the file exclusively (written under a temporary name and hard-linked into
place, so it never appears half-written). A holder refreshes the heartbeat every ``ttl_s / 10``
seconds from a daemon thread.

A lock is **stale** when its process is gone (same host: the pid is not running, or runs another
program, told apart by the process start time) or when its heartbeat is older than ``ttl_s``
(any host: a killed container never comes back to say so). A live process on this host keeps its
lock however old the heartbeat, e.g. while stopped; it checks the lock is still its own right
before publishing (:meth:`DateLock.verify`).

Race-free takeover and release: the lock file is only ever deleted by the one process that first
created the tombstone ``ended-<token>`` for the token it read, exclusively. Two runs that find the
same stale lock both try; one creates the tombstone and replaces the lock, the other fails and
exits with LOCK_HELD. The owner's release goes through the same tombstone, so a takeover and a late
release cannot both delete. This is exact on local and POSIX shared filesystems (exclusive
create via ``link``). On object stores there is no exclusive create in pyarrow, so the lock is
emulated (write, then read back the token): best effort only - keep schedulers from overlapping
there (Airflow ``max_active_runs=1``, Kubernetes ``concurrencyPolicy: Forbid``).

A run that dies (SIGKILL, an OOM kill, a lost container) cannot end its MLflow run, which would stay
RUNNING forever. So the holder adds the id of its MLflow run to the lock once it exists
(:meth:`DateLock.annotate`), and the run that takes the stale lock over finds it in
:attr:`DateLock.took_over` and ends it (``recsys.pipelines.nightly``). Extra fields are optional both
ways: a lock without them (written before, or by a run whose MLflow run had not started) reads with
``None``, and older readers ignore them.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from recsys.uris import is_local_path, local_path
from recsys.data.contracts import partition_name
from recsys.errors import LockHeld
from recsys import fs as rfs
from recsys.processes import process_alive, process_start_time

log = logging.getLogger(__name__)

LOCKS_DIR = "_locks"
DEFAULT_TTL_S = 600.0          # a heartbeat older than this marks the lock stale (any host)
TOMBSTONE_KEEP_S = 3600.0      # how long ``ended-<token>`` files are kept before tidying


@dataclass(frozen=True)
class Holder:
    """What a lock file says about the run holding it."""

    run: str
    token: str
    host: str
    pid: int
    pid_started: float | None
    started_at: str
    ttl_s: float
    heartbeat_age_s: float
    mlflow_run_id: str | None = None    # the holder's MLflow run, once it started one (absent in older locks)
    tracking_store: str | None = None   # the store that run is in (recsys.tracking.store.tracking_store_id)

    def describe(self) -> str:
        return (f"run {self.run} (pid {self.pid} on {self.host}, started {self.started_at}, "
                f"last heartbeat {self.heartbeat_age_s:.0f}s ago)")


def lock_path(output_root: str, date: dt.date) -> str:
    return rfs.join(output_root, LOCKS_DIR, f"{partition_name(date)}.lock")


class DateLock:
    """The lock on one output date; a context manager that takes it and gives it back.

    Raises :class:`~recsys.errors.LockHeld` (exit code 4) when a live run holds it.
    """

    def __init__(self, output_root: str, date: dt.date, run: str, *, ttl_s: float = DEFAULT_TTL_S):
        self.date = date
        self.run = run
        self.ttl_s = float(ttl_s)
        self.path = lock_path(output_root, date)
        self.token = uuid.uuid4().hex
        self.took_over: Holder | None = None   # the stale holder this run replaced, if any
        self.took_over_reason: str | None = None   # why it was stale ("its process 123 on h is gone")
        self._annotations: dict[str, str] = {}
        self._started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self._store = _Store(self.path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False

    # -- taking and giving back -------------------------------------------------------------
    def acquire(self) -> "DateLock":
        self._store.ensure_parent()
        self._store.tidy_tombstones(TOMBSTONE_KEEP_S)
        for _ in range(3):   # a lock that vanishes between our attempts (released) is simply retried
            if self._store.create_exclusive(self.path, self._content()):
                self._held = True
                self._start_heartbeat()
                return self
            holder = self._store.read_holder(self.path)
            if holder is None:
                continue
            reason = stale_reason(holder)
            if reason is None:
                raise LockHeld(
                    f"{partition_name(self.date)} is locked by {holder.describe()}; another run is producing this date. "
                    f"Retry later; if no such run exists, the lock turns stale after ttl {holder.ttl_s:.0f}s "
                    f"({self.path})"
                )
            if not self._store.create_exclusive(self._tombstone(holder.token), json.dumps({"by": self.run, "why": reason})):
                raise LockHeld(f"{partition_name(self.date)}: another run is taking over the stale lock of "
                               f"{holder.describe()}; retry later ({self.path})")
            current = self._store.read_holder(self.path)
            if current is not None and current.token == holder.token:
                log.warning("taking over the lock on %s from %s: %s", partition_name(self.date), holder.describe(), reason)
                self._store.delete(self.path)
                self.took_over, self.took_over_reason = holder, reason
        raise LockHeld(f"could not take the lock {self.path} after 3 attempts; retry later")

    def release(self) -> None:
        """Give the lock back (only if it is still ours: after a takeover it belongs to someone else)."""
        self._stop_heartbeat()
        if not self._held:
            return
        self._held = False
        try:
            holder = self._store.read_holder(self.path)
            if holder is None or holder.token != self.token:
                log.warning("the lock on %s was taken over while this run held it", partition_name(self.date))
                return
            if self._store.create_exclusive(self._tombstone(self.token), json.dumps({"by": self.run, "why": "released"})):
                self._store.delete(self.path)
        except OSError as exc:  # a leftover lock turns stale by itself; not worth failing a published run
            log.warning("could not release the lock %s: %s", self.path, exc)

    def verify(self) -> None:
        """Raise LockHeld unless the lock file still carries this run's token (call right before publishing)."""
        holder = self._store.read_holder(self.path)
        if holder is None or holder.token != self.token:
            other = holder.describe() if holder else "nobody"
            raise LockHeld(f"this run lost the lock on {partition_name(self.date)} (now held by {other}); "
                           f"nothing was published")

    def annotate(self, *, mlflow_run_id: str, tracking_store: str) -> bool:
        """Record this run's MLflow run in the lock file, so that whoever finds this run dead can end it.

        The file is replaced whole (readers see the old or the new content, never a mix), and only while
        it still carries this run's token; False when it no longer does (taken over: :meth:`verify`
        says so before publishing). Raises OSError when the store cannot be written.
        """
        self._annotations = {"mlflow_run_id": mlflow_run_id, "tracking_store": tracking_store}
        holder = self._store.read_holder(self.path)
        if holder is None or holder.token != self.token:
            return False
        self._store.replace(self.path, self._content())
        return True

    def __enter__(self) -> "DateLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- internals ------------------------------------------------------------------------------
    def _tombstone(self, token: str) -> str:
        return f"{self.path}.ended-{token}"

    def _content(self) -> str:
        return json.dumps({
            "run": self.run, "token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
            "pid_started": process_start_time(),
            "started_at": self._started_at, "ttl_s": self.ttl_s, **self._annotations,
        })

    def beat(self) -> bool:
        """Refresh the heartbeat if the lock is still ours; False once it is not (then stop beating)."""
        try:
            holder = self._store.read_holder(self.path)
            if holder is None or holder.token != self.token:
                return False   # taken over: verify() will say so before publishing
            self._store.touch(self.path)
        except OSError as exc:
            log.warning("lock heartbeat failed for %s: %s", self.path, exc)
        return True

    def _start_heartbeat(self) -> None:
        interval = max(0.5, self.ttl_s / 10)

        def loop() -> None:
            while not self._stop.wait(interval) and self.beat():
                pass

        self._thread = threading.Thread(target=loop, name=f"lock-heartbeat-{self.date}", daemon=True)
        self._thread.start()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def stale_reason(holder: Holder, *, host: str | None = None) -> str | None:
    """Why ``holder``'s lock may be taken over, or None while it is live."""
    host = host or socket.gethostname()
    if holder.host == host and holder.pid > 0:
        if not process_alive(holder.pid, holder.pid_started):
            return f"its process {holder.pid} on {holder.host} is gone"
        return None
    if holder.heartbeat_age_s > holder.ttl_s:
        return f"no heartbeat for {holder.heartbeat_age_s:.0f}s (ttl {holder.ttl_s:.0f}s)"
    return None


def _text_or_none(value: Any) -> str | None:
    return str(value) if value else None


class _Store:
    """Exclusive create, read, touch and delete: exact on local filesystems, emulated elsewhere."""

    def __init__(self, path: str):
        self.local = is_local_path(path)
        self.fs, self.fs_path = rfs.resolve(path)
        self.dir = self.fs_path.rsplit("/", 1)[0]

    def _p(self, path: str) -> str:
        return str(local_path(path)) if self.local else rfs.resolve(path)[1]

    def ensure_parent(self) -> None:
        self.fs.create_dir(self.dir, recursive=True)

    def create_exclusive(self, path: str, text: str) -> bool:
        target = self._p(path)
        if self.local:
            return rfs.create_local_exclusive(target, text)   # exact: complete or not at all, one winner
        if rfs.exists(self.fs, target):   # object stores: best effort (see the module docstring)
            return False
        rfs.write_text_atomic(self.fs, target, text)
        return rfs.read_text(self.fs, target) == text   # a concurrent writer's text means it won

    def read_holder(self, path: str) -> Holder | None:
        target = self._p(path)
        info = self.fs.get_file_info(target)
        if info.type == pafs.FileType.NotFound:
            return None
        try:
            data = json.loads(rfs.read_text(self.fs, target))
        except (FileNotFoundError, OSError):
            return None
        except ValueError:
            data = {}
        mtime = info.mtime.timestamp() if info.mtime is not None else time.time()
        return Holder(
            run=str(data.get("run", "?")), token=str(data.get("token", f"unreadable-{info.mtime_ns}")),
            host=str(data.get("host", "?")), pid=int(data.get("pid") or 0), pid_started=data.get("pid_started"),
            started_at=str(data.get("started_at", "?")), ttl_s=float(data.get("ttl_s") or DEFAULT_TTL_S),
            heartbeat_age_s=max(0.0, time.time() - mtime),
            mlflow_run_id=_text_or_none(data.get("mlflow_run_id")), tracking_store=_text_or_none(data.get("tracking_store")),
        )

    def replace(self, path: str, text: str) -> None:
        """Replace the file's content in one step (a rename over it): readers never see it half-written."""
        rfs.write_text_atomic(self.fs, self._p(path), text)

    def touch(self, path: str) -> None:
        if self.local:
            os.utime(self._p(path))
        else:
            target = self._p(path)
            rfs.write_text_atomic(self.fs, target, rfs.read_text(self.fs, target))

    def delete(self, path: str) -> None:
        try:
            self.fs.delete_file(self._p(path))
        except FileNotFoundError:
            pass

    def tidy_tombstones(self, older_than_s: float) -> None:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.dir))
        except (FileNotFoundError, OSError):
            return
        now = time.time()
        for info in infos:
            if ".lock.ended-" in info.base_name and info.mtime is not None and now - info.mtime.timestamp() > older_than_s:
                try:
                    self.fs.delete_file(info.path)
                except OSError:
                    pass
