"""One lock per output date, so two runs (a scheduler retry, an overlapping backfill) never both publish it.

Layout under ``paths.output`` (``_locks`` starts with ``_``, so Spark and Hive readers skip it)::

    _locks/dt=YYYY-MM-DD.lock                   JSON: run, token, host, pid, process start time, ttl;
                                                once the run's MLflow run exists, also its id and
                                                tracking store; on object stores with conditional
                                                writes a write counter; its modification time is
                                                the heartbeat
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

Race-free takeover and release, in one of three ways, by what the store allows (``DateLock.kind``):

- **exclusive** (local and POSIX shared file systems): the lock file is only ever deleted by the one
  process that first created the tombstone ``ended-<token>`` for the token it read, exclusively. Two
  runs that find the same stale lock both try; one creates the tombstone and replaces the lock, the
  other fails and exits with LOCK_HELD. The owner's release goes through the same tombstone, so a
  takeover and a late release cannot both delete.
- **compare-and-set** (object stores that honour conditional writes, :mod:`recsys.conditional`): the
  lock is one object, created with ``If-None-Match: *`` and from then on written only with
  ``If-Match`` on an ETag: the holder's heartbeats and its check before publishing name the ETag of its
  own last write, a takeover names the ETag its judge read, and the release deletes (or marks released)
  only the object still carrying the holder's ETag. Of several runs racing for a free or stale lock
  exactly one write succeeds; a holder whose lock was taken over finds out at its next write. No
  tombstones are written.
- **best effort** (stores without conditional writes, or without boto3): emulated (write,
  then read back the token; tombstones through the same emulation). Said once per store in the log,
  and recorded with each run: keep schedulers from overlapping there (Airflow ``max_active_runs=1``,
  Kubernetes ``concurrencyPolicy: Forbid``).

On every store the lock is a lease: a holder stalled past its TTL (from another host's view) can be
replaced, and learns it at its next write, at the latest the check right before publishing; the
date's pointer is switched by a conditional write too (:mod:`recsys.publish.published`), so a stalled
run that passed its check still cannot switch the pointer over a newer run's.

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

from recsys import conditional
from recsys import fs as rfs
from recsys.data.contracts import partition_name
from recsys.errors import LockHeld
from recsys.processes import process_alive, process_start_time
from recsys.uris import is_local_path, local_path

log = logging.getLogger(__name__)

LOCKS_DIR = "_locks"
DEFAULT_TTL_S = 600.0          # a heartbeat older than this marks the lock stale (any host)
TOMBSTONE_KEEP_S = 3600.0      # how long ``ended-<token>`` files are kept before tidying

# What the lock promises on its store (``DateLock.kind``; recorded as the MLflow tag ``recsys.lock``)
EXCLUSIVE = "exclusive"              # local and POSIX shared file systems: an exclusive create (link)
COMPARE_AND_SET = "compare-and-set"  # object stores that honour conditional writes (S3, MinIO, R2, moto)
BEST_EFFORT = "best effort"          # other stores: written, then read back; runs must not overlap


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

    Raises :class:`~recsys.errors.LockHeld` (exit code 4) when a live run holds it. ``kind`` says what
    the store lets it promise: :data:`EXCLUSIVE`, :data:`COMPARE_AND_SET` or :data:`BEST_EFFORT`.
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
        self._store = _store_for(self.path)
        self.kind: str = self._store.kind
        self._writes = 0             # in the content on object stores: every write's text differs (see _CasStore)
        self._mutex = threading.Lock()   # the heartbeat thread and the run write the same object
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False

    # -- taking and giving back -------------------------------------------------------------
    def acquire(self) -> "DateLock":
        with self._mutex:
            self._take()
        self._start_heartbeat()
        return self

    def _take(self) -> None:
        name = partition_name(self.date)
        self._store.prepare()
        for _ in range(3):   # a lock that vanishes between our attempts (released) is simply retried
            if self._store.create(self._content()):
                self._held = True
                return
            found = self._store.read()
            if found is None:
                continue
            holder, version = found
            reason = stale_reason(holder)
            if reason is None:
                raise LockHeld(
                    f"{name} is locked by {holder.describe()}; another run is producing this date. "
                    f"Retry later; if no such run exists, the lock turns stale after ttl {holder.ttl_s:.0f}s "
                    f"({self.path})"
                )
            tombstone = json.dumps({"by": self.run, "why": reason})
            outcome = self._store.take_over(holder, version, self._content(), tombstone)
            if outcome == _LOST:
                now = self._store.read()
                other = f"; it is now held by {now[0].describe()}" if now and now[0].token != holder.token else ""
                raise LockHeld(f"{name}: another run is taking over the stale lock of {holder.describe()}{other}; "
                               f"retry later ({self.path})")
            if outcome in (_TAKEN, _CLEARED):
                log.warning("taking over the lock on %s from %s: %s", name, holder.describe(), reason)
                self.took_over, self.took_over_reason = holder, reason
            if outcome == _TAKEN:
                self._held = True
                return
        raise LockHeld(f"could not take the lock {self.path} after 3 attempts; retry later")

    def release(self) -> None:
        """Give the lock back (only if it is still ours: after a takeover it belongs to someone else)."""
        self._stop_heartbeat()
        with self._mutex:
            if not self._held:
                return
            self._held = False
            try:
                why = json.dumps({"by": self.run, "why": "released"})
                if not self._store.release(self.token, self._content(), why):
                    log.warning("the lock on %s was taken over while this run held it", partition_name(self.date))
            except OSError as exc:  # a leftover lock turns stale by itself; not worth failing a published run
                log.warning("could not release the lock %s: %s", self.path, exc)

    def verify(self) -> None:
        """Raise LockHeld unless the lock is still this run's (call right before publishing).

        On an object store with conditional writes this is itself a conditional write (a heartbeat
        naming the ETag this run last wrote): it succeeds only if no other run has written the lock since.
        """
        with self._mutex:
            if self._store.confirm(self.token, self._content()):
                return
            found = self._store.read()
        other = found[0].describe() if found and found[0].token != self.token else "nobody"
        raise LockHeld(f"this run lost the lock on {partition_name(self.date)} (now held by {other}); "
                       f"nothing was published")

    def annotate(self, *, mlflow_run_id: str, tracking_store: str) -> bool:
        """Record this run's MLflow run in the lock, so that whoever finds this run dead can end it.

        The lock is replaced whole (readers see the old or the new content, never a mix), and only while
        it is still this run's; False when it no longer is (taken over: :meth:`verify` says so before
        publishing). Raises OSError when the store cannot be written.
        """
        with self._mutex:
            self._annotations = {"mlflow_run_id": mlflow_run_id, "tracking_store": tracking_store}
            return self._store.rewrite(self.token, self._content())

    def __enter__(self) -> "DateLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- internals ------------------------------------------------------------------------------
    def _content(self) -> str:
        fields: dict[str, Any] = {
            "run": self.run, "token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
            "pid_started": process_start_time(),
            "started_at": self._started_at, "ttl_s": self.ttl_s, **self._annotations,
        }
        if self.kind == COMPARE_AND_SET:
            self._writes += 1
            fields["write"] = self._writes
        return json.dumps(fields)

    def beat(self) -> bool:
        """Refresh the heartbeat if the lock is still ours; False once it is not (then stop beating)."""
        with self._mutex:
            if not self._held:
                return False
            try:
                return self._store.renew(self.token, self._content())
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


_TAKEN, _CLEARED, _RETRY, _LOST = "taken", "cleared", "retry", "lost"   # outcomes of take_over


def _store_for(path: str) -> "_FileStore | _CasStore":
    """Where the lock lives, and what that store lets it promise (said once per store by recsys.conditional)."""
    if is_local_path(path):
        return _FileStore(path, exact=True)
    target = conditional.open_object(path)
    return _CasStore(path, target) if target is not None else _FileStore(path, exact=False)


def _holder(data: dict[str, Any], modified: float | None, unreadable: str) -> Holder:
    mtime = modified if modified is not None else time.time()
    return Holder(
        run=str(data.get("run", "?")), token=str(data.get("token", f"unreadable-{unreadable}")),
        host=str(data.get("host", "?")), pid=int(data.get("pid") or 0), pid_started=data.get("pid_started"),
        started_at=str(data.get("started_at", "?")), ttl_s=float(data.get("ttl_s") or DEFAULT_TTL_S),
        heartbeat_age_s=max(0.0, time.time() - mtime),
        mlflow_run_id=_text_or_none(data.get("mlflow_run_id")),
        tracking_store=_text_or_none(data.get("tracking_store")),
    )


def _parse(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class _CasStore:
    """The lock as one object written only by conditional writes: every step is one compare-and-set.

    Taken with ``If-None-Match: *``; every later write (heartbeat, annotation, the check before publishing)
    names the ETag this run last wrote (``If-Match``), so it fails once any other run has written the lock;
    a stale lock is replaced naming the ETag its judge read, so of several runs that judged it stale exactly
    one replaces it. Released by a conditional delete, or where the store has none, by replacing it with a
    ``released`` marker that the next run takes like an absent lock. Each text written carries a counter
    (``write``): two writes never have the same ETag, so a heartbeat cannot make an old ETag match again.
    """

    kind = COMPARE_AND_SET

    def __init__(self, path: str, target: conditional.ConditionalObject):
        self.path = path
        self.target = target
        self.etag: str | None = None     # of this run's last write, while it holds the lock

    def prepare(self) -> None:
        pass    # object stores have no directories to make; no tombstones are written

    def create(self, text: str) -> bool:
        etag = self.target.create(text)
        if etag is None:
            current = self.target.read()
            if current is not None and _parse(current.text).get("released"):
                etag = self.target.replace(text, current.etag)
        self.etag = etag or self.etag
        return etag is not None

    def read(self) -> tuple[Holder, str] | None:
        current = self.target.read()
        if current is None:
            return None
        data = _parse(current.text)
        if data.get("released"):
            return None
        return _holder(data, current.modified, current.etag), current.etag

    def take_over(self, holder: Holder, version: str | None, text: str, why: str) -> str:
        etag = self.target.replace(text, version or "")
        if etag is None:
            return _LOST
        self.etag = etag
        return _TAKEN

    def renew(self, token: str, text: str) -> bool:
        if self.etag is None:
            return False
        etag = self.target.replace(text, self.etag)
        if etag is None:
            mine = self._still_mine(token)
            etag = self.target.replace(text, mine) if mine else None
        if etag is None:
            return False
        self.etag = etag
        return True

    rewrite = renew
    confirm = renew

    def release(self, token: str, text: str, why: str) -> bool:
        if self.etag is None:
            return False
        etag, self.etag = self.etag, None
        if self.target.conditional_delete:
            if self.target.delete(etag):
                return True
            mine = self._still_mine(token)
            return bool(mine) and self.target.delete(mine)
        released = json.dumps({**_parse(text), "released": True, "why": json.loads(why)})
        if self.target.replace(released, etag) is not None:
            return True
        mine = self._still_mine(token)
        return bool(mine) and self.target.replace(released, mine) is not None

    def _still_mine(self, token: str) -> str | None:
        """The ETag of the lock if it still carries this run's token (only this run writes that token: its own
        earlier write succeeded though its answer was lost), else None (another run's lock, or none)."""
        current = self.target.read()
        if current is None:
            return None
        data = _parse(current.text)
        return current.etag if data.get("token") == token and not data.get("released") else None


class _FileStore:
    """Exclusive create, read, touch and delete: exact on local filesystems, emulated elsewhere."""

    def __init__(self, path: str, *, exact: bool):
        self.path = path
        self.local = is_local_path(path)
        self.kind = EXCLUSIVE if exact else BEST_EFFORT
        self.fs, self.fs_path = rfs.resolve(path)
        self.dir = self.fs_path.rsplit("/", 1)[0]

    # -- the lock's steps (see DateLock) ---------------------------------------------------------
    def prepare(self) -> None:
        self.ensure_parent()
        self.tidy_tombstones(TOMBSTONE_KEEP_S)

    def create(self, text: str) -> bool:
        return self.create_exclusive(self.path, text)

    def read(self) -> tuple[Holder, None] | None:
        holder = self.read_holder(self.path)
        return (holder, None) if holder is not None else None

    def take_over(self, holder: Holder, version: str | None, text: str, why: str) -> str:
        """Only the run that creates the stale token's tombstone first may delete the lock."""
        if not self.create_exclusive(self._tombstone(holder.token), why):
            return _LOST
        current = self.read_holder(self.path)
        if current is not None and current.token == holder.token:
            self.delete(self.path)
            return _CLEARED
        return _RETRY

    def renew(self, token: str, text: str) -> bool:
        holder = self.read_holder(self.path)
        if holder is None or holder.token != token:
            return False   # taken over: verify() will say so before publishing
        self.touch(self.path)
        return True

    def rewrite(self, token: str, text: str) -> bool:
        holder = self.read_holder(self.path)
        if holder is None or holder.token != token:
            return False
        self.replace(self.path, text)
        return True

    def confirm(self, token: str, text: str) -> bool:
        holder = self.read_holder(self.path)
        return holder is not None and holder.token == token

    def release(self, token: str, text: str, why: str) -> bool:
        holder = self.read_holder(self.path)
        if holder is None or holder.token != token:
            return False
        if self.create_exclusive(self._tombstone(token), why):
            self.delete(self.path)
        return True

    def _tombstone(self, token: str) -> str:
        return f"{self.path}.ended-{token}"

    # -- file operations ----------------------------------------------------------------------
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
            text = rfs.read_text(self.fs, target)
        except (FileNotFoundError, OSError):
            return None
        return _holder(_parse(text), info.mtime.timestamp() if info.mtime is not None else None, str(info.mtime_ns))

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
