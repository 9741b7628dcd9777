"""The frontend's queue: coalesce small requests into one Spark job, split large ones, bound the wait.

- A request's users join a FIFO queue. (``max_wait_ms`` = 0 turns coalescing off: one request, or
  one part of a large one, per job.) The dispatcher starts a job when the oldest request has
  waited ``max_wait_ms`` or the queue holds ``max_batch_users`` users, whichever comes first, and
  takes up to ``max_batch_users`` users from the head: several small requests share one job; a
  larger request is cut into parts that run as separate jobs, in parallel up to
  ``max_concurrent_jobs`` (the backend's FAIR scheduler shares the cores between them), and its
  answer is merged in the order of its ids.
- The queue is bounded in users (``max_queue_users``): a request that does not fit is refused at
  once (:class:`QueueFull`, HTTP 429 with ``Retry-After``), never parked.
- Every request has a deadline. One whose deadline passes while queued is dropped before its job
  starts (:class:`DeadlineExceeded`, 504); one whose job is running gets 504 at its deadline and
  the job's rows for it are discarded.
- A job that fails answers every request in it (:class:`BatchFailed` → 500, or
  :class:`BackendUnavailable` → 503); the next job runs as usual.

The runner (``run_batch``) is a blocking call that runs one Spark job; it runs on a thread pool
of ``max_concurrent_jobs`` threads so the event loop keeps accepting requests meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from recsys.serve.metrics import ServeMetrics
from recsys.serve.ondemand import BackendUnavailable, BatchFailed, BatchResult

log = logging.getLogger(__name__)


class QueueFull(Exception):
    def __init__(self, retry_after_s: int, queued_users: int):
        super().__init__(f"the queue holds {queued_users} users; retry in {retry_after_s}s")
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(frozen=True)
class BatchSettings:
    max_wait_ms: int
    max_batch_users: int
    max_concurrent_jobs: int
    max_queue_users: int


@dataclass(eq=False)
class Pending:
    users: list[int]                     # distinct ids, in request order
    deadline: float                      # time.monotonic()
    arrived: float
    future: asyncio.Future
    todo: list[int] = field(default_factory=list)   # not yet handed to a job
    outstanding: int = 0                 # parts running
    rows: dict[int, Any] = field(default_factory=dict)
    started: float | None = None         # when its first part's job started

    def __post_init__(self) -> None:
        self.todo = list(self.users)


class Batcher:
    def __init__(self, run_batch: Callable[[list[int]], BatchResult], settings: BatchSettings,
                 metrics: ServeMetrics) -> None:
        self.run_batch = run_batch
        self.settings = settings
        self.metrics = metrics
        self.queue: list[Pending] = []
        self.queued_users = 0
        self._changed: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._pool = ThreadPoolExecutor(max_workers=settings.max_concurrent_jobs, thread_name_prefix="recsys-job")
        self._dispatcher: asyncio.Task | None = None
        self._closing = False
        self._in_flight: set[asyncio.Task] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(self.settings.max_concurrent_jobs)
        self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch_forever(), name="recsys-dispatcher")

    async def close(self) -> None:
        """Stop taking requests, let the queue drain, then stop the dispatcher and the pool."""
        self._closing = True
        while self.queue or self._in_flight:
            self._changed.set()
            await asyncio.sleep(0.01)
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        self._pool.shutdown(wait=True, cancel_futures=False)

    def fail_queued(self, exc: Exception) -> None:
        """Answer every queued request with ``exc`` (the backend went away: nobody waits for it)."""
        for pending in self.queue:
            if not pending.future.done():
                pending.future.set_exception(exc)
        self.queue.clear()
        self._recount()

    # -- the request side ----------------------------------------------------------------------

    async def submit(self, users: list[int], timeout_s: float) -> tuple[dict[int, Any], float]:
        """-> (rows by user id, seconds waited in the queue). Raises QueueFull, DeadlineExceeded, ..."""
        if self._closing:
            raise ShuttingDown("the service is shutting down")
        if self.queued_users + len(users) > self.settings.max_queue_users:
            raise QueueFull(self._retry_after(len(users)), self.queued_users)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        pending = Pending(users, now + timeout_s, now, loop.create_future())
        self.queue.append(pending)
        self._recount()
        self._changed.set()
        try:
            rows = await asyncio.wait_for(asyncio.shield(pending.future), max(0.0, pending.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self._drop(pending)
            raise DeadlineExceeded(f"no answer within {timeout_s:g}s") from None
        return rows, (pending.started or time.monotonic()) - pending.arrived

    def _retry_after(self, users: int) -> int:
        rate = self.metrics.users_per_second()
        backlog = self.queued_users + users
        if rate <= 0:
            return max(1, math.ceil(self.settings.max_wait_ms / 1000))
        return max(1, math.ceil(backlog / rate))

    def _drop(self, pending: Pending) -> None:
        if pending in self.queue:
            self.queue.remove(pending)
            self._recount()
        pending.todo = []
        if not pending.future.done():
            pending.future.set_exception(DeadlineExceeded("the deadline passed before the request's job started"))
            pending.future.exception()   # retrieved: its waiter may already have given up

    def _recount(self) -> None:
        self.queued_users = sum(len(p.todo) for p in self.queue)
        self.metrics.queue_users.set(self.queued_users)
        self.metrics.queue_requests.set(len(self.queue))

    # -- the dispatcher ------------------------------------------------------------------------

    async def _dispatch_forever(self) -> None:
        while True:
            try:
                await self._dispatch_once()
            except asyncio.CancelledError:
                raise
            except Exception:   # a bug here must not stop the service from answering
                log.exception("dispatcher error")

    async def _dispatch_once(self) -> None:
        await self._wait_for_work()
        await self._slots.acquire()
        batch = self._cut()
        if not batch:
            self._slots.release()
            return
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _wait_for_work(self) -> None:
        """Until the head request has waited max_wait_ms, or a full batch is queued."""
        while True:
            self._expire()
            if self.queue:
                if self.queued_users >= self.settings.max_batch_users or self._closing:
                    return
                due = self.queue[0].arrived + self.settings.max_wait_ms / 1000
                delay = due - time.monotonic()
                if delay <= 0:
                    return
            else:
                delay = None
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def _expire(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self.queue if p.deadline <= now]:
            self._drop(pending)   # its users leave the queue before any job takes them

    def _cut(self) -> list[tuple[Pending, list[int]]]:
        """Up to max_batch_users users from the head of the queue, as (request, its users) parts."""
        self._expire()
        room = self.settings.max_batch_users
        batch: list[tuple[Pending, list[int]]] = []
        while self.queue and room > 0:
            pending = self.queue[0]
            part, pending.todo = pending.todo[:room], pending.todo[room:]
            room -= len(part)
            pending.outstanding += 1
            batch.append((pending, part))
            if not pending.todo:
                self.queue.pop(0)
            if self.settings.max_wait_ms == 0:
                break   # no coalescing: one request (or one part of a large one) per job
        self._recount()
        return batch

    async def _run(self, batch: list[tuple[Pending, list[int]]]) -> None:
        users = [u for _, part in batch for u in part]
        started = time.monotonic()
        for pending, _ in batch:
            if pending.started is None:
                pending.started = started
                self.metrics.wait_seconds.observe(started - pending.arrived)
        self.metrics.batch_users.observe(len(users))
        self.metrics.batch_requests.observe(len(batch))
        self.metrics.jobs_in_flight.inc()
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, self.run_batch, users)
        except Exception as exc:
            outcome = "backend_unavailable" if isinstance(exc, BackendUnavailable) else "failed"
            self.metrics.spark_jobs.labels(outcome).inc()
            if not isinstance(exc, (BackendUnavailable, BatchFailed)):
                log.exception("batch of %d users failed", len(users))
                exc = BatchFailed(f"the batch failed: {type(exc).__name__}: {exc}")
            for pending, _ in batch:
                pending.outstanding -= 1
                if not pending.future.done():
                    pending.future.set_exception(exc)
                if pending in self.queue:   # its other parts would fail the same way, or answer nobody
                    self._drop(pending)
            return
        finally:
            self.metrics.jobs_in_flight.dec()
            self.metrics.batch_seconds.observe(time.monotonic() - started)
            self._slots.release()
            self._changed.set()
        self.metrics.spark_jobs.labels("ok").inc()
        self.metrics.cache_hits.inc(result.model_cache.hits)
        self.metrics.cache_misses.inc(result.model_cache.misses)
        self.metrics.cache_load_seconds.inc(result.model_cache.load_s)
        for pending, part in batch:
            pending.outstanding -= 1
            for user in part:
                pending.rows[user] = result.rows.get(user)
            if not pending.todo and pending.outstanding == 0 and not pending.future.done():
                pending.future.set_result(pending.rows)
