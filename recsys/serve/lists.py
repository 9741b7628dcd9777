"""Where ``recsys serve`` looks published lists up: Redis (the version its pointer names) or an in-process index.

- :class:`RedisLists` (``serve.store: redis://...``): lookups are calls of
  :data:`recsys.export.redis_store.LOOKUP_SCRIPT`, which reads the pointer and the users' keys in one
  step, so every answer comes from one version even while an export switches the pointer; values are
  decoded with :mod:`recsys.export.encoding`. Lookups that arrive while a call is in flight share the
  next call (one round trip for all of them: at 32 clients the asyncio client's cost per call, not Redis,
  was the limit). A version's date and model version are read once per version and kept.
- :class:`EmbeddedLists` (``serve.store: embedded``, the default): the newest published night under
  ``paths.output`` (:func:`recsys.publish.published.latest_published`: the run directory the date's
  pointer names, which never changes while it is published; the frontend runs no Spark, so it follows the
  pointer rather than ``output.table``: the pointer is written right after the table's partition, and a run
  killed between the two is brought in line by the date's next run), read with pyarrow into sorted
  numpy arrays (user ids, list offsets, item ids, scores); a lookup is a binary search. A newer
  night (another date, or a rerun or rollback of the same date: another run) is loaded beside the served
  one and swapped in with one assignment, so a lookup uses one index from start to end. Memory: about 12
  bytes per listed item (1M users x top 100: 1.2 GB).

Both answer ``lookup(users, top_n)`` with the rows found, the users missing, and the version's fallback
list for them; both raise :class:`StoreDown` with the reason when they cannot answer.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from recsys.errors import first_line
from recsys.redaction import redact_uri

log = logging.getLogger(__name__)


class StoreDown(Exception):
    """The list store cannot answer now (unreachable, empty, not loaded yet); the message says why."""


@dataclass(frozen=True)
class ListVersion:
    """Which published lists an answer came from."""

    store: str                # "redis" | "embedded"
    version: str              # redis: vN; embedded: the run that published the partition
    date: str                 # the published date
    model_version: str
    catalog_snapshot: str
    sources: tuple[str, ...]

    def describe(self) -> dict[str, Any]:
        return {"store": self.store, "version": self.version, "date": self.date, "model_version": self.model_version,
                "catalog_snapshot": self.catalog_snapshot}


@dataclass(frozen=True)
class Found:
    version: ListVersion
    rows: dict[int, dict[str, Any]]        # user -> {"recommendations": [...], "source": ...}
    missing: list[int]
    fallback: dict[str, Any] | None        # the row users missing from the lists get, if the version has one


def _recs(ids: Sequence[int], scores: Sequence[float]) -> list[dict[str, Any]]:
    return [{"item_id": i, "score": s} for i, s in zip(ids, scores)]


# ---------------------------------------------------------------------------------------------------
# Redis


class RedisLists:
    kind = "redis"

    def __init__(self, url: str, prefix: str, timeout_ms: int):
        import redis
        import redis.asyncio as aioredis

        from recsys.export.redis_store import LOOKUP_SCRIPT, Keyspace

        self.url = url
        self.where = redact_uri(url)
        self.keys = Keyspace(prefix)
        self._key_prefix = f"{prefix}:"
        timeout = timeout_ms / 1000
        # a blocking pool: more concurrent lookups than connections wait for one (up to the timeout) instead
        # of failing as "too many connections"
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=timeout,
                                                        socket_timeout=timeout, socket_connect_timeout=timeout)
        self._async = aioredis.Redis(connection_pool=pool)
        self._script = self._async.register_script(LOOKUP_SCRIPT)
        self._sync = redis.Redis.from_url(url, socket_timeout=max(timeout, 2.0), socket_connect_timeout=max(timeout, 2.0))
        self._versions: dict[str, ListVersion] = {}
        self._lock = threading.Lock()
        self.current: ListVersion | None = None
        self.error: str | None = "not checked yet"
        self._waiting: list[tuple[Sequence[int], Any]] = []   # (users, future) for the next script call
        self._calling = False

    # -- maintenance thread ----------------------------------------------------------------------

    def refresh(self) -> bool:
        """Read the pointer (blocking); True if the version it names changed."""
        from recsys.export.redis_store import read_pointer

        try:
            pointer = read_pointer(self._sync, self.keys)
        except Exception as exc:
            self._down(f"Redis at {self.where} is unavailable: {first_line(exc)}")
            return False
        if pointer is None:
            self._down(f"Redis at {self.where} serves no version under {self.keys.pointer} yet; run `recsys export`")
            return False
        version = ListVersion(self.kind, pointer.version, str(pointer.date), pointer.model_version,
                              pointer.catalog_snapshot, pointer.sources)
        with self._lock:
            self._versions.setdefault(version.version, version)
        changed = self.current is None or self.current.version != version.version
        self.current, self.error = version, None
        return changed

    def _down(self, reason: str) -> None:
        if self.error is None:
            log.warning("list store down: %s", reason)
        self.error = reason

    # -- requests ---------------------------------------------------------------------------------

    async def lookup(self, users: Sequence[int], top_n: int) -> Found:
        import asyncio

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((users, future))
        if not self._calling:       # a dispatcher task serves whatever is waiting, one script call at a time
            self._calling = True
            loop.create_task(self._dispatch())
        version, values, raw_fallback = await future
        return self._found(version, users, values, raw_fallback, top_n)

    async def _dispatch(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                await self._call(batch)
        finally:
            self._calling = False

    async def _call(self, batch: list[tuple[Sequence[int], Any]]) -> None:
        """One script call for every waiting lookup: each gets its users' values, all from one version."""
        ids = list(dict.fromkeys(u for users, _ in batch for u in users))
        try:
            reply = await self._script(keys=[self.keys.pointer], args=[self._key_prefix, *ids])
            if not reply or reply[0] is None:
                raise StoreDown(f"Redis at {self.where} serves no version under {self.keys.pointer}; "
                                f"run `recsys export`")
            version = await self._version(reply[0].decode())
        except Exception as exc:
            reason = str(exc) if isinstance(exc, StoreDown) else \
                f"Redis at {self.where} is unavailable: {first_line(exc, with_type=True)}"
            self._down(reason)
            for _, future in batch:
                if not future.done():
                    future.set_exception(StoreDown(reason))
            return
        if self.error is not None:
            self.error = None
        values = dict(zip(ids, reply[1:1 + len(ids)]))
        fallback = reply[1 + len(ids)] if len(reply) > 1 + len(ids) else None
        for users, future in batch:
            if not future.done():
                future.set_result((version, values, fallback))

    def _found(self, version: "ListVersion", users: Sequence[int], values: dict, raw_fallback, top_n: int) -> Found:
        from recsys.export.encoding import decode

        rows, missing = {}, []
        for user, value in ((u, values.get(u)) for u in users):
            if value is None:
                missing.append(user)
                continue
            decoded = decode(value)
            rows[user] = {"recommendations": _recs(decoded.item_ids[:top_n].tolist(), decoded.scores[:top_n].tolist()),
                          "source": version.sources[decoded.source]}
        fallback = None
        if missing and raw_fallback is not None:
            decoded = decode(raw_fallback)
            fallback = {"recommendations": _recs(decoded.item_ids[:top_n].tolist(), decoded.scores[:top_n].tolist()),
                        "source": version.sources[decoded.source]}
        return Found(version, rows, missing, fallback)

    async def _version(self, name: str) -> ListVersion:
        known = self._versions.get(name)
        if known is not None:
            return known
        raw = await self._async.hget(self.keys.versions, name)
        record = json.loads(raw) if raw else {}
        version = ListVersion(self.kind, name, str(record.get("date", "")), str(record.get("model_version", "")),
                              str(record.get("catalog_snapshot", "")), tuple(record.get("sources") or ("model",)))
        with self._lock:
            self._versions[name] = version
            if len(self._versions) > 64:   # versions come and go with exports; a few are enough
                self._versions.pop(next(iter(self._versions)))
        return version

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"store": self.kind, "url": self.where, "prefix": self.keys.prefix}
        if self.current is not None:
            out.update(self.current.describe())
        return {**out, "up": self.error is None, "reason": self.error}

    async def close(self) -> None:
        try:
            await self._async.aclose(close_connection_pool=True)
        finally:
            self._sync.close()


