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
    rows = 0
    start = time.perf_counter()
    for lo, hi, chunk in chunks:
        batch, _ = scorer.score(user_ids[lo:hi], chunk)
        rows += batch.num_rows
    if scorer.device.type == "cuda":
        torch.cuda.synchronize(scorer.device)
    return time.perf_counter() - start, rows
