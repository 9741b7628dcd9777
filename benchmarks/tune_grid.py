"""The tuning grid of issue 20: training settings compared on the VALIDATION phase only, several seeds each.

    PYTHONPATH=. python benchmarks/tune_grid.py --data .bench/ml-small [--seeds 3] [--workers 2]
        [--points base,dropout_0.3] [--json .bench/tune_grid.json]

The grid (``GRID`` below) was fixed before any test figure of the new training was looked at, and
it changes one setting at a time from the default of recsys/default.yaml as it was then (``base``,
``BASE`` below). Result (docs/quality.md, "The tuning grid"): random window offsets, now the default. Every point is trained with each seed on the `loo`
split's validation phase exactly as `recsys evaluate` trains it (the project's history builder,
tie seed 7; early stopping on the validation interaction), and the figure is the best validation
NDCG@10. The test interaction is built (the split is one object) but never scored here, so choosing
the default from this table is fair. Seeds differ in initialisation and batch order; the spread
over seeds says which differences are noise.

Trainings run in ``--workers`` processes of one torch thread each (on 2 cores, two one-thread
trainings finish sooner than two-thread trainings one after the other); times per epoch are
comparable within one run only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

from loo_validation import load

# What the grid varied from: recsys/default.yaml as it was when the grid ran (2026-12-01), whose windows
# were fixed; the grid chose random offsets, now the default, so "base" pins the old value.
BASE = {"window_offsets": "fixed"}
# point -> overrides of train.* (and train.model.sasrec.* under "model"), applied over BASE
GRID: dict[str, dict] = {
    "base": {},
    "dropout_0.1": {"model": {"dropout": 0.1}},
    "dropout_0.3": {"model": {"dropout": 0.3}},
    "heads_1": {"model": {"heads": 1}},
    "weight_decay_0.3": {"weight_decay": 0.3},
    "warmup_2_cosine": {"warmup_epochs": 2, "lr_decay": "cosine"},
    "random_offsets": {"window_offsets": "random"},
}


def _train(point: str, overrides: dict, seed: int, train, valid, item_ids, cfg_dict: dict, base: dict = BASE
           ) -> dict:
    """One training (in a worker process): the point's settings over ``base``, one seed, validation figures."""
    import torch

    from recsys.evaluation.ranking import SequenceModelScorer, rank_phase
    from recsys.model.configs import SASRecConfig
    from recsys.model.training import TrainSettings, fit

    torch.set_num_threads(1)
    model = {**cfg_dict["model"], **overrides.get("model", {})}
    config = SASRecConfig(num_items=len(item_ids), **model)
    train_fields = {**base, **{k: v for k, v in overrides.items() if k != "model"}}
    settings = replace(TrainSettings(**cfg_dict["settings"]), seed=seed, num_threads=1, **train_fields)

    def validate(m):
        return rank_phase(SequenceModelScorer(m, item_ids, valid), valid, (10,)).means()

    started = time.perf_counter()
    result = fit(train, config, settings, valid=validate)
    seconds = time.perf_counter() - started
    return {"point": point, "seed": seed, "valid_ndcg@10": result.best_metrics["ndcg@10"],
            "valid_hr@10": result.best_metrics["hr@10"], "best_epoch": result.best_epoch,
            "epochs_run": len(result.curve), "seconds_per_epoch": seconds / len(result.curve), "items": len(item_ids)}


def seed_summary(rows: list[dict]) -> dict:
    """One point's trainings (a row a seed, as :func:`_train` returns them) -> the mean, spread and per-seed figures
    its table row shows."""
    values = [r["valid_ndcg@10"] for r in rows]
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else float("nan"),
            "by_seed": values, "hr@10": statistics.fmean(r["valid_hr@10"] for r in rows),
            "best_epochs": [r["best_epoch"] for r in rows],
            "seconds_per_epoch": statistics.fmean(r["seconds_per_epoch"] for r in rows)}


def main() -> None:
    from recsys.learning.settings import train_settings

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset root in the input layout (recsys import-movielens --out)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--points", default=",".join(GRID), help="comma-separated grid points (default: all)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    points = a.points.split(",")
    unknown = [x for x in points if x not in GRID]
    if unknown:
        raise SystemExit(f"unknown grid point(s) {unknown}; the grid: {', '.join(GRID)}")

    data = load(a.data, app_name="tune-grid")
    cfg, split, vocab, train = data.cfg, data.split, data.vocab, data.train
    valid = split.valid
    settings = train_settings(cfg.train)
    cfg_dict = {"model": cfg.train.model.sasrec.model_dump(), "settings": settings.__dict__}
    print(f"{split.info}; {valid.users} validation users; base: {cfg_dict}", flush=True)

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")       # no spinning threads between trainings
    jobs = [(point, GRID[point], cfg.train.seed + i) for point in points for i in range(a.seeds)]
    rows = []
    started = time.perf_counter()
    with ProcessPoolExecutor(a.workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_train, point, overrides, seed, train, valid, vocab.item_ids, cfg_dict)
                   for point, overrides, seed in jobs]
        for future in futures:
            row = future.result()
            rows.append(row)
            print(f"{row['point']:>18} seed {row['seed']}: valid ndcg@10 {row['valid_ndcg@10']:.4f}  "
                  f"hr@10 {row['valid_hr@10']:.4f}  best epoch {row['best_epoch']}/{row['epochs_run']}  "
                  f"{row['seconds_per_epoch']:.1f} s/epoch", flush=True)

    print(f"\n{len(jobs)} trainings in {time.perf_counter() - started:.0f} s\n")
    print("| point | valid NDCG@10, mean over seeds | sd | by seed | best epoch | s/epoch |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for point in points:
        s = summary[point] = seed_summary([r for r in rows if r["point"] == point])
        print(f"| {point} | {s['mean']:.4f} | {s['sd']:.4f} | {' / '.join(f'{v:.4f}' for v in s['by_seed'])} | "
              f"{'/'.join(map(str, s['best_epochs']))} | {s['seconds_per_epoch']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"grid": {p: GRID[p] for p in points}, "rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
