"""How well simple item-to-item rankers order the pages new to a user, on the Wikipedia backtest's nights.

    python benchmarks/new_page_rankers.py [--log ../shared/data/wikipedia-edits/edits.csv.gz] [--from-day 24]
        [--to-day 30] [--json PATH]

Why: the job's lists lose to masked Spark ALS on the pages new to the user (docs/quality.md, "Where the gap on
new pages is"), and the same backtest with the known pages masked puts the default SASRec level with masked ALS.
Before building a second ranker into the job, this asks whether any cheap one would be worth it: for every night
of the backtest (day 24..30 of the log: 2024-01-25..31 with the log starting 2024-01-01), each returning user who
edited at least one page new to them that day, and a list of 10 pages from which every page they edited before
is masked, as masked ALS's are. A hit is a list holding any of that day's new pages (the backtest's "HR@10,
new"). The rankers, all fitted on the edits before the night: popularity of the last 7 days (users per page), item-kNN
(cosine over users), EASE (Steck 2019, the closed-form item-item model; lambda 50-1000), page-to-next-page
transitions, and two blends. The whole item-item matrix is built (the log has 1,000 pages), so this is a
measurement, not a design for large catalogs.

It reads the CSV directly (numpy and pandas, no Spark, about 10 s), so its user-nights are counted here; they
match the backtest's (1,552). Masked ALS is not refitted here: compare with the backtest's figure for it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LOG = REPO.parent / "shared" / "data" / "wikipedia-edits" / "edits.csv.gz"
DAY_S = 86_400
K = 10


def _ease(gram: np.ndarray, lam: float) -> np.ndarray:
    precision = np.linalg.inv(gram + lam * np.eye(len(gram), dtype=np.float64))
    weights = -precision / np.diag(precision)[None, :]
    np.fill_diagonal(weights, 0.0)
    return weights


def _z(v: np.ndarray) -> np.ndarray:
    return (v - v.mean()) / (v.std() + 1e-12)


def night_scores(edits: pd.DataFrame, day: int, n_items: int) -> tuple[dict[str, list[int]], int]:
    """Hits (0/1) of each ranker over the night's users with a new page, and how many such users."""
    past, today = edits[edits.day < day], edits[edits.day == day]
    users = np.intersect1d(past.user_id.unique(), today.user_id.unique())
    index = {u: k for k, u in enumerate(past.user_id.unique())}
    rows = past.user_id.map(index).to_numpy()
    seen = np.zeros((len(index), n_items))
    np.add.at(seen, (rows, past.item.to_numpy()), 1.0)
    recency = np.zeros_like(seen)
    np.add.at(recency, (rows, past.item.to_numpy()), np.exp(-(day * DAY_S - past.seconds.to_numpy()) / DAY_S / 3.0))
    known = seen > 0
    binary = known.astype(np.float64)
    week = past[past.day >= day - 7].drop_duplicates(["user_id", "item"])   # users per page, as the backtest counts
    popular = np.bincount(week.item, minlength=n_items).astype(np.float64)
    gram = binary.T @ binary
    norms = np.sqrt(np.diag(gram)) + 1e-12
    cosine = gram / norms[:, None] / norms[None, :]
    np.fill_diagonal(cosine, 0.0)
    ease = {lam: _ease(gram, lam) for lam in (50.0, 200.0, 1000.0)}
    ordered = past.assign(u=rows).sort_values(["u", "seconds"])
    a, u = ordered.item.to_numpy(), ordered.u.to_numpy()
    step = (u[:-1] == u[1:]) & (a[:-1] != a[1:])
    transitions = np.zeros((n_items, n_items))
    np.add.at(transitions, (a[:-1][step], a[1:][step]), 1.0)
    transitions /= transitions.sum(1, keepdims=True) + 1.0

    hits: dict[str, list[int]] = {}
    counted = 0
    for user in users:
        k = index[user]
        new = set(today.item[today.user_id == user]) - set(np.flatnonzero(known[k]))
        if not new:
            continue
        counted += 1
        e200 = binary[k] @ ease[200.0]
        trans = recency[k] @ transitions
        rankers = {
            "popularity, 7 days": popular,
            "item-kNN (cosine)": binary[k] @ cosine,
            "item-kNN, recency-weighted": recency[k] @ cosine,
            "transitions from the recent pages": trans + 1e-9 * popular,
            **{f"EASE, lambda {lam:g}": binary[k] @ w for lam, w in ease.items()},
            "EASE 200 + transitions / 2": _z(e200) + 0.5 * _z(trans),
            "EASE 200 + popularity x 0.3": _z(e200) + 0.3 * _z(popular),
        }
        for name, score in rankers.items():
            masked = np.where(known[k], -np.inf, score)
            top = np.argpartition(-masked, K)[:K]
            hits.setdefault(name, []).append(int(bool(new & set(top.tolist()))))
    return hits, counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=DEFAULT_LOG)
    parser.add_argument("--from-day", type=int, default=24, help="first night, days since the log's first edit")
    parser.add_argument("--to-day", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    edits = pd.read_csv(args.log)
    edits["day"] = edits.seconds // DAY_S
    pages = np.sort(edits.page_id.unique())
    edits["item"] = np.searchsorted(pages, edits.page_id.to_numpy())
    hits: dict[str, list[int]] = {}
    users = 0
    for day in range(args.from_day, args.to_day + 1):
        night, counted = night_scores(edits, day, len(pages))
        users += counted
        for name, h in night.items():
            hits.setdefault(name, []).extend(h)
        print(f"night {day}: {counted} users with a new page", flush=True)
    rng = np.random.default_rng(0)
    print(f"\n{users:,} user-nights with a page new to the user; masked lists of {K}\n")
    print(f"| ranker | HR@{K}, new [95% bootstrap] |\n|---|---|")
    rows = []
    for name, h in hits.items():
        h = np.asarray(h, dtype=np.float64)
        boot = np.sort(h[rng.integers(0, len(h), (1000, len(h)))].mean(1))
        rows.append({"ranker": name, "hr": float(h.mean()), "low": float(boot[25]), "high": float(boot[974])})
        print(f"| {name} | {h.mean():.3f} [{boot[25]:.3f}, {boot[974]:.3f}] |")
    if args.json:
        args.json.write_text(json.dumps({"user_nights": users, "k": K, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
