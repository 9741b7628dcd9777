"""Spark glue for the scoring core: moves Arrow batches in and out of it, nothing more.

``mapInArrow`` is the Arrow-native sibling of ``mapInPandas``: the same Python-worker execution,
but batches arrive as ``pyarrow.RecordBatch``. That matters here: a history column is a list per
user, which pandas would turn into one numpy object per row; Arrow hands over offsets and flat
values that the core turns into a padded tensor without per-row Python.

Arrow batches hold at most ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows; a scoring chunk
is usually larger, so the iterator assembles chunks across batches. Each task ends with one
statistics row (``user_id`` null, ``_stats`` a :class:`recsys.scoring.figures.TaskFigures` as JSON): the
worker's cache hits and misses, load and scoring seconds, device and memory, and the validation counts
of the rows it emitted (``recsys.scoring.checks``). That is how executor-side figures travel back to the
driver as data (no accumulators, so it works over Spark Connect too); the driver observes and drops
those rows before writing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from recsys.data.contracts import (EXCLUDED_COLUMN, HISTORY_COLUMN, HISTORY_COUNTS_COLUMN, HISTORY_LAST_US_COLUMN,
                                   OUTPUT_SPARK_DDL)
from recsys.hooks import NO_HOOKS, Hooks
from recsys.scoring.compare import CompareSpec
from recsys.scoring.params import DEFAULT_RULES, RuleParams, ScoringParams
from recsys.scoring.shipping import ShippedModel

STATS_COLUMN = "_stats"
SCORED_DDL = OUTPUT_SPARK_DDL + f", {STATS_COLUMN} STRING"


@dataclass(frozen=True)
class ScoringSpec:
    """Everything a worker needs, minted once on the driver and shipped with the task closure.

    Kept small: ids, names and two int arrays (candidate indices and the fallback list). The model
    files travel through Spark (``model``: names Spark delivers them under, see
    :mod:`recsys.scoring.shipping`), never inside the closure and never by a driver path.
    """

    model: ShippedModel            # its cache_key (version + digest of the files) keys the worker cache
    model_version: str
    candidates_index: np.ndarray   # [C] int64 model indices, sorted
    candidates_item_ids: np.ndarray  # [C] int64
    candidates_digest: str         # catalog snapshot + candidate set digest
    fallback_item_ids: np.ndarray  # [F] int64
    fallback_scores: np.ndarray    # [F] float32
    fallback_name: str
    params: ScoringParams          # top N, chunk size, device, dtype, tiling, cache size
    hooks: Hooks = NO_HOOKS        # test and game-day faults (recsys.hooks); off by default
    compare: CompareSpec | None = None   # compare with the previous night (recsys.scoring.compare); None: no
    lists_for_us: int | None = None   # the instant the lists are for (the night, epoch us): known items' ages
    rules: RuleParams = DEFAULT_RULES  # the operators' rules applied per list (the per-user exclusions: a column)
    popularity: np.ndarray | None = None   # [C] users per candidate in the window: what short lists are filled from
    recent_users: np.ndarray | None = None   # [C] of them, those of the last day: the new items' popularity prior


def make_partition_scorer(spec: ScoringSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function ``mapInArrow`` runs on each partition."""

    def score_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # Imported here, not at module level: the driver never needs torch to plan the job.
        import torch
        from pyspark import TaskContext

        from recsys.scoring import cache
        from recsys.scoring.checks import ListRules, TaskChecks
        from recsys.scoring.compare import TaskComparison
        from recsys.scoring.core import ChunkStats, resolve_device
        from recsys.scoring.cache import CacheUse
        from recsys.scoring.figures import TaskFigures, TaskSums
        from recsys.sequences import Sequences

        task_start = time.perf_counter()
        ctx = TaskContext.get()
        attempt = ctx.attemptNumber() if ctx else 0
        spec.hooks.inject_faults(attempt)
        gpus = list(ctx.resources()["gpu"].addresses) if ctx and "gpu" in ctx.resources() else []
        params = spec.params
        device = resolve_device(params.device, gpus)
        threads = max(1, ctx.cpus() if ctx else 1)
        if device.type == "cpu":
            torch.set_num_threads(threads)

        cache.MODELS.resize(params.cache_size)
        cache.SCORERS.resize(params.cache_size)
        cache.INT8.resize(params.cache_size)
        models_before, scorers_before, int8_before = cache.MODELS.snapshot(), cache.SCORERS.snapshot(), cache.INT8.snapshot()
        scorer = _get_scorer(spec, device)
        stats = ChunkStats()
        checks = TaskChecks()   # validation of the rows this task emits (recsys.scoring.checks)
        candidates_sorted = np.sort(np.asarray(spec.candidates_item_ids, dtype=np.int64))
        comparison = (TaskComparison(spec.compare, candidates_sorted, model_scores=not scorer.known_items_compete)
                      if spec.compare is not None else None)
        list_rules = ListRules(params.top_n, spec.fallback_name, len(spec.fallback_item_ids),
                               known_allowed=scorer.known_items_compete,
                               min_new_items=spec.rules.min_new_items,
                               fill=spec.rules.fill == "popularity" and spec.popularity is not None)
        check_s = 0.0
        for chunk in _chunks(batches, params.chunk_size):
            histories = Sequences.from_arrow(chunk.column(HISTORY_COLUMN))
            user_ids = chunk.column("user_id").to_numpy(zero_copy_only=False)
            excluded = chunk.column(EXCLUDED_COLUMN) if EXCLUDED_COLUMN in chunk.schema.names else None
            out, chunk_stats = scorer.score(user_ids, histories, _known_items(chunk, spec.lists_for_us),
                                            Sequences.from_arrow(excluded) if excluded is not None else None)
            stats.add(chunk_stats)
            started = time.perf_counter()
            checks.add_chunk(user_ids, chunk.column(HISTORY_COLUMN), out, candidate_ids_sorted=candidates_sorted,
                             rules=list_rules, excluded=excluded)
            check_s += time.perf_counter() - started
            if comparison is not None:
                comparison.add_chunk(chunk, out)
            n = out.num_rows
            yield pa.RecordBatch.from_arrays(
                list(out.columns) + [pa.repeat(pa.scalar(spec.model_version, pa.string()), n), pa.nulls(n, pa.string())],
                names=["user_id", "recommendations", "source", "model_version", STATS_COLUMN],
            )
        models = CacheUse.between(models_before, cache.MODELS.snapshot())
        sums = TaskSums(
            chunks=stats,
            # per task: 1 if it found the weights already loaded in this worker, else 0 (TaskSums says why)
            model=CacheUse(int(models.misses == 0), models.misses, models.load_s),
            scorer=CacheUse.between(scorers_before, cache.SCORERS.snapshot()),
            int8=CacheUse.between(int8_before, cache.INT8.snapshot()),
            task_s=time.perf_counter() - task_start,
            check_s=check_s,
        )
        identity = cache.worker_identity()
        figures = TaskFigures(
            host=identity["host"], pid=identity["pid"], python=identity["python"],
            partition=ctx.partitionId() if ctx else -1, attempt=attempt, device=str(device), gpus=",".join(gpus),
            threads=threads if device.type == "cpu" else None, peak_rss_mb=_peak_rss_mb(), sums=sums,
            checks=checks.finish(), compare=comparison.finish() if comparison is not None else None,
        )
        yield _stats_batch(figures.to_json())

    return score_partition


