"""The published lists in Redis: the key layout, the versions, the pointer readers follow, and the export lock.

Keys, for ``export.prefix`` P (docs/export.md gives the same with examples)::

    P:current          hash    the pointer: version, date, model_version, run, run_id, catalog_snapshot,
                               sources (JSON list), fallback_name, users, switched_at, format
    P:versions         hash    version -> JSON record: state (writing | live | removing), date, run, figures
    P:seq              string  counter minting version numbers (INCR)
    P:lock             string  the export lock: JSON {token, host, pid, pid_started, started_at}, with a TTL
    P:vN:<user_id>     string  one user's list (binary, :mod:`recsys.export.encoding`)
    P:vN:_fallback     string  the list for users missing from version N (same encoding)
    P:vN:_files        hash    data file -> users written from it: what makes version N complete

A version is written into keys of its own (``P:vN:*``) while readers keep following the pointer to the
previous one; only when every file's users are written, and counted, does one Lua script move the
pointer (:func:`switch`): a reader sees the old version or the new one, never a mix. Readers that
want each answer to come from one version in one step use :data:`LOOKUP_SCRIPT`, which reads the
pointer and the users' keys atomically (a script runs alone in Redis).

Only the export lock's holder writes versions or moves the pointer; a version in state ``writing`` that
the lock holder did not start belongs to a dead export and is removed (:func:`remove_version`).
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
from dataclasses import dataclass, field
from typing import Any, Mapping

from recsys.errors import LockHeld, RecsysError, first_line
from recsys.processes import process_alive, process_start_time
from recsys.redaction import redact_uri

log = logging.getLogger(__name__)

FORMAT = 1
FALLBACK_KEY = "_fallback"
FILES_KEY = "_files"
WRITING, LIVE, REMOVING = "writing", "live", "removing"


class StoreUnavailable(RecsysError):
    """Redis cannot be reached or stopped answering: nothing was switched; a retry may help (exit 1)."""


@dataclass(frozen=True)
class Keyspace:
    """Where each part of the export lives, for one prefix."""

    prefix: str

    @property
    def pointer(self) -> str:
        return f"{self.prefix}:current"

    @property
    def versions(self) -> str:
        return f"{self.prefix}:versions"

    @property
    def seq(self) -> str:
        return f"{self.prefix}:seq"

    @property
    def lock(self) -> str:
        return f"{self.prefix}:lock"

    def version_prefix(self, version: str) -> bytes:
        """``P:vN:``: a user's key is this followed by the user id in decimal."""
        return f"{self.prefix}:{version}:".encode()

    def user_key(self, version: str, user_id: int) -> bytes:
        return self.version_prefix(version) + str(int(user_id)).encode()

    def fallback_key(self, version: str) -> str:
        return f"{self.prefix}:{version}:{FALLBACK_KEY}"

    def files_key(self, version: str) -> str:
        return f"{self.prefix}:{version}:{FILES_KEY}"

    def version_pattern(self, version: str) -> str:
        return f"{self.prefix}:{version}:*"   # the prefix is [A-Za-z0-9_.-], so nothing in it is a glob


