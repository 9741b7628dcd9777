"""Sampled softmax against the full softmax (issue 21, part 3): quality and speed, side by side in one run.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/sampled_softmax.py --data .bench/ml-small
        [--seeds 2] [--epochs 20] [--negatives 512,2048] [--synthetic-items 200000]
        [--synthetic-negatives 2048,8192] [--synthetic-steps 30] [--json .bench/sampled_softmax.json]

Part 1, ml-latest-small (9.7k items, where both fit): the default SASRec trained on the `loo` split's
validation phase exactly as benchmarks/tune_grid.py trains it (the project's history builder, tie
seed 7, recsys/default.yaml's train settings, early stopping on the validation interaction, at
most ``--epochs``), once with the full softmax and once per ``--negatives`` with the sampled one.
The figure is the best validation NDCG@10; the test interaction is never scored. Training seconds
per epoch leave the validation's time out.

Part 2, a synthetic catalog of ``--synthetic-items`` items (ml-latest-small is too small to show
what the sampled softmax is for): random Zipf-distributed sequences, one training window per user,
``--synthetic-steps`` optimizer steps of the default batch, timed per step with each loss.

Everything runs in this one process with one torch thread, one training at a time, and the
configurations alternate (their order reverses from one seed or round to the next) so that other
load on the machine falls on all of them alike: compare the ratios within one run, not the
seconds between runs.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from dataclasses import replace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")       # no spinning threads between trainings


def _configs(negatives: list[int]) -> list[tuple[str, dict]]:
    """(label, TrainSettings overrides): the full softmax, then the sampled one per negatives count."""
    return [("full", {"loss": "full"})] + [(f"sampled {n}", {"loss": "sampled", "negatives": n}) for n in negatives]


def _interleaved(configs: list, round_: int) -> list:
    return configs if round_ % 2 == 0 else configs[::-1]


def movielens(args, cfg) -> list[dict]:
    """Part 1: validation NDCG@10 and training seconds per epoch on ml-latest-small, per config and seed."""
    from recsys.evaluation import protocols
    from recsys.evaluation.ranking import SequenceModelScorer, rank_phase
    from recsys.learning.settings import model_config, train_settings
    from recsys.learning.split import build_vocabulary
    from recsys.model.training import fit
    from recsys.spark.session import build_session

    spark = build_session(cfg.spark, app_name="sampled-softmax")
    try:
        split = protocols.load_loo(spark, args.data, tie_break_seed=7, event_types=cfg.history.event_types)
    finally:
        spark.stop()
    valid = split.valid
    vocab = build_vocabulary(valid.history, cfg.train.min_item_count)
    train, _ = vocab.map_sequences(valid.history)
    config = model_config(cfg.train.model, len(vocab.item_ids), "sasrec")
    base = replace(train_settings(cfg.train), epochs=args.epochs, num_threads=1)
    print(f"{split.info}; {valid.users} validation users; {len(vocab.item_ids)} items; {config}; {base}", flush=True)

    rows = []
    for i in range(args.seeds):
        seed = cfg.train.seed + i
        for label, overrides in _interleaved(_configs(args.negatives), i):
            validation_seconds = []

            def validate(model):
                started = time.perf_counter()
                metrics = rank_phase(SequenceModelScorer(model, vocab.item_ids, valid), valid, (10,)).means()
                validation_seconds.append(time.perf_counter() - started)
                return metrics

            settings = replace(base, seed=seed, **overrides)
            result = fit(train, config, settings, valid=validate)
            epochs = len(result.curve)
            train_seconds = sum(r["seconds"] for r in result.curve) - sum(validation_seconds)
            row = {"config": label, "seed": seed, "valid_ndcg@10": result.best_metrics["ndcg@10"],
                   "valid_hr@10": result.best_metrics["hr@10"], "best_epoch": result.best_epoch,
                   "epochs_run": epochs, "train_seconds_per_epoch": train_seconds / epochs,
                   "final_train_loss": result.curve[-1]["train_loss"]}
            rows.append(row)
            print(f"{label:>14} seed {seed}: valid ndcg@10 {row['valid_ndcg@10']:.4f}  hr@10 {row['valid_hr@10']:.4f}  "
                  f"best epoch {result.best_epoch}/{epochs}  {row['train_seconds_per_epoch']:.1f} s/epoch "
                  f"(training only)  train loss {row['final_train_loss']:.3f}", flush=True)
    return rows


def synthetic(args, cfg) -> list[dict]:
    """Part 2: seconds per optimizer step on a large synthetic catalog, per config and round."""
    import numpy as np

    from recsys.learning.settings import model_config, train_settings
    from recsys.model.training import fit
    from recsys.sequences import Sequences

    n_items = args.synthetic_items
    config = model_config(cfg.train.model, n_items, "sasrec")
    base = replace(train_settings(cfg.train), epochs=1, num_threads=1, window_offsets="fixed")
    users = args.synthetic_steps * base.batch_size                      # one window of max_len + 1 per user
    rng = np.random.default_rng(0)
    popularity = 1.0 / np.arange(1, n_items + 1)
    items = rng.choice(n_items, (users, config.max_len + 1), p=popularity / popularity.sum()) + 1
    train = Sequences.from_lists(list(items))
    print(f"\nsynthetic: {n_items} items, {users} users x {config.max_len + 1} items, "
          f"{args.synthetic_steps} steps of {base.batch_size} windows", flush=True)

    rows = []
    for round_ in range(args.synthetic_rounds):
        for label, overrides in _interleaved(_configs(args.synthetic_negatives), round_):
            result = fit(train, config, replace(base, seed=round_, **overrides))
            seconds = result.curve[0]["seconds"] / args.synthetic_steps
            rows.append({"config": label, "round": round_, "seconds_per_step": seconds})
            print(f"{label:>14} round {round_}: {seconds * 1000:.0f} ms/step", flush=True)
    return rows


def main() -> None:
    import torch

    from recsys.config import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset root in the input layout (recsys import-movielens --out)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--negatives", default="512,2048", help="sampled softmax sizes on ml-latest-small")
    p.add_argument("--synthetic-items", type=int, default=200_000)
    p.add_argument("--synthetic-negatives", default="2048,8192")
    p.add_argument("--synthetic-steps", type=int, default=30)
    p.add_argument("--synthetic-rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    a.negatives = [int(x) for x in a.negatives.split(",") if x]
    a.synthetic_negatives = [int(x) for x in a.synthetic_negatives.split(",") if x]
    torch.set_num_threads(1)

    cfg = load_config(overrides=["spark.master=local[2]"])
    started = time.perf_counter()
    ml = movielens(a, cfg) if a.seeds > 0 else []
    syn = synthetic(a, cfg) if a.synthetic_steps > 0 and a.synthetic_rounds > 0 else []
    total = time.perf_counter() - started
    print(f"\n{dt.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"1 thread; {total:.0f} s in all\n")

    if ml:
        full = {r["seed"]: r for r in ml if r["config"] == "full"}
        print("| ml-latest-small | valid NDCG@10, mean over seeds | by seed | best epoch | "
              "training s/epoch | time vs full |")
        print("|---|---|---|---|---|---|")
        for label, _ in _configs(a.negatives):
            mine = [r for r in ml if r["config"] == label]
            ndcg = [r["valid_ndcg@10"] for r in mine]
            ratio = statistics.fmean(r["train_seconds_per_epoch"] / full[r["seed"]]["train_seconds_per_epoch"]
                                     for r in mine)
            print(f"| {label} | {statistics.fmean(ndcg):.4f} | {' / '.join(f'{v:.4f}' for v in ndcg)} | "
                  f"{'/'.join(str(r['best_epoch']) for r in mine)} | "
                  f"{statistics.fmean(r['train_seconds_per_epoch'] for r in mine):.1f} | {ratio:.2f} |")
    if syn:
        full_ms = statistics.fmean(r["seconds_per_step"] for r in syn if r["config"] == "full") * 1000
        print(f"\n| {a.synthetic_items} items, synthetic | ms/step, by round | mean | time vs full |")
        print("|---|---|---|---|")
        for label, _ in _configs(a.synthetic_negatives):
            ms = [r["seconds_per_step"] * 1000 for r in syn if r["config"] == label]
            print(f"| {label} | {' / '.join(f'{v:.0f}' for v in ms)} | {statistics.fmean(ms):.0f} | "
                  f"{statistics.fmean(ms) / full_ms:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": str(dt.date.today()), "args": vars(a), "movielens": ml, "synthetic": syn,
                       "seconds": total}, f, indent=2)


if __name__ == "__main__":
    main()