def _known_items(chunk: pa.RecordBatch, lists_for_us: int | None):
    """What the chunk's histories say about repeats (counts, latest times), when it carries them."""
    from recsys.scoring.core import KnownItems
    from recsys.sequences import Sequences

    names = chunk.schema.names
    if lists_for_us is None or HISTORY_COUNTS_COLUMN not in names or HISTORY_LAST_US_COLUMN not in names:
        return None
    return KnownItems(Sequences.from_arrow(chunk.column(HISTORY_COUNTS_COLUMN)).items,
                      Sequences.from_arrow(chunk.column(HISTORY_LAST_US_COLUMN)).items, lists_for_us)


def _get_scorer(spec: ScoringSpec, device):
    """Scorer from the worker cache; on a miss, the model itself may still be cached."""
    from recsys.model.int8 import quantize_for_scoring
    from recsys.model.io import load_model
    from recsys.scoring import cache
    from recsys.scoring.core import Candidates, Fallback, Scorer, check_dtype
    from recsys.scoring.shipping import fetch_model
    from recsys.sequences import Vocabulary

    model_key = (spec.model.cache_key, str(device))

    def load():
        loaded = load_model(fetch_model(spec.model), device=device)
        return loaded.model, Vocabulary(loaded.item_ids), loaded.blend, loaded.item_to_item

    def prepare():
        (model, vocab, blend, item_to_item), _ = cache.MODELS.get_or_load(model_key, load)
        int8 = None
        if spec.params.dtype == "int8":
            check_dtype("int8", device)       # refuse before quantizing anything
            int8, _ = cache.INT8.get_or_load(model_key, lambda: quantize_for_scoring(model))
        return Scorer(
            model=model,
            vocab=vocab,
            candidates=Candidates(spec.candidates_index, spec.candidates_item_ids),
            fallback=Fallback(spec.fallback_name, spec.fallback_item_ids, spec.fallback_scores),
            device=device,
            int8=int8,
            blend=blend,
            item_to_item=item_to_item,
            rules=spec.rules,
            popularity=spec.popularity,
            recent_users=spec.recent_users,
            **spec.params.scorer_settings(),
        )

    # the fallback and the popularity ranking change with the window while the candidates stay (a warm backend's
    # next day): both are in the key, so a worker never fills lists from yesterday's ranking
    scorer_key = (model_key + (spec.candidates_digest, _ranking_digest(spec)) + spec.params.scorer_key()
                  + spec.rules.key())
    scorer, _ = cache.SCORERS.get_or_load(scorer_key, prepare)
    return scorer