def connect(url: str, timeout_s: float):
    """A client for ``url`` that has answered a PING; StoreUnavailable (exit 1) naming the store if not."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      health_check_interval=30)
        client.ping()
    except redis.RedisError as exc:
        raise StoreUnavailable(f"Redis at {redact_uri(url)} is unavailable: {first_line(exc)}; nothing was exported "
                               f"and the pointer is unchanged (a retry may help)") from None
    return client


def unavailable(url: str, exc: BaseException, doing: str) -> StoreUnavailable:
    return StoreUnavailable(f"Redis at {redact_uri(url)} failed while {doing}: {first_line(exc, with_type=True)}; "
                            f"the pointer is unchanged (a retry may help)")


# ---------------------------------------------------------------------------------------------------
# the pointer and the versions


@dataclass(frozen=True)
class Pointer:
    """What readers follow, as the pointer hash holds it."""

    version: str
    date: dt.date
    model_version: str
    run: str
    run_id: str | None
    catalog_snapshot: str
    sources: tuple[str, ...]
    fallback_name: str
    users: int
    switched_at: str

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str]) -> "Pointer | None":
        fields = {_text(k): _text(v) for k, v in raw.items()}
        if not fields.get("version"):
            return None
        return cls(version=fields["version"], date=dt.date.fromisoformat(fields["date"]),
                   model_version=fields.get("model_version", ""), run=fields.get("run", ""),
                   run_id=fields.get("run_id") or None, catalog_snapshot=fields.get("catalog_snapshot", ""),
                   sources=tuple(json.loads(fields.get("sources") or '["model"]')),
                   fallback_name=fields.get("fallback_name", ""), users=int(fields.get("users") or 0),
                   switched_at=fields.get("switched_at", ""))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_pointer(client, keys: Keyspace) -> Pointer | None:
    return Pointer.from_hash(client.hgetall(keys.pointer))


def read_versions(client, keys: Keyspace) -> dict[str, dict[str, Any]]:
    """Every registered version -> its record, oldest first."""
    raw = {_text(k): json.loads(v) for k, v in client.hgetall(keys.versions).items()}
    return dict(sorted(raw.items(), key=lambda kv: version_number(kv[0])))


def version_number(version: str) -> int:
    return int(version[1:]) if version[:1] == "v" and version[1:].isdigit() else -1


def begin_version(client, keys: Keyspace, record: Mapping[str, Any]) -> str:
    """Mint the next version and register it as being written (so a dead export's keys can be found)."""
    version = f"v{int(client.incr(keys.seq))}"
    client.hset(keys.versions, version, json.dumps({**record, "state": WRITING, "created_at": _now()}))
    return version


def update_version(client, keys: Keyspace, version: str, **changes: Any) -> None:
    raw = client.hget(keys.versions, version)
    record = json.loads(raw) if raw else {}
    client.hset(keys.versions, version, json.dumps({**record, **changes}))


# KEYS: pointer, versions, lock, files. ARGV: lock value, expected current version ("" for none), version,
# files expected, the version's record (JSON), then the pointer's fields as name, value pairs.
_SWITCH = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return 'lock' end
local current = redis.call('HGET', KEYS[1], 'version') or ''
if current ~= ARGV[2] then return 'moved:' .. current end
local files = redis.call('HLEN', KEYS[4])
if files ~= tonumber(ARGV[4]) then return 'files:' .. files end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('HSET', KEYS[2], ARGV[3], ARGV[5])
return 'ok'
"""


class SwitchRefused(RecsysError):
    """The pointer was not moved: the lock was lost, another export moved it, or the version is incomplete."""


@dataclass(frozen=True)
class Switch:
    """What one switch makes current: ``version``, complete once all its ``files`` are recorded as written;
    the pointer's fields readers will see, and the version's record (its state becomes live)."""

    version: str
    files: int
    pointer: Mapping[str, Any]
    record: Mapping[str, Any]


def switch(client, keys: Keyspace, lock: "ExportLock", to: Switch, expected_current: str | None) -> None:
    """Point readers at ``to.version``, in one step, if this export still holds the lock, the pointer is still
    where it was when the export started (``expected_current``), and all files of the version are recorded
    as written."""
    version, files = to.version, to.files
    fields: list[str] = []
    for name, value in to.pointer.items():
        fields += [name, value if isinstance(value, str) else json.dumps(value)]
    answer = _text(client.eval(_SWITCH, 4, keys.pointer, keys.versions, keys.lock, keys.files_key(version),
                               lock.value, expected_current or "", version, files,
                               json.dumps({**to.record, "state": LIVE}), *fields))
    if answer == "ok":
        return
    if answer == "lock":
        raise LockHeld(f"the export lock {keys.lock} was lost before the switch (its TTL ran out, or another "
                       f"export took it over); version {version} was not switched to: retry later")
    if answer.startswith("moved:"):
        raise LockHeld(f"another export moved the pointer to {answer[6:] or 'nothing'} while this one wrote "
                       f"{version}; nothing was switched: retry later")
    raise SwitchRefused(f"version {version} is incomplete in Redis ({answer[6:]} of {files} files recorded: was "
                        f"Redis restarted without persistence?); nothing was switched, a retry rewrites it")


def remove_version(client, keys: Keyspace, version: str, scan_count: int = 50_000) -> int:
    """Delete every key of ``version``, then its registration; returns how many keys went.

    Marked ``removing`` first, so an export killed half-way through leaves a version the next export
    finds and finishes removing. UNLINK frees the memory in Redis's background thread.
    """
    if client.hget(keys.versions, version) is not None:
        update_version(client, keys, version, state=REMOVING)
    removed, cursor = 0, 0
    while True:   # each SCAN step's keys are unlinked at once: one round trip each, no per-key Python
        cursor, found = client.scan(cursor, match=keys.version_pattern(version), count=scan_count)
        if found:
            removed += client.unlink(*found)
        if int(cursor) == 0:
            break
    client.hdel(keys.versions, version)
    return removed


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------
# reading


# KEYS[1]: the pointer. ARGV[1]: the key prefix ("P:"), ARGV[2..]: user ids. Returns the version, then one
# value per user (nil where missing), then the fallback list if any user was missing (nil otherwise).
LOOKUP_SCRIPT = """
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {false} end
local base = ARGV[1] .. version .. ':'
local out = {version}
local missing = false
for i = 2, #ARGV do
  local value = redis.call('GET', base .. ARGV[i])
  if not value then missing = true end
  out[i] = value
end
if missing then out[#ARGV + 1] = redis.call('GET', base .. '_fallback') else out[#ARGV + 1] = false end
return out
"""


# ---------------------------------------------------------------------------------------------------
# the export lock


@dataclass
class ExportLock:
    """One export at a time per prefix: ``SET P:lock ... NX PX ttl``, renewed by a daemon thread.

    A lock whose TTL ran out is free (its holder died on another host, or stopped renewing). A lock held by
    a process of this host that is no longer running (killed, e.g. while Redis was down and could not be
    told) is taken over at once. Anything else raises LockHeld (exit 4: retry later).
    """

    client: Any
    keys: Keyspace
    ttl_s: float
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    value: str = ""
    took_over: dict[str, Any] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    lost: bool = False

    def acquire(self) -> "ExportLock":
        self.value = json.dumps({"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                                 "pid_started": process_start_time(), "started_at": _now()}, sort_keys=True)
        ttl_ms = int(self.ttl_s * 1000)
        for _ in range(3):
            if self.client.set(self.keys.lock, self.value, nx=True, px=ttl_ms):
                self._start()
                return self
            held = self.client.get(self.keys.lock)
            if held is None:
                continue   # released between the two calls
            holder = _holder(held)
            reason = _dead_here(holder)
            if reason is None:
                ttl = self.client.pttl(self.keys.lock)
                raise LockHeld(f"another export holds {self.keys.lock}: pid {holder.get('pid')} on "
                               f"{holder.get('host')}, since {holder.get('started_at')} (it expires "
                               f"{max(0, ttl) / 1000:.0f}s after its holder stops renewing it); retry later")
            if self.client.eval(_DELETE_IF, 1, self.keys.lock, held) == 1:
                self.took_over = holder
                log.warning("took over the export lock %s: %s", self.keys.lock, reason)
        raise LockHeld(f"could not take the export lock {self.keys.lock}; retry later")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.client.eval(_DELETE_IF, 1, self.keys.lock, self.value)
        except Exception as exc:  # Redis down: the lock expires after its TTL, or is taken over (same host)
            log.warning("could not release the export lock %s: %s", self.keys.lock, first_line(exc))

    def _start(self) -> None:
        def renew() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    if self.client.eval(_EXPIRE_IF, 1, self.keys.lock, self.value, int(self.ttl_s * 1000)) != 1:
                        self.lost = True
                        log.warning("the export lock %s is no longer ours", self.keys.lock)
                        return
                except Exception as exc:   # the export itself will fail on the same Redis
                    log.debug("could not renew the export lock: %s", exc)

        self._thread = threading.Thread(target=renew, name="recsys-export-lock", daemon=True)
        self._thread.start()

    def __enter__(self) -> "ExportLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_DELETE_IF = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"
_EXPIRE_IF = ("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) "
              "else return 0 end")


def _holder(raw: bytes | str) -> dict[str, Any]:
    try:
        return json.loads(raw)
    except ValueError:
        return {}


def _dead_here(holder: Mapping[str, Any]) -> str | None:
    """Why the holder is known dead (its process on this host is gone or is another program), or None."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return None
    pid = holder["pid"]
    if not process_alive(pid):
        return f"its process {pid} on {holder['host']} is gone"
    started = holder.get("pid_started")
    if started is not None and not process_alive(pid, float(started)):
        return f"process {pid} on {holder['host']} is another program now"
    return None


def wait_s(start: float) -> float:
    return time.perf_counter() - start
