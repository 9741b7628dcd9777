"""Seconds per training epoch by ``train.batching``, on one log, the batchings interleaved round by round.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/batching_speed.py --data .bench/ml-small \\
        [--rounds 6] [--epochs 2] [--batchings random,by_length,by_length-exact] [--threads 2] [--json F]

Each point trains the default model with the default settings (``recsys/default.yaml``, ``train.precision``
resolved for this CPU) on the ``loo`` split's validation histories, as benchmarks/train_speed.py does, for
``--epochs`` epochs without validation; only ``train.batching`` differs. ``by_length-exact`` is by-length batching
with each batch cut to its exact longest window (``recsys.model.training.WIDTH_MULTIPLE`` set to 1 for that
point), the way it was before the widths were rounded to a multiple of 8. Rounds run the points in turn, so
whatever else the machine does hits every point alike; the table gives each point's median. On a shared VM a
single epoch's time varies by 10-20% from one minute to the next: read the medians, as ratios, within one run.
Result: docs/quality.md, "Batches by length".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from unittest import mock

from loo_validation import load

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # no spinning OpenMP threads between steps and trainings

BATCHINGS = "random,by_length,by_length-exact"


def main() -> None:
    import torch

    from recsys.learning.settings import model_config, train_settings
    from recsys.model import training

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset root in the input layout (recsys import-movielens --out)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=2, help="epochs of each timed training (default 2)")
    p.add_argument("--batchings", default=BATCHINGS, help=f"points, comma-separated (default {BATCHINGS})")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    points = [x for x in a.batchings.split(",") if x]
    for point in points:
        if point.removesuffix("-exact") not in training.BATCHINGS or (point.endswith("-exact")
                                                                       and not point.startswith("by_length")):
            raise SystemExit(f"--batchings: unknown point {point!r}; choose from {BATCHINGS}")

    data = load(a.data, app_name="batching-speed")
    cfg, split, vocab, train = data.cfg, data.split, data.vocab, data.train
    config = model_config(cfg.train.model, len(vocab), "sasrec")
    base = replace(train_settings(cfg.train, torch.device("cpu")), num_threads=a.threads, epochs=max(a.epochs, 2))
    torch.set_num_threads(a.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}: {os.cpu_count()} CPUs, torch {torch.__version__}, precision "
          f"{base.precision}, {a.threads} thread(s); {split.info}; {len(train.lengths)} users", flush=True)

    seconds: dict[str, list[float]] = {point: [] for point in points}
    for rnd in range(1, a.rounds + 1):
        for point in points:
            settings = replace(base, batching=point.removesuffix("-exact"))
            multiple = 1 if point.endswith("-exact") else training.WIDTH_MULTIPLE
            with mock.patch.object(training, "WIDTH_MULTIPLE", multiple):
                started = time.perf_counter()
                training.fit(train, config, settings, stop_after=a.epochs)
            seconds[point].append((time.perf_counter() - started) / a.epochs)
            print(f"round {rnd} {point:>16}: {seconds[point][-1]:.2f} s/epoch", flush=True)

    first = points[0]
    median = {point: statistics.median(v) for point, v in seconds.items()}
    print(f"\n| batching | s/epoch, median of {a.rounds} (min-max) | against {first} |\n|---|---|---|")
    for point in points:
        print(f"| {point} | {median[point]:.2f} ({min(seconds[point]):.2f}-{max(seconds[point]):.2f}) | "
              f"{median[first] / median[point]:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seconds_per_epoch": seconds, "median": median, "threads": a.threads,
                       "epochs": a.epochs}, f, indent=2)


if __name__ == "__main__":
    main()
