"""Whether a popularity prior on the model's ranking of new pages lifts it, on the Wikipedia backtest's nights.

    python benchmarks/new_page_prior.py [--log ../shared/data/wikipedia-edits/edits.csv.gz] [--seed 42]
        [--from-day 24] [--to-day 30] [--json PATH]
    python benchmarks/new_page_prior.py --events DATA/events --from-day 33 --to-day 39   # the job's input layout
    python benchmarks/new_page_prior.py --order first   # histories in the order pages were found

Why: on Wikipedia edits the job's lists hold fewer pages new to the user than masked Spark ALS's, and with all
ten places the default SASRec orders new pages about as well as masked ALS (docs/quality.md, "Where the gap on new
pages is"); benchmarks/new_page_rankers.py found item-item rankers a tenth better, helped by popularity. This asks
whether the model itself, its scores blended with recent popularity, does better, before such a prior is built
into the job's blend (and on which logs: the sample data answers otherwise, docs/quality.md).

For each night (day 24..30 of the log: 2024-01-25..31 with the log starting 2024-01-01), as the backtest trains
every night: the job's default SASRec and training settings, trained on the edits before the day before the
night, its epoch count chosen on that day's new pages (the users with an edit before it; the job chooses on each
user's newest item instead, which this log's repeats make a poor stand-in); then the night's returning users with a
page new to them, their histories (distinct pages, newest last, as the job builds them) and a list of 10 from
which every page they edited before is masked. A hit is a list holding any of the night's new pages (the
backtest's "HR@10, new"; 1,552 user-nights, as there). ``--events`` reads a log in the job's input layout
instead (the sample generator's, ``recsys sample-data``; day 0 is its first date's), the same way.

The prior: per user, the model's scores over the pages they do not know and log(1 + users per page in the 7 days
before the day), each standardised over the pages, added with weight w (w = 0: the model alone); and w chosen on
the day before each night, as a blend would be; and the additive form, b * log(1 + users) added to the scores as
they are (an item bias the model's item vectors could carry at no cost in scoring), with the users of the last 1,
3, 7 or 28 days. Torch, numpy and pandas, no Spark: about 2.5 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from new_page_rankers import DAY_S, DEFAULT_LOG, K
from recsys.model.list_metrics import Lists, Realized, realized
from recsys.model.repeats import popularity_prior
from recsys.sequences import Sequences, pad_left

WEIGHTS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)
BIASES = (0.25, 0.5, 1.0, 2.0)    # the additive form: scores + b * log(1 + users), in the model's own units
WINDOWS = (1, 3, 7, 28)           # ... with the users of this many days before the night (7 for the standardised form)


def read_events(path: Path) -> pd.DataFrame:
    """The job's input layout as the CSV's columns: user_id, page_id (the item) and seconds since the first date."""
    import pyarrow.dataset as ds

    table = ds.dataset(path, format="parquet", partitioning="hive").to_table(columns=["user_id", "item_id", "ts"])
    frame = table.to_pandas().rename(columns={"item_id": "page_id"})
    origin = frame.ts.min().normalize()
    frame["seconds"] = ((frame.ts - origin).dt.total_seconds()).astype(np.int64)
    return frame.drop(columns="ts").sort_values(["user_id", "seconds"], kind="stable").reset_index(drop=True)


ORDERS = ("latest", "first")


def histories(past: pd.DataFrame, order: str = "latest") -> dict[int, np.ndarray]:
    """Each user's distinct pages (model indices), ordered by their latest edit, newest last: the job's order (ties
    by page here, by a seeded hash in the job). ``order="first"``: by each page's first edit instead (the order
    the user found them in, so that every next page of a training sequence was new to the user then)."""
    by = past.groupby(["user_id", "item"], sort=False).seconds
    when = (by.max() if order == "latest" else by.min()).reset_index()
    when = when.sort_values(["user_id", "seconds", "item"], kind="stable")
    return {u: g.item.to_numpy() for u, g in when.groupby("user_id", sort=False)}


def night(edits: pd.DataFrame, day: int, max_len: int,
          order: str = "latest") -> tuple[np.ndarray, Lists, list[np.ndarray]]:
    """The day's returning users with a new page: their histories as [U, max_len] (left-padded), new pages, known."""
    past, today = edits[edits.day < day], edits[edits.day == day]
    seqs = histories(past, order)
    rows, news, known = [], [], []
    for user, pages in today.groupby("user_id").item:
        if user not in seqs:
            continue
        new = sorted(set(pages.tolist()) - set(seqs[user].tolist()))
        if new:
            rows.append(seqs[user])
            news.append(new)
            known.append(seqs[user])
    return pad_left(Sequences.from_lists(rows), max_len), Lists.of(news), known


