"""CPU time of choosing the repeat blend (``recsys.model.repeats.blend_sums`` over the default grid of 4,130
candidates: 826 per popularity weight) on synthetic validation rows shaped like the 10,000-user night's
(docs/performance.md), beside the reference: every candidate scored on its own over every new target (the
one-candidate-at-a-time loop the grid replaced). The two must give the same sums; the run checks that before it reports.

CPU time (``time.process_time``), the median of 3 interleaved runs, so figures from a loaded machine compare.

    python benchmarks/blend_fit.py [--rows 20000] [--items 4742]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from recsys.config import load_config
from recsys.model.repeats import NDCG_K, BlendValidation, _ideal_dcg, _score, blend_grid, blend_sums

POPULARITY_WEIGHTS = tuple(load_config().train.repeats.popularity_weights)   # the job's default


def synthetic_rows(rows: int, items: int, seed: int = 0) -> BlendValidation:
    """Known items 1-50 a row (counts geometric, ages 0-30 days), 0-3 known targets; 0-36 new targets whose model
    ranks fall mostly far down the catalog, as a day's new items do, drawn again for each popularity weight."""
    rng = np.random.default_rng(seed)
    width = 50
    lengths = rng.integers(1, width + 1, rows)
    present = np.arange(width)[None, :] < lengths[:, None]
    counts = np.where(present, rng.geometric(0.4, (rows, width)), 0).astype(float)
    ages = np.where(present, rng.uniform(0, 30, (rows, width)), 0.0)
    known_target = present & (rng.random((rows, width)) < 1.5 / lengths[:, None])
    new_width = 36
    new_counts = np.minimum(rng.geometric(0.35, rows) - 1, new_width)
    weights = len(POPULARITY_WEIGHTS)
    ranks = np.minimum(rng.geometric(1 / 300, (weights, rows, new_width)) - 1, items - 1).astype(float)
    new_ranks = np.where(np.arange(new_width)[None, None, :] < new_counts[None, :, None], ranks, np.inf)
    targets = known_target.sum(1) + new_counts
    return BlendValidation(counts, ages, known_target, new_ranks, targets.astype(np.int64),
                           popularity_weights=POPULARITY_WEIGHTS)


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
        ranks = valid.new_target_ranks[valid.popularity_weights.index(blend.popularity_weight)]
        n, h = _score((top_base + blend.repeat_bias)[None], top_target, ranks[None], blend.new_rank_weight, ideal)
        ndcg[g], hits[g] = n[0, 0], h[0, 0]
    return ndcg, hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000, help="validation (user, day) rows (default 20000)")
    parser.add_argument("--items", type=int, default=4742, help="catalog size the ranks fall in (default 4742)")
    args = parser.parse_args()
    valid, grid = synthetic_rows(args.rows, args.items), blend_grid(popularity_weights=POPULARITY_WEIGHTS)
    grouped = blend_sums(valid, grid)
    ndcg, hits = reference_sums(valid, grid)
    assert np.allclose(grouped.ndcg, ndcg, rtol=0, atol=1e-9) and np.array_equal(grouped.hits, hits), \
        "the grouped grid and the reference disagree"
    times: dict[str, list[float]] = {"grid by bias group (recsys)": [], "reference, one candidate at a time": []}
    for _ in range(3):
        for name, run in zip(times, (lambda: blend_sums(valid, grid), lambda: reference_sums(valid, grid))):
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    ours, ref = (statistics.median(v) for v in times.values())
    print(f"{args.rows:,} rows, {len(grid)} candidates, the same sums from both")
    for name, value in zip(times, (ours, ref)):
        print(f"  {name:38s} {value:6.2f} s CPU")
    print(f"  reference / recsys: {ref / ours:.1f}x")


if __name__ == "__main__":
    main()
