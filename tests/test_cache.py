import sys
import threading

import pytest

from recsys.scoring.cache import BoundedCache


def test_second_get_is_a_hit_and_the_loader_runs_once():
    cache = BoundedCache(maxsize=2)
    calls = []
    value, hit = cache.get_or_load("a", lambda: calls.append(1) or "A")
    again, hit2 = cache.get_or_load("a", lambda: calls.append(1) or "B")
    assert (value, hit, again, hit2) == ("A", False, "A", True)
    assert len(calls) == 1
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_cache_is_bounded_and_evicts_least_recently_used():
    cache = BoundedCache(maxsize=2)
    for key in ("a", "b"):
        cache.get_or_load(key, lambda k=key: k)
    cache.get_or_load("a", lambda: "a")          # a is now most recent
    cache.get_or_load("c", lambda: "c")          # evicts b
    _, hit_a = cache.get_or_load("a", lambda: "a")
    _, hit_b = cache.get_or_load("b", lambda: "b")
    assert hit_a and not hit_b
    assert cache.stats.evictions == 2


def test_concurrent_threads_load_a_key_once():
    """Eight threads ask for one key while its first load is still running: the loader runs once.

    The first load does not return until every thread has entered get_or_load (a profile hook on each
    thread says when it does), so the calls overlap for real: without the cache's lock the others would
    find no value yet and load again. Every wait is bounded, so a broken cache fails instead of hanging.
    """
    n = 8
    cache = BoundedCache(maxsize=2)
    state = threading.Condition()
    entered, loads, results, overlapped = [], [], [], []
    get_or_load = BoundedCache.get_or_load.__code__

    def on_call(frame, event, arg):
        if event == "call" and frame.f_code is get_or_load:
            with state:
                entered.append(threading.get_ident())
                state.notify_all()

    def loader():
        with state:
            loads.append(threading.get_ident())
            state.notify_all()
            if len(loads) == 1:   # the first load lasts until all threads are in get_or_load (or another load began)
                overlapped.append(state.wait_for(lambda: len(entered) == n or len(loads) > 1, timeout=30))
        return object()

    barrier = threading.Barrier(n)

    def worker():
        barrier.wait(timeout=30)
        sys.setprofile(on_call)
        try:
            value = cache.get_or_load("model", loader)[0]
        finally:
            sys.setprofile(None)
        results.append(value)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "threads still inside get_or_load after 60 s"
    assert overlapped == [True], "the other threads never entered get_or_load while the first load ran"
    assert len(loads) == 1, f"the loader ran {len(loads)} times for one key"
    assert len(results) == n and all(r is results[0] for r in results)
    assert (cache.stats.misses, cache.stats.hits) == (1, n - 1)


def test_snapshot_deltas_count_per_task():
    cache = BoundedCache(maxsize=1)
    before = cache.snapshot()
    cache.get_or_load("a", lambda: 1)
    cache.get_or_load("a", lambda: 1)
    delta = cache.snapshot().minus(before)
    assert (delta.hits, delta.misses) == (1, 1)


def test_cache_size_must_be_positive():
    with pytest.raises(ValueError):
        BoundedCache(maxsize=0)
