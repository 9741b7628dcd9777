"""CPU time of counting the item-to-item fit's co-occurring pairs, the two forms a task can take, on the same users:
a sort per chunk (``recsys.model.item_to_item.pair_counts``: sparse keys, for catalogs too large for dense counts)
and a ``bincount`` per chunk into two dense arrays (``add_pair_counts``: what a task does at up to
``DENSE_ITEMS`` weighted items, the default's 2,000 included). The run checks that both give the same counts
before it reports.

    python benchmarks/pair_counts.py [--users 20000] [--items 2000] [--mean-items 30]
        [--data DATASET --date D]

Synthetic users: a Poisson number of distinct items each (mean ``--mean-items``), drawn uniformly among
``--items``, the newest held out. CPU time (``time.process_time``), the median of 3 interleaved runs.

With ``--data`` (a dataset root in the input layout, e.g. what ``recsys sample-data`` writes) and ``--date``: also
the whole fit as training runs it (``recsys.learning.item_to_item.fit_item_to_item`` over the window before the
date, in one local Spark process, the window read and kept before the clock), twice, wall seconds: where the
pair counts stand among Spark's aggregations.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recsys.model.item_to_item import add_pair_counts, pair_counts  # noqa: E402


def synthetic_users(users: int, items: int, mean_items: float, seed: int = 0):
    """(offsets [U + 1], positions [S], held [S]): each user's distinct items, the last one held out."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.poisson(mean_items, users), items)
    positions = np.concatenate([rng.choice(items, n, replace=False) for n in lengths])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    held = np.zeros(len(positions), dtype=bool)
    held[offsets[1:][lengths > 0] - 1] = True
    return offsets, positions, held


def sorted_counts(offsets, positions, held, items: int) -> tuple[np.ndarray, np.ndarray]:
    every = np.zeros(items * items, dtype=np.int64)
    trained = np.zeros_like(every)
    for keys, all_, kept in pair_counts(offsets, positions, held, items):
        every[keys] += all_
        trained[keys] += kept
    return every, trained


def dense_counts(offsets, positions, held, items: int) -> tuple[np.ndarray, np.ndarray]:
    every = np.zeros(items * items, dtype=np.int64)
    trained = np.zeros_like(every)
    add_pair_counts(offsets, positions, held, items, every, trained)
    return every, trained


def whole_fit(data: Path, date: dt.date) -> list[float]:
    """Wall seconds of two fits of training's item-to-item weights on ``data``'s window before ``date``."""
    from recsys.config import load_config
    from recsys.learning.item_to_item import fit_item_to_item
    from recsys.learning.shards import training_events, training_window
    from recsys.spark.session import build_session

    cfg = load_config(None, [f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}"])
    spark = build_session(cfg.spark)
    seconds = []
    with training_window(spark, cfg, date) as kept:
        events = training_events(spark, cfg, date, kept)
        print(f"{data}: {events.count():,} events in the window before {date}", flush=True)
        for _ in range(2):
            t0 = time.perf_counter()
            fit_item_to_item(events, cfg)
            seconds.append(time.perf_counter() - t0)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--items", type=int, default=2_000)
    parser.add_argument("--mean-items", type=float, default=30.0)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--date", type=dt.date.fromisoformat)
    args = parser.parse_args(argv)
    if (args.data is None) != (args.date is None):
        parser.error("--data and --date go together: the dataset and the night whose window the fit reads")
    offsets, positions, held = synthetic_users(args.users, args.items, args.mean_items)
    lengths = np.diff(offsets)
    pairs = int((lengths * (lengths + 1) // 2).sum())
    times = {"sort (pair_counts)": [], "bincount (add_pair_counts)": []}
    for _ in range(3):
        for name, count in zip(times, (sorted_counts, dense_counts)):
            t0 = time.process_time()
            result = count(offsets, positions, held, args.items)
            times[name].append(time.process_time() - t0)
            if name.startswith("sort"):
                expected = result
            elif not all((a == b).all() for a, b in zip(result, expected)):
                raise SystemExit("the two forms counted different pairs: a bug, not a timing")
    print(f"{args.users:,} users, {args.items:,} items, {pairs:,} pairs (each user's items and itself, halved)")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:28s} {median:6.2f} s CPU   {median / pairs * 1e9:6.1f} ns a pair")
    if args.data is not None:
        first, second = whole_fit(args.data, args.date)
        print(f"the whole fit (fit_item_to_item): {first:.1f} s, then {second:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
