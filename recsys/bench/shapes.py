"""Synthetic benchmark inputs of a given shape. Pure numpy/torch: also runs on a bare GPU machine."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from recsys.model.sasrec import SASRec, SASRecConfig
from recsys.scoring.core import Candidates, ReferenceScorer, Scorer, popularity_fallback
from recsys.scoring.params import ScoringParams
from recsys.sequences import Sequences, Vocabulary


@dataclass(frozen=True)
class BenchShape:
    users: int = 200_000
    items: int = 20_000
    dim: int = 64
    history: int = 50       # items per user history (the model reads the last max_len of them)
    top_n: int = 100
    seed: int = 0
    layers: int = 2
    heads: int = 2

    def as_dict(self) -> dict:
        return asdict(self)


def item_ids(shape: BenchShape) -> np.ndarray:
    """External ids that are not the model indices (sparse, shuffled), so id mapping is real work."""
    rng = np.random.default_rng(shape.seed + 1)
    return rng.permutation(np.arange(shape.items, dtype=np.int64) * 7 + 1000)


def histories(shape: BenchShape) -> tuple[np.ndarray, Sequences]:
    """``history`` items per user, drawn with a mild popularity skew; user ids 0..users-1."""
    rng = np.random.default_rng(shape.seed)
    ids = item_ids(shape)
    ranks = np.minimum((rng.pareto(1.2, size=shape.users * shape.history) * shape.items / 20).astype(np.int64),
                       shape.items - 1)
    items = ids[ranks]
    offsets = np.arange(0, (shape.users + 1) * shape.history, shape.history, dtype=np.int64)
    return np.arange(shape.users, dtype=np.int64), Sequences(offsets, items)


def model(shape: BenchShape) -> SASRec:
    """A randomly initialised default-sized model: speed does not depend on what it learned."""
    torch.manual_seed(shape.seed)
    cfg = SASRecConfig(num_items=shape.items, dim=shape.dim, layers=shape.layers, heads=shape.heads,
                       max_len=shape.history, dropout=0.0)
    return SASRec(cfg).eval()


def params(shape: BenchShape, **settings: Any) -> ScoringParams:
    """The job's scoring settings (its defaults: chunk size, tiling, ...) for this shape's top N."""
    return ScoringParams(top_n=shape.top_n, **settings)


def scorer(shape: BenchShape, net: SASRec, device: torch.device, settings: ScoringParams | None = None,
           reference: bool = False) -> Scorer:
    """Every item is a candidate (the benchmark's catalog is fully available). ``settings``: the
    scoring settings (default: the job's, :func:`params`); ``reference``: the reference core (full
    forward, one product, torch.topk, fp32) instead of the fast one."""
    settings = settings or params(shape)
    if settings.top_n != shape.top_n:
        raise ValueError(f"the scoring settings ask for top {settings.top_n}, the shape for top {shape.top_n}")
    ids = item_ids(shape)
    vocab = Vocabulary(ids)
    index = np.arange(1, shape.items + 1, dtype=np.int64)
    fallback = popularity_fallback(ids, np.ones(shape.items), shape.top_n)
    cls = ReferenceScorer if reference else Scorer
    return cls(model=net.to(device), vocab=vocab, candidates=Candidates(index, ids), fallback=fallback,
               device=device, **settings.scorer_settings())