def _ranking_digest(spec: ScoringSpec) -> str:
    """The fallback list and the popularity counts (the window's and the last day's), hashed (a few
    microseconds per task)."""
    import hashlib

    digest = hashlib.sha256(np.ascontiguousarray(spec.fallback_item_ids, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(spec.fallback_scores, dtype=np.float32).tobytes())
    if spec.popularity is not None:
        digest.update(np.ascontiguousarray(spec.popularity, dtype=np.int64).tobytes())
    if spec.recent_users is not None:
        digest.update(b"recent")
        digest.update(np.ascontiguousarray(spec.recent_users, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def _chunks(batches: Iterator[pa.RecordBatch], chunk_size: int) -> Iterator[pa.RecordBatch]:
    """Re-cut Spark's Arrow batches into scoring chunks of exactly ``chunk_size`` rows (last: fewer)."""
    pending: list[pa.RecordBatch] = []
    rows = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        pending.append(batch)
        rows += batch.num_rows
        while rows >= chunk_size:
            table = pa.Table.from_batches(pending)
            head = table.slice(0, chunk_size).combine_chunks().to_batches()[0]
            rest = table.slice(chunk_size)
            yield head
            pending = rest.combine_chunks().to_batches() if rest.num_rows else []
            rows = rest.num_rows
    if rows:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]


def _stats_batch(payload: str) -> pa.RecordBatch:
    from recsys.data.contracts import RECOMMENDATION_TYPE

    return pa.RecordBatch.from_arrays(
        [
            pa.nulls(1, pa.int64()),
            pa.nulls(1, RECOMMENDATION_TYPE),
            pa.nulls(1, pa.string()),
            pa.nulls(1, pa.string()),
            pa.array([payload], pa.string()),
        ],
        names=["user_id", "recommendations", "source", "model_version", STATS_COLUMN],
    )


def _peak_rss_mb() -> float:
    """This worker process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
