"""The scoring tasks' figures as records: built from the chunk and cache statistics on the executor, shipped
as one JSON row, added up on the driver. No Spark: the rows are what the tasks emit."""
import math

from recsys.scoring.cache import BoundedCache, CacheUse
from recsys.scoring.core import ChunkStats
from recsys.scoring.figures import TaskFigures, TaskSums, WorkerFigures

# the run metrics (and manifest metrics) the workers' figures have always been published under
PUBLISHED = {"users", "model_users", "fallback_users", "nonfinite_users", "short_lists", "chunks", "history_items",
             "unknown_items", "encode_s", "score_s", "to_arrow_s", "model_hits", "model_misses", "model_load_s",
             "scorer_hits", "scorer_misses", "scorer_load_s", "int8_hits", "int8_misses", "int8_build_s", "task_s",
             "check_s", "tasks", "task_retries", "workers", "model_loads_per_worker_max", "model_load_s_max",
             "worker_rss_mb_max"}


def _task(pid: int, *, users: int, loaded: bool, attempt: int = 0, rss: float = 100.0, item_counts=((), ()),
          compare=None) -> TaskFigures:
    sums = TaskSums(ChunkStats(users=users, model_users=users - 1, fallback_users=1, chunks=1, score_s=0.5),
                    model=CacheUse(int(not loaded), int(loaded), 0.25 if loaded else 0.0),
                    scorer=CacheUse(0, 1, 0.125), task_s=1.0, check_s=0.01)
    return TaskFigures(host="h", pid=pid, python="/venv/bin/python", partition=pid, attempt=attempt, device="cpu",
                       gpus="", threads=1, peak_rss_mb=rss, sums=sums,
                       checks={"seen_items": 0, "missing_users": 1, "item_counts": [list(c) for c in item_counts]},
                       compare=compare)


def test_a_task_row_reads_back_as_the_record_it_was():
    task = _task(7, users=5, loaded=True, attempt=1, item_counts=([3, 9], [2, 1]))
    assert TaskFigures.from_json(task.to_json()) == task


def test_cache_use_between_two_snapshots_counts_what_happened_in_between():
    cache: BoundedCache = BoundedCache(maxsize=1)
    cache.get_or_load("a", lambda: 1)
    before = cache.snapshot()
    cache.get_or_load("a", lambda: 1)
    cache.get_or_load("b", lambda: 2)
    use = CacheUse.between(before, cache.snapshot())
    assert (use.hits, use.misses) == (1, 1) and use.load_s >= 0


def test_tasks_add_up_per_worker_and_per_run_under_the_published_metric_names():
    rows = [_task(1, users=5, loaded=True, item_counts=([3, 9], [2, 1])),
            _task(1, users=4, loaded=False, rss=150.0, item_counts=([9], [4])),
            _task(2, users=3, loaded=True, attempt=1, item_counts=([3], [1]))]
    figures = WorkerFigures.from_rows(r.to_json() for r in rows)

    assert figures.users == 12 and figures.totals.chunks.model_users == 9 and figures.tasks == 3
    assert figures.task_retries == 1 and figures.device == "cpu" and figures.worker_rss_mb_max == 150.0
    assert [(w.pid, w.tasks, w.sums.model.misses, w.sums.model.hits) for w in figures.workers] == [(1, 2, 1, 1),
                                                                                                  (2, 1, 1, 0)]
    assert figures.checks.counts["missing_users"] == 3
    assert figures.checks.item_ids.tolist() == [3, 9] and figures.checks.item_times.tolist() == [3, 5]
    metrics = figures.metrics()
    assert set(metrics) == PUBLISHED
    assert metrics["model_misses"] == 2 and metrics["model_hits"] == 1 and metrics["model_loads_per_worker_max"] == 1
    assert metrics["workers"] == 2 and math.isclose(metrics["model_load_s"], 0.5)
    assert figures.compare is None                            # no task compared with a previous night
    # worker_stats.json: one entry per worker, its figures by the same names
    assert set(figures.workers[0].as_dict()) == {"host", "pid", "python", "gpus"} | (PUBLISHED - {
        "task_retries", "workers", "model_loads_per_worker_max", "model_load_s_max", "worker_rss_mb_max"})


def test_a_counter_added_to_the_chunk_statistics_reaches_the_metrics_without_being_named_again():
    names = set(TaskSums().as_dict())
    assert {f for f in ChunkStats.__dataclass_fields__} <= names


def test_no_task_gives_empty_figures():
    figures = WorkerFigures.of([])
    assert figures.users == 0 and figures.device == "none" and math.isnan(figures.worker_rss_mb_max)
    assert figures.checks.item_ids.tolist() == [] and figures.workers == ()
