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
    cache = BoundedCache(maxsize=2)
    loads = []
    barrier = threading.Barrier(8)

    def loader():
        loads.append(threading.get_ident())
        return object()

    results = []

    def worker():
        barrier.wait()
        results.append(cache.get_or_load("model", loader)[0])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1
    assert all(r is results[0] for r in results)


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
