"""Does an item-to-item model beside the default SASRec rank new items better than either alone? Measured outside
the job, all ten places new, on the backtest's nights.

    python benchmarks/new_page_fusion.py [--log ../shared/data/wikipedia-edits/edits.csv.gz] [--seed 42]
        [--from-day 24] [--to-day 30] [--json PATH]
    python benchmarks/new_page_fusion.py --events DATA/events --from-day 33 --to-day 39   # the job's input layout

Why: with the repeat blend chosen as well as its form allows (benchmarks/blend_choice.py, blend_families.py), the
lists' hits on items new to the user are bounded by how well new items are ranked. The default SASRec ranks them
about as well as masked Spark ALS, and EASE (a closed-form item-to-item regression, Steck 2019) about a tenth
better on Wikipedia edits (benchmarks/new_page_rankers.py). This asks what the two do together.

Each night, as :mod:`new_page_prior` does: the default SASRec and training settings, trained on the events before
the day before the night (its epoch count chosen on that day's new items); EASE (lambda 200) fitted on every user's
distinct items before the night; the night's returning users with an item new to them, every item they had masked.
The rankings: the model alone; the model plus the job's last-day popularity prior
(:func:`recsys.model.repeats.popularity_prior`, weight 1); each of those standardised per user and fused with
EASE's scores standardised the same way, EASE weighted alpha; the same fusion without standardising (EASE's scores
times c added to the model's, as the job adds its prior); EASE alone. HR@10 over the night's new items (the
backtest's "HR@10, new"), paired differences to the model alone with a 95% bootstrap interval over user-nights.
Torch, numpy and pandas, no Spark: about 3 minutes on 2 cores at 1,000-5,000 items (EASE inverts an items x items
matrix: this is a measurement, not a design for large catalogs).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import pandas as pd

from new_page_prior import arguments, listed, model_scores, popularity, read_log, trained_nights
from new_page_rankers import _ease
from recsys.model.repeats import popularity_prior

LAMBDA = 200.0
ALPHAS = (0.25, 0.5, 1.0)        # EASE's weight against the model's, both standardised per user
ADDED = (8.0, 16.0, 32.0, 64.0, 128.0)  # EASE's scores times c, added to the model's as they are
PRIOR = 1.0


def standardised(scores: np.ndarray) -> np.ndarray:
    """Per row, over its finite entries: (s - mean) / std; masked entries stay -inf."""
    finite = np.isfinite(scores)
    values = np.where(finite, scores, np.nan)
    z = (scores - np.nanmean(values, 1, keepdims=True)) / (np.nanstd(values, 1, keepdims=True) + 1e-9)
    return np.where(finite, z, -np.inf)


def ease_scores(edits: pd.DataFrame, day: int, n_items: int, known: list[np.ndarray]) -> np.ndarray:
    """EASE (lambda 200) fitted on every user's distinct items before ``day``, scored for the night's rows
    (their known items masked): [rows, n_items + 1], column 0 padding."""
    past = edits[edits.day < day].drop_duplicates(["user_id", "item"])
    users = pd.factorize(past.user_id)[0]
    matrix = np.zeros((users.max() + 1, n_items + 1))
    matrix[users, past.item.to_numpy()] = 1.0
    weights = _ease(matrix.T @ matrix, LAMBDA)
    rows = np.zeros((len(known), n_items + 1))
    for r, items in enumerate(known):
        rows[r, items] = 1.0
    scores = rows @ weights
    scores[:, 0] = -np.inf
    for r, items in enumerate(known):
        scores[r, items] = -np.inf
    return scores


def main() -> int:
    args = arguments(__doc__.splitlines()[0])
    edits, n_items = read_log(args)
    hits: dict[str, list[np.ndarray]] = {}
    started = time.perf_counter()
    for n in trained_nights(edits, n_items, args):
        day = n.day
        seq, new, known = n.tonight
        alone = model_scores(n.model, seq, known)
        with_prior = alone + PRIOR * popularity_prior(popularity(edits, day, n_items, 1))[None, :]
        ease = ease_scores(edits, day, n_items, known)
        rankings = {"the model alone": alone, f"the model + {PRIOR:g} x log(1 + users of the last day)": with_prior,
                    "EASE alone": ease}
        for name, base in (("the model", alone), ("the model + prior", with_prior)):
            for alpha in ALPHAS:
                rankings[f"{name}, standardised, + {alpha:g} x EASE standardised"] = (
                    standardised(base) + alpha * standardised(ease))
        for name, base in (("the model", alone), ("the model + prior", with_prior)):
            for c in ADDED:
                rankings[f"{name} + {c:g} x EASE, added"] = base + c * ease
        for name, scores in rankings.items():
            hits.setdefault(name, []).append(listed(scores, new).hit.astype(np.float64))
        print(f"night {day}: {new.n_rows} users with a new item; model alone {hits['the model alone'][-1].mean():.3f}, "
              f"best fused {max(v[-1].mean() for v in hits.values()):.3f}", flush=True)

    base = np.concatenate(hits["the model alone"])
    draws = np.random.default_rng(0).integers(0, len(base), (2000, len(base)))
    print(f"\n{len(base):,} user-nights, seed {args.seed}, {time.perf_counter() - started:.0f} s\n")
    print("| new items ranked by | HR@10, new | paired difference to the model alone [95%] |\n|---|---|---|")
    rows = []
    for name, values in hits.items():
        h = np.concatenate(values)
        diff = np.sort((h - base)[draws].mean(axis=1))
        rows.append({"ranker": name, "hr": float(h.mean()), "diff": float((h - base).mean()),
                     "low": float(diff[50]), "high": float(diff[1949])})
        print(f"| {name} | {h.mean():.3f} | {(h - base).mean():+.3f} [{diff[50]:+.3f}, {diff[1949]:+.3f}] |")
    if args.json:
        args.json.write_text(json.dumps({"user_nights": len(base), "seed": args.seed, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
