"""The bare scoring core in one process: the practical limit the Spark stage is judged against.

Same work as a task in the job (id mapping, padding, encoding, scoring, masking, top-N, Arrow
output), minus Spark: chunks come straight from numpy, results are materialised as Arrow batches.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from recsys.scoring.core import Scorer
from recsys.sequences import Sequences


def contiguous_chunks(seqs: Sequences, chunk_size: int) -> list[tuple[int, int, Sequences]]:
    """Pre-cut chunks (as Spark hands the worker Arrow batches already in memory)."""
    out = []
    for lo in range(0, len(seqs), chunk_size):
        hi = min(lo + chunk_size, len(seqs))
        out.append((lo, hi, seqs.take(np.arange(lo, hi))))
    return out


def score_chunks(scorer: Scorer, user_ids: np.ndarray, chunks: list[tuple[int, int, Sequences]]) -> tuple[float, int]:
    """One thread scores every chunk (torch may use several threads inside each operation)."""
    rows = 0
    start = time.perf_counter()
    for lo, hi, chunk in chunks:
        batch, _ = scorer.score(user_ids[lo:hi], chunk)
        rows += batch.num_rows
    if scorer.device.type == "cuda":
        torch.cuda.synchronize(scorer.device)
    return time.perf_counter() - start, rows


def score_chunks_parallel(scorer: Scorer, user_ids: np.ndarray, chunks: list[tuple[int, int, Sequences]],
                          workers: int) -> tuple[float, int]:
    """``workers`` threads with one torch thread each, chunks dealt round-robin: the same split of
    the work as Spark's ``workers`` single-threaded tasks, without Spark. torch releases the GIL
    inside its kernels, so the threads run in parallel; there is no cross-thread barrier inside an
    operation (which costs multi-threaded torch dearly when another process takes a core)."""
    from concurrent.futures import ThreadPoolExecutor

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            parts = list(pool.map(lambda w: score_chunks(scorer, user_ids, chunks[w::workers])[1], range(workers)))
        return time.perf_counter() - start, sum(parts)
    finally:
        torch.set_num_threads(previous)


def agreement(a: Scorer, b: Scorer, chunk: Sequences, overlap: bool = False) -> float:
    """How far two cores agree on one chunk: the share of users whose lists are identical (ids in
    order), or with ``overlap`` the mean share of ``a``'s top N that ``b`` also recommends."""
    ids_a, _, _, _ = a.topn(chunk)
    ids_b, _, _, _ = b.topn(chunk)
    if not overlap:
        return float((ids_a == ids_b).all(axis=1).mean())
    k = ids_a.shape[1]
    same = [len(np.intersect1d(x, y)) / k for x, y in zip(ids_a, ids_b)]
    return float(np.mean(same)) if same else float("nan")