# ---------------------------------------------------------------------------------------------------
# the embedded index


@dataclass(frozen=True)
class _Index:
    version: ListVersion
    key: tuple
    user_ids: np.ndarray      # [U] int64, sorted
    offsets: np.ndarray       # [U + 1] int64
    item_ids: np.ndarray      # [sum of lengths] int64
    scores: np.ndarray        # [sum of lengths] float32
    sources: np.ndarray       # [U] uint8 indices into version.sources
    fallback: tuple[list[int], list[float], str] | None
    load_s: float

    @property
    def users(self) -> int:
        return len(self.user_ids)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.user_ids, self.offsets, self.item_ids, self.scores, self.sources))


def load_index(published) -> _Index:
    """A published partition (:class:`recsys.publish.published.PublishedPartition`) -> the sorted arrays."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from recsys import fs as rfs

    started = time.perf_counter()
    tables = []
    for path in published.files():
        fs, inner = rfs.resolve(path)
        with fs.open_input_file(inner) as f:
            tables.append(pq.read_table(f, columns=["user_id", "recommendations", "source"]))
    table = pa.concat_tables(tables) if tables else None
    sources = tuple(published.sources)
    if table is None or table.num_rows == 0:
        empty = np.zeros(0, np.int64)
        arrays = (empty, np.zeros(1, np.int64), empty, np.zeros(0, np.float32), np.zeros(0, np.uint8))
    else:
        table = table.take(pc.sort_indices(table, [("user_id", "ascending")]))
        recs = table.column("recommendations").combine_chunks()
        offsets = recs.offsets.to_numpy().astype(np.int64)
        flat = recs.values.slice(offsets[0], offsets[-1] - offsets[0])
        codes = table.column("source").combine_chunks().dictionary_encode()
        names = codes.dictionary.to_pylist()
        sources = tuple(dict.fromkeys([*sources, *names]))
        lookup = np.array([sources.index(n) for n in names] or [0], np.uint8)
        arrays = (table.column("user_id").to_numpy().astype(np.int64), offsets - offsets[0],
                  flat.field("item_id").to_numpy(zero_copy_only=False).astype(np.int64),
                  flat.field("score").to_numpy(zero_copy_only=False).astype(np.float32),
                  lookup[codes.indices.to_numpy(zero_copy_only=False)])
    fallback = published.fallback
    fb = (list(fallback.item_ids), list(fallback.scores), fallback.name) if fallback is not None else None
    version = ListVersion("embedded", published.run, str(published.date), published.model_version,
                          published.catalog_snapshot, sources)
    return _Index(version, (published.date, published.run), *arrays, fb, time.perf_counter() - started)


@dataclass
class EmbeddedLists:
    kind = "embedded"
    output_root: str
    index: _Index | None = None
    error: str | None = "not loaded yet"
    _checked: Any = field(default=None, repr=False)

    @property
    def current(self) -> ListVersion | None:
        index = self.index
        return index.version if index is not None else None

    def refresh(self) -> bool:
        """Load the newest published partition if it is not the one served (blocking); True if swapped."""
        from recsys.publish.published import latest_published

        try:
            latest = latest_published(self.output_root)
        except Exception as exc:
            return self._failed(f"cannot list the published partitions under {redact_uri(self.output_root)}: "
                                f"{first_line(exc)}")
        if latest is None:
            if self.index is None:
                self.error = f"nothing is published under {redact_uri(self.output_root)} yet"
            return False
        if self.index is not None and self.index.key == (latest.date, latest.run):
            self.error = None
            return False
        refusal = latest.refusal()
        if refusal:
            return self._failed(f"not serving {latest.date}: {refusal}")
        try:
            index = load_index(latest)
        except Exception as exc:
            return self._failed(f"cannot read the published partition {redact_uri(latest.path)}: "
                                f"{first_line(exc, with_type=True)}")
        self.index, self.error = index, None     # one assignment: a lookup in flight keeps the index it took
        log.info("embedded lists: serving %s (run %s, model version %s): %d users, %.0f MiB, loaded in %.1fs",
                 latest.date, latest.run, latest.model_version, index.users, index.nbytes / 2**20, index.load_s)
        return True

    def _failed(self, reason: str) -> bool:
        if self.index is None or self.error != reason:
            log.warning("embedded lists: %s%s", reason, "; still serving the partition loaded before"
                        if self.index is not None else "")
        self.error = reason if self.index is None else None
        return False

    async def lookup(self, users: Sequence[int], top_n: int) -> Found:
        return self.lookup_now(users, top_n)

    def lookup_now(self, users: Sequence[int], top_n: int) -> Found:
        index = self.index
        if index is None:
            raise StoreDown(self.error or "no published partition is loaded")
        query = np.asarray(users, dtype=np.int64)
        pos = np.searchsorted(index.user_ids, query)
        pos_ok = np.minimum(pos, max(0, index.users - 1))
        hit = (pos < index.users) & (index.user_ids[pos_ok] == query) if index.users else np.zeros(len(query), bool)
        rows, missing = {}, []
        sources = index.version.sources
        for user, p, ok in zip(users, pos_ok.tolist(), hit.tolist()):
            if not ok:
                missing.append(user)
                continue
            a = int(index.offsets[p])
            b = min(int(index.offsets[p + 1]), a + top_n)
            rows[user] = {"recommendations": _recs(index.item_ids[a:b].tolist(), index.scores[a:b].tolist()),
                          "source": sources[index.sources[p]]}
        fallback = None
        if missing and index.fallback is not None:
            ids, scores, name = index.fallback
            fallback = {"recommendations": _recs(ids[:top_n], [float(np.float32(s)) for s in scores[:top_n]]),
                        "source": name}
        return Found(index.version, rows, missing, fallback)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"store": self.kind, "output": redact_uri(self.output_root)}
        index = self.index
        if index is not None:
            out.update(index.version.describe(), users=index.users, memory_mb=round(index.nbytes / 2**20, 1))
        return {**out, "up": self.error is None and index is not None, "reason": self.error}

    async def close(self) -> None:
        self.index = None


def make_store(cfg) -> RedisLists | EmbeddedLists | None:
    """The list store ``serve.store`` names (None for ``none``)."""
    store = cfg.serve.store
    if store == "none":
        return None
    if store == "embedded":
        return EmbeddedLists(cfg.paths.output)
    return RedisLists(store, cfg.export.prefix, cfg.serve.store_timeout_ms)


async def aclose(store) -> None:
    if store is not None:
        try:
            await store.close()
        except Exception:   # closing a connection to a Redis that is gone
            pass


__all__ = ["EmbeddedLists", "Found", "ListVersion", "RedisLists", "StoreDown", "aclose", "make_store"]
