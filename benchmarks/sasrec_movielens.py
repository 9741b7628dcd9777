"""Train SASRec on MovieLens ml-latest-small, validate on each user's last item; prints the curve.

    PYTHONPATH=. python benchmarks/sasrec_movielens.py [--epochs 30] [--threads 2] [--ratings PATH]

Protocol as in DESIGN.md section 5: per user, ratings sorted by timestamp with ties broken by a
seeded random key (never by item id); the last item is the validation target, the rest is both
training data and the history the model reads; history items are excluded from the full ranking.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from recsys.model.sasrec import SASRecConfig
from recsys.model.training import TrainSettings, ValidationSet, fit, training_windows
from recsys.sequences import Sequences


def load(path: str, seed: int = 7) -> tuple[Sequences, np.ndarray, int]:
    r = pd.read_csv(path, usecols=["userId", "movieId", "timestamp"])
    r["tie"] = np.random.default_rng(seed).random(len(r))
    r = r.sort_values(["userId", "timestamp", "tie"], kind="stable")
    ids, index = np.unique(r["movieId"].to_numpy(), return_inverse=True)
    items = (index + 1).astype(np.int64)
    lengths = r.groupby("userId", sort=True).size().to_numpy()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Sequences(offsets, items), ids, len(ids)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ratings", default="data/ml-latest-small/ratings.csv")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--max-len", type=int, default=50)
    a = p.parse_args()
    seqs, _, num_items = load(a.ratings)
    ends = seqs.offsets[1:]
    targets = seqs.items[ends - 1]
    keep = np.ones(len(seqs.items), dtype=bool)
    keep[ends - 1] = False
    lengths = seqs.lengths - 1
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    train = Sequences(offsets, seqs.items[keep])
    windows = training_windows(train, a.max_len)
    print(f"{len(seqs)} users, {len(seqs.items):,} interactions, {num_items:,} items, "
          f"longest {seqs.lengths.max():,}; {len(windows):,} training windows of {a.max_len + 1}")
    config = SASRecConfig(num_items=num_items, max_len=a.max_len, dropout=a.dropout)
    settings = TrainSettings(epochs=a.epochs, patience=a.patience, num_threads=a.threads)
    started = time.perf_counter()
    result = fit(train, config, settings, valid=ValidationSet(train, targets),
                 progress=lambda row: print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True))
    print(f"best epoch {result.best_epoch}: {result.best_metrics}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