def popularity(edits: pd.DataFrame, day: int, n_items: int, days: int = 7) -> np.ndarray:
    """Users per page in the ``days`` before ``day``, as the backtest's popularity counts them (7 days)."""
    week = edits[(edits.day < day) & (edits.day >= day - days)].drop_duplicates(["user_id", "item"])
    return np.bincount(week.item, minlength=n_items + 1).astype(np.float64)


def model_scores(model, padded: np.ndarray, known: list[np.ndarray]) -> np.ndarray:
    import torch

    with torch.inference_mode():
        scores = (model.eval().encode(torch.from_numpy(padded)).float() @ model.item_embeddings().float().T).numpy()
    scores[:, 0] = -np.inf
    for r, pages in enumerate(known):
        scores[r, pages] = -np.inf
    return scores


def listed(scores: np.ndarray, news: Lists) -> Realized:
    """HR@K and NDCG@K of each user's top K by ``scores`` against the day's new pages: the backtest's own figures
    (:func:`recsys.model.list_metrics.realized`)."""
    top = np.argpartition(-scores, K, axis=1)[:, :K]
    top = np.take_along_axis(top, np.argsort(-np.take_along_axis(scores, top, 1), axis=1, kind="stable"), 1)
    return realized(Lists(np.arange(len(top) + 1, dtype=np.int64) * K, top.ravel().astype(np.int64)), news, (K,))[K]


def hits(scores: np.ndarray, news: Lists, pop: np.ndarray, weight: float) -> np.ndarray:
    """1 for each user whose top K of the blended scores holds a new page of the day."""
    finite = np.isfinite(scores)
    z = np.where(finite, scores, np.nan)
    z = (z - np.nanmean(z, axis=1, keepdims=True)) / (np.nanstd(z, axis=1, keepdims=True) + 1e-9)
    prior = np.log1p(pop[1:])
    prior = np.concatenate([[0.0], (prior - prior.mean()) / (prior.std() + 1e-9)])
    return listed(np.where(finite, z + weight * prior[None, :], -np.inf), news).hit.astype(np.float64)


def hits_additive(scores: np.ndarray, news: Lists, pop: np.ndarray, bias: float) -> np.ndarray:
    """As :func:`hits`, the prior added in the scores' own units (no standardising per user): the job's prior
    (:func:`recsys.model.repeats.popularity_prior`) with ``bias`` as its popularity_weight."""
    return listed(scores + bias * popularity_prior(pop)[None, :], news).hit.astype(np.float64)


def arguments(description: str) -> argparse.Namespace:
    """The command line this benchmark and :mod:`new_page_fusion` share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--log", type=Path, default=DEFAULT_LOG)
    parser.add_argument("--events", type=Path, help="events in the job's input layout (dt=YYYY-MM-DD/*.parquet) "
                                                    "instead of the Wikipedia CSV")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--from-day", type=int, default=24, help="first night, days since the log's first event")
    parser.add_argument("--to-day", type=int, default=30)
    parser.add_argument("--order", choices=ORDERS, default="latest",
                        help="histories (trained on and served) by each page's latest edit (the job's) or first")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def read_log(args: argparse.Namespace) -> tuple[pd.DataFrame, int]:
    """The log with each event's day and model index (1..N, 0 is padding), and N."""
    edits = read_events(args.events) if args.events else pd.read_csv(args.log)
    edits["day"] = edits.seconds // DAY_S
    pages = np.sort(edits.page_id.unique())
    edits["item"] = np.searchsorted(pages, edits.page_id.to_numpy()) + 1
    return edits, len(pages)


@dataclass(frozen=True)
class Night:
    """A night of the benchmark: the model trained for it, the day before's rows it chose its epochs on and the
    night's own rows, each (histories [U, max_len], new items, known items)."""

    day: int
    model: object
    valid: tuple[np.ndarray, Lists, list[np.ndarray]]
    tonight: tuple[np.ndarray, Lists, list[np.ndarray]]


