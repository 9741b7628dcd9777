"""Training throughput by batch size: is a larger batch than ``train.batch_size`` (16) a cheaper epoch here?

    PYTHONPATH=. python benchmarks/batch_throughput.py [--batches 16,32,64,128] \\
        [--users 3000] [--items 5000] [--rounds 4] \\
        [--loss full|sampled] [--negatives 8192] [--json PATH]

The training loop of ``recsys train`` (``recsys.model.training.fit``: the default SASRec, full softmax, the
precision ``auto`` resolves to on this machine, fused AdamW, random window offsets) for one epoch over
synthetic histories of 20..51 items (one training window each) over ``--items`` items (the night benchmark's
catalog size), once per batch size and round, the sizes interleaved round by round so that whatever else the
machine does hits each alike. Prints training windows per second for each (the median over rounds) and the
ratio to the first size. Run it as the job runs (torch's default OpenMP threads): with
``OMP_WAIT_POLICY=PASSIVE`` small batches lose the most (measured: docs/performance.md).

An epoch's cost is its windows divided by this rate: a batch size that does not raise the rate does not
make an epoch cheaper, it only takes fewer, larger optimizer steps. Result: docs/performance.md, "The whole
night against Spark ALS's".
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from recsys.model.configs import SASRecConfig
from recsys.model.training import TrainSettings, fit
from recsys.sequences import Sequences


def histories(users: int, items: int, seed: int = 0) -> Sequences:
    """``users`` random histories of 20..51 items (model indices 1..items): at most ``max_len + 1`` (51) each,
    so every history is exactly one training window, whatever an epoch's offsets."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 52, users)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Sequences(offsets=offsets, items=rng.integers(1, items + 1, offsets[-1]).astype(np.int64))


def windows_per_second(train: Sequences, items: int, batch_size: int, loss: str = "full",
                       negatives: int = 8192) -> float:
    """One epoch of the default training loop at ``batch_size``: training windows per second."""
    settings = TrainSettings(epochs=1, batch_size=batch_size, learning_rate=1e-3, weight_decay=0.1,
                             window_offsets="random", precision="auto", loss=loss, negatives=negatives)
    started = time.perf_counter()
    result = fit(train, SASRecConfig(num_items=items), settings)
    seconds = time.perf_counter() - started
    assert len(result.curve) == 1
    return len(train) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,32,64,128", help="batch sizes, the first is the reference")
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--loss", choices=("full", "sampled"), default="full", help="train.loss (default full)")
    parser.add_argument("--negatives", type=int, default=8192, help="train.negatives, with --loss sampled")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batches.split(",")]
    train = histories(args.users, args.items)
    # warm-up: the first call's one-off costs (kernel selection, allocations) land on no size
    windows_per_second(train, args.items, sizes[0], args.loss, args.negatives)
    rates: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(args.rounds):
        for b in sizes:
            rates[b].append(windows_per_second(train, args.items, b, args.loss, args.negatives))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    loss = f"{args.loss} ({args.negatives} negatives)" if args.loss == "sampled" else args.loss
    print(f"{cpu}; {args.users} users, {args.items} items, loss {loss}, {args.rounds} rounds (median windows/s)")
    print("| batch_size | windows/s | rounds | ratio to the first |\n|---|---|---|---|")
    reference = statistics.median(rates[sizes[0]])
    for b in sizes:
        rate = statistics.median(rates[b])
        print(f"| {b} | {rate:.0f} | {', '.join(f'{r:.0f}' for r in rates[b])} | {rate / reference:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "users": args.users, "items": args.items, "loss": args.loss,
                       "negatives": args.negatives, "rates": rates}, f, indent=1)


if __name__ == "__main__":
    main()
