"""The frontend's queue on its own (no Spark): coalescing, splitting, bounds, deadlines, failures.

The runner stands in for the backend: a function that records the users of each job and returns
one row per user. The end-to-end behaviour on a real backend is in test_serve.py.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from recsys.scoring.cache import CacheUse
from recsys.serve.batching import BatchSettings, Batcher, DeadlineExceeded, QueueFull
from recsys.serve.metrics import ServeMetrics
from recsys.serve.ondemand import BackendUnavailable, BatchFailed, BatchResult


class Runner:
    def __init__(self, fail_on: int | None = None, gate: threading.Event | None = None, error=BatchFailed):
        self.jobs: list[list[int]] = []
        self.fail_on, self.gate, self.error = fail_on, gate, error
        self.lock = threading.Lock()

    def __call__(self, users: list[int]) -> BatchResult:
        with self.lock:
            self.jobs.append(list(users))
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.fail_on is not None and self.fail_on in users:
            raise self.error(f"job with user {self.fail_on} failed")
        return BatchResult({u: {"user_id": u} for u in users}, CacheUse(hits=1))


def run(coro):
    return asyncio.run(coro)


async def _with_batcher(runner, settings, body):
    metrics = ServeMetrics()
    batcher = Batcher(runner, settings, metrics)
    batcher.start()
    try:
        return await body(batcher, metrics)
    finally:
        if runner.gate is not None:
            runner.gate.set()
        await batcher.close()


def test_requests_within_max_wait_share_one_job():
    runner = Runner()

    async def body(batcher, metrics):
        answers = await asyncio.gather(*(batcher.submit([u], 10) for u in (1, 2, 3)))
        return answers

    answers = run(_with_batcher(runner, BatchSettings(200, 100, 2, 1000), body))
    assert runner.jobs == [[1, 2, 3]]
    assert [sorted(rows) for rows, _ in answers] == [[1], [2], [3]]


def test_max_wait_zero_gives_one_job_per_request_and_a_full_batch_does_not_wait():
    runner = Runner()

    async def body(batcher, metrics):
        await asyncio.gather(*(batcher.submit([u], 10) for u in (1, 2, 3)))

    run(_with_batcher(runner, BatchSettings(0, 100, 1, 1000), body))
    assert sorted(map(tuple, runner.jobs)) == [(1,), (2,), (3,)]

    runner = Runner()

    async def full(batcher, metrics):
        loop = asyncio.get_running_loop()
        started = loop.time()
        await batcher.submit(list(range(10)), 30)     # a full batch: no 20 s wait
        return loop.time() - started

    assert run(_with_batcher(runner, BatchSettings(20_000, 10, 1, 1000), full)) < 10


def test_a_large_request_is_split_and_answered_in_order():
    runner = Runner()
    users = list(range(25, 0, -1))

    async def body(batcher, metrics):
        rows, _ = await batcher.submit(users, 10)
        return rows

    rows = run(_with_batcher(runner, BatchSettings(0, 10, 3, 1000), body))
    assert [len(j) for j in runner.jobs] == [10, 10, 5]
    assert sorted(u for j in runner.jobs for u in j) == sorted(users)
    assert list(rows) == users


def test_a_full_queue_refuses_with_retry_after_and_keeps_the_queued():
    runner = Runner()

    async def body(batcher, metrics):
        first = asyncio.ensure_future(batcher.submit([1, 2, 3], 30))
        await asyncio.sleep(0)      # let it enqueue (an event-loop turn, not a timing guess)
        assert batcher.queued_users == 3
        with pytest.raises(QueueFull) as refused:
            await batcher.submit([4, 5], 30)
        assert refused.value.retry_after_s >= 1
        assert metrics.queue_users._value.get() == 3
        return await first

    rows, _ = run(_with_batcher(runner, BatchSettings(300, 100, 1, 4), body))
    assert sorted(rows) == [1, 2, 3]
    assert runner.jobs == [[1, 2, 3]]


def test_a_request_past_its_deadline_leaves_the_queue_before_its_job():
    runner = Runner()

    async def body(batcher, metrics):
        with pytest.raises(DeadlineExceeded):
            await batcher.submit([7], 0.05)      # the batch would wait 5 s for company
        assert batcher.queued_users == 0
        return await batcher.submit([8], 10)     # the next one still gets its answer

    run(_with_batcher(runner, BatchSettings(300, 100, 1, 100), body))
    assert runner.jobs == [[8]]


def test_a_failed_job_fails_only_its_requests():
    runner = Runner(fail_on=1)

    async def body(batcher, metrics):
        with pytest.raises(BatchFailed):
            await batcher.submit([1], 10)
        rows, _ = await batcher.submit([2], 10)
        return rows, metrics

    rows, metrics = run(_with_batcher(runner, BatchSettings(0, 100, 1, 100), body))
    assert list(rows) == [2]
    assert metrics.spark_jobs.labels("failed")._value.get() == 1
    assert metrics.spark_jobs.labels("ok")._value.get() == 1


def test_backend_loss_answers_queued_requests_at_once():
    gate = threading.Event()
    runner = Runner(gate=gate)

    async def body(batcher, metrics):
        running = asyncio.ensure_future(batcher.submit([1], 30))
        while not runner.jobs:                    # the first job holds the only slot
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(batcher.submit([2], 30))
        await asyncio.sleep(0)
        batcher.fail_queued(BackendUnavailable("backend gone"))
        with pytest.raises(BackendUnavailable):
            await queued
        gate.set()
        return await running

    rows, _ = run(_with_batcher(runner, BatchSettings(0, 100, 1, 100), body))
    assert list(rows) == [1]