def trained_nights(edits: pd.DataFrame, n_items: int, args: argparse.Namespace) -> Iterator[Night]:
    """For each night ``args.from_day``..``args.to_day``: the default SASRec with the job's training settings, trained
    on the events before the day before, its epoch count chosen on that day's new items."""
    import torch

    from recsys.config import load_config
    from recsys.learning.settings import model_config, train_settings
    from recsys.model.training import fit

    cfg = load_config()
    config = model_config(cfg.train.model, n_items, "sasrec")
    settings = replace(train_settings(cfg.train, torch.device("cpu")), seed=args.seed)
    for day in range(args.from_day, args.to_day + 1):
        train = Sequences.from_lists(list(histories(edits[edits.day < day - 1], args.order).values()))
        valid_seq, valid_new, valid_known = night(edits, day - 1, config.max_len, args.order)

        def validate(model) -> dict[str, float]:
            return {"ndcg@10": float(listed(model_scores(model, valid_seq, valid_known), valid_new).ndcg.mean())}

        model = fit(train, config, settings, valid=validate).model
        yield Night(day, model, (valid_seq, valid_new, valid_known), night(edits, day, config.max_len, args.order))


def main() -> int:
    args = arguments(__doc__.splitlines()[0])
    edits, n_pages = read_log(args)
    by_weight: dict[float, list[np.ndarray]] = {w: [] for w in WEIGHTS}
    by_bias: dict[tuple[int, float], list[np.ndarray]] = {(d, b): [] for d in WINDOWS for b in BIASES}
    chosen_hits: list[np.ndarray] = []
    started = time.perf_counter()
    for n in trained_nights(edits, n_pages, args):
        day, model = n.day, n.model
        valid_seq, valid_new, valid_known = n.valid
        valid_scores, valid_pop = model_scores(model, valid_seq, valid_known), popularity(edits, day - 1, n_pages)
        on_valid = {w: hits(valid_scores, valid_new, valid_pop, w).mean() for w in WEIGHTS}
        chosen = max(WEIGHTS, key=lambda w: (on_valid[w], -w))      # a tie goes to the smaller weight
        seq, new, known = n.tonight
        scores, pop = model_scores(model, seq, known), popularity(edits, day, n_pages)
        for w in WEIGHTS:
            by_weight[w].append(hits(scores, new, pop, w))
        for d in WINDOWS:
            pop_d = pop if d == 7 else popularity(edits, day, n_pages, d)
            for b in BIASES:
                by_bias[(d, b)].append(hits_additive(scores, new, pop_d, b))
        chosen_hits.append(hits(scores, new, pop, chosen))
        print(f"night {day}: {new.n_rows} users with a new page; w chosen on the day before: {chosen:g}; "
              f"HR@{K} new at w=0 {by_weight[0.0][-1].mean():.3f}, chosen {chosen_hits[-1].mean():.3f}", flush=True)

    rng = np.random.default_rng(0)
    base = np.concatenate(by_weight[0.0])
    draws = rng.integers(0, len(base), (2000, len(base)))
    print(f"\n{len(base):,} user-nights, seed {args.seed}, {time.perf_counter() - started:.0f} s\n")
    print(f"| the model's new-page ranking | HR@{K}, new | paired difference to the model alone [95%] |\n|---|---|---|")
    rows = []
    for name, h in [*((f"+ popularity, w = {w:g}", np.concatenate(v)) for w, v in by_weight.items()),
                    ("+ popularity, w chosen on the day before", np.concatenate(chosen_hits)),
                    *((f"+ {b:g} x log(1 + users of {d} day{'s' * (d > 1)}), added to the scores", np.concatenate(v))
                      for (d, b), v in by_bias.items())]:
        diff = np.sort((h - base)[draws].mean(axis=1))
        rows.append({"ranker": name, "hr": float(h.mean()), "diff": float((h - base).mean()),
                     "low": float(diff[50]), "high": float(diff[1949])})
        print(f"| {name} | {h.mean():.3f} | {(h - base).mean():+.3f} [{diff[50]:+.3f}, {diff[1949]:+.3f}] |")
    if args.json:
        args.json.write_text(json.dumps({"user_nights": len(base), "seed": args.seed, "k": K, "rows": rows}, indent=2)
                             + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
