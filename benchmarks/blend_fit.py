"""CPU time of choosing the repeat blend (``recsys.model.repeats.blend_sums`` over the job's default grid of
12,390 candidates: 826 per ranking of new items, one ranking per (popularity weight, item-to-item weight) pair) on
synthetic validation rows shaped like the 10,000-user night's (docs/performance.md), beside the reference: every
candidate scored on its own over every row and every new target, each place from dense [S, K] arrays of every
known item (``reference_score``, the form ``blend_sums`` had before it counted only what can change a row). The two
must give the same sums; the run checks that before it reports.

CPU time (``time.process_time``): recsys's the median of 3 runs, the reference's its one run (minutes at the
default size), so figures from a loaded machine compare.

    python benchmarks/blend_fit.py [--rows 20000] [--items 4742]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from recsys.config import load_config
from recsys.model.repeats import _GAIN, NDCG_K, BlendValidation, _ideal_dcg, blend_grid, blend_sums, rankings_of

_SETTINGS = load_config().train.repeats
POPULARITY_WEIGHTS = tuple(_SETTINGS.popularity_weights)           # the job's default
ITEM_TO_ITEM_WEIGHTS = tuple(_SETTINGS.item_to_item.weights)       # the job's default
RANKINGS = rankings_of(POPULARITY_WEIGHTS, ITEM_TO_ITEM_WEIGHTS)


def synthetic_rows(rows: int, items: int, seed: int = 0) -> BlendValidation:
    """Known items 1-50 a row (counts geometric, ages 0-30 days), 0-3 known targets; 0-36 new targets whose model
    ranks fall mostly far down the catalog, as a day's new items do, drawn again for each ranking of new items."""
    rng = np.random.default_rng(seed)
    width = 50
    lengths = rng.integers(1, width + 1, rows)
    present = np.arange(width)[None, :] < lengths[:, None]
    counts = np.where(present, rng.geometric(0.4, (rows, width)), 0).astype(float)
    ages = np.where(present, rng.uniform(0, 30, (rows, width)), 0.0)
    known_target = present & (rng.random((rows, width)) < 1.5 / lengths[:, None])
    new_width = 36
    new_counts = np.minimum(rng.geometric(0.35, rows) - 1, new_width)
    weights = len(RANKINGS)
    ranks = np.minimum(rng.geometric(1 / 300, (weights, rows, new_width)) - 1, items - 1).astype(float)
    new_ranks = np.where(np.arange(new_width)[None, None, :] < new_counts[None, :, None], ranks, np.inf)
    targets = known_target.sum(1) + new_counts
    return BlendValidation(counts, ages, known_target, new_ranks, targets.astype(np.int64),
                           popularity_weights=tuple(p for p, _ in RANKINGS),
                           item_to_item_weights=tuple(c for _, c in RANKINGS))


def reference_sums(valid: BlendValidation, candidates) -> tuple[np.ndarray, np.ndarray]:
    """Each candidate alone, over every new target: the loop before candidates were scored a bias-group at once."""
    ideal = _ideal_dcg(valid.targets)
    present = valid.known_counts > 0
    log_counts = np.log(np.clip(valid.known_counts, 1, None))
    log_ages = np.log1p(np.clip(valid.known_ages, 0, None))
    ndcg, hits = np.zeros(len(candidates)), np.zeros(len(candidates))
    ordered: dict[float, tuple[np.ndarray, np.ndarray]] = {}
    for g, blend in enumerate(candidates):
        age_weight = 0.0 if blend.masks_known else blend.age_weight
        if age_weight not in ordered:
            base = np.where(present, log_counts - age_weight * log_ages, -np.inf)
            order = np.argsort(-base, axis=1, kind="stable")[:, :NDCG_K]
            ordered[age_weight] = (np.take_along_axis(base, order, 1), np.take_along_axis(valid.known_target, order, 1))
        top_base, top_target = ordered[age_weight]
        ranks = valid.new_target_ranks[valid.rankings.index((blend.popularity_weight, blend.item_to_item_weight))]
        n, h = reference_score((top_base + blend.repeat_bias)[None], top_target, ranks[None], blend.new_rank_weight,
                               ideal)
        ndcg[g], hits[g] = n[0, 0], h[0, 0]
    return ndcg, hits


def reference_score(known: np.ndarray, known_target: np.ndarray, new_ranks: np.ndarray, rank_weight: float,
                    ideal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([P, B] sums of NDCG@10, [P, B] rows with a hit), every row and every known item computed: ``known`` [B, S, K]
    the known items' blended scores, descending along K; ``new_ranks`` [P, S, T] the new items' ranks. A known item's
    place is its column plus the new ranks whose score beats it; a new item's, its rank plus the known items at or
    above its score."""
    n_known = known.shape[-1]
    # new ranks whose score beats a known item's: -w log1p(r) > s  <=>  r < exp(-s / w) - 1
    beaten_by_new = np.where(np.isfinite(known), np.ceil(np.clip(np.exp(np.clip(-known / rank_weight, None, 30)) - 1,
                                                                 0, NDCG_K)), NDCG_K).astype(np.int64)
    known_place = np.arange(n_known) + beaten_by_new                              # [B, S, K]
    known_gain = (_GAIN[known_place] * known_target).sum(-1)                      # [B, S]
    known_hit = (known_target & (known_place < NDCG_K)).any(-1)                   # [B, S]
    rank_score = -rank_weight * np.log1p(np.arange(NDCG_K))                       # [10]
    above_rank = (known[:, :, :, None] >= rank_score).sum(2)                      # [B, S, 10]
    scale = np.where(ideal > 0, ideal, 1.0)
    ndcg, hits = [], []
    for ranks in new_ranks:                                                       # [S, T] one ranking of new items
        useful = ranks < NDCG_K
        rank = np.where(useful, ranks, 0).astype(np.int64)
        above = np.take_along_axis(above_rank, np.broadcast_to(rank, (len(known), *rank.shape)), 2)   # [B, S, T]
        new_place = np.where(useful, rank + above, 2 * NDCG_K)
        row_ndcg = np.where(ideal > 0, (known_gain + _GAIN[new_place].sum(-1)) / scale, 0.0)
        ndcg.append(row_ndcg.sum(-1))
        hits.append((known_hit | (new_place < NDCG_K).any(-1)).sum(-1).astype(np.float64))
    return np.array(ndcg), np.array(hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000, help="validation (user, day) rows (default 20000)")
    parser.add_argument("--items", type=int, default=4742, help="catalog size the ranks fall in (default 4742)")
    args = parser.parse_args()
    valid = synthetic_rows(args.rows, args.items)
    grid = blend_grid(popularity_weights=POPULARITY_WEIGHTS, item_to_item_weights=ITEM_TO_ITEM_WEIGHTS)
    start = time.process_time()
    ndcg, hits = reference_sums(valid, grid)
    reference = time.process_time() - start
    times = []
    for _ in range(3):
        start = time.process_time()
        grouped = blend_sums(valid, grid)
        times.append(time.process_time() - start)
    assert np.allclose(grouped.ndcg, ndcg, rtol=0, atol=1e-9) and np.array_equal(grouped.hits, hits), \
        "recsys and the reference disagree"
    ours = statistics.median(times)
    print(f"{args.rows:,} rows, {len(grid)} candidates, the same sums from both")
    print(f"  {'recsys (blend_sums), median of 3':40s} {ours:7.2f} s CPU")
    print(f"  {'reference, one candidate at a time':40s} {reference:7.2f} s CPU")
    print(f"  reference / recsys: {reference / ours:.1f}x")


if __name__ == "__main__":
    main()
