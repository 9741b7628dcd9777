"""Training speed on one machine (issue 21, part 4): the old default against the new, side by side.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python benchmarks/train_speed.py --data .bench/ml-small \\
        [--seeds 3] [--threads 1] [--levers old,bf16,fused,bf16+fused,new] [--lever-epochs 3] \\
        [--points old,new] [--json benchmarks/train_speed.json]

What ``recsys train`` costs is a selection run (early stopping on each user's held-out newest item)
plus a refit of the chosen epoch count on every interaction. Each point here is trained on the
``loo`` split's validation phase exactly as benchmarks/tune_grid.py trains it (the project's
history builder, tie seed 7, early stopping on the validation interaction; the test interaction is
never scored), and the refit is estimated as ``best_epoch`` more epochs at the run's own seconds per
epoch (the refit's data is the same histories plus one item per user, 0.6% more here). The figure
of merit is the total, ``select + refit``, as a ratio to the old default's, at the same validation
NDCG@10 (mean and sd over seeds).

Points (``POINTS``): ``old`` is recsys/default.yaml's train section before issue 21 (fp32, batch 16,
lr 0.001, patience 10, 40 epochs) with torch's CPU AdamW; ``new`` is recsys/default.yaml as it is now,
read through the project's own config (``train.precision: auto`` resolved for this CPU) with the
fused AdamW; the others change one lever from ``old``. ``--levers`` compares their time per epoch
in short runs (no validation, two interleaved rounds); ``--points`` trains them in full. The epoch cap
is shown without retraining: "old, epochs capped at N" is read off old's own curves. Trainings run
one at a time, in this process, with ``--threads`` torch threads, and are interleaved per seed (old,
..., new, then the next seed), so whatever else the machine is doing hits every point alike: compare
the times only as ratios within one run. Result: docs/performance.md, "Training speed on one machine".
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from unittest import mock

from loo_validation import load

# recsys/default.yaml's train section before issue 21 (the model section is unchanged)
OLD = {"epochs": 40, "batch_size": 16, "learning_rate": 1e-3, "weight_decay": 0.1, "patience": 10,
       "warmup_epochs": 0.0, "lr_decay": "constant", "window_offsets": "random", "precision": "fp32"}
# point -> (overrides of OLD, fused AdamW); "new" is special: the current default config, whatever it says,
# with the current code (fused AdamW). Before issue 21 the AdamW was torch's CPU default, a loop over tensors.
POINTS: dict[str, tuple[dict, bool]] = {
    "old": ({}, False),
    "bf16": ({"precision": "bf16"}, False),
    "fused": ({}, True),
    "bf16+fused": ({"precision": "bf16"}, True),
    "new": ({}, True),
}
LEVERS = "old,bf16,fused,bf16+fused,new"   # the per-epoch comparison (short runs)
TRAININGS = "old,new"                      # the full early-stopped comparison


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the record."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def point_settings(point: str, new_settings, threads: int):
    """The TrainSettings of a point: the current default for ``new``, OLD plus the point's overrides otherwise."""
    if point == "new":
        return replace(new_settings, num_threads=threads)
    return replace(new_settings, **{**OLD, **POINTS[point][0]}, num_threads=threads)


def adamw(fused: bool) -> contextlib.AbstractContextManager:
    """Training's AdamW fused (the code now) or torch's CPU default (the code before issue 21), for a ``with``."""
    from recsys.model import training

    return mock.patch.object(training, "FUSED_ADAMW_DEVICES", training.FUSED_ADAMW_DEVICES if fused else ())


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch starts OpenMP: no spinning threads between
    import torch                                          # steps and trainings (here, not at import: other scripts
                                                          # import cpu_model)

    from recsys.evaluation.ranking import SequenceModelScorer, rank_phase
    from recsys.learning.settings import model_config, train_settings
    from recsys.model.precision import cpu_bf16_supported
    from recsys.model.training import fit

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset root in the input layout (recsys import-movielens --out)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per training (default 1)")
    p.add_argument("--levers", default=LEVERS, help=f"points whose time per epoch is compared in short runs, 'old' "
                                                   f"first; '' for none (default {LEVERS})")
    p.add_argument("--lever-epochs", type=int, default=3, help="epochs of each short run (default 3)")
    p.add_argument("--points", default=TRAININGS, help=f"points trained in full with early stopping, 'old' first "
                                                      f"(default {TRAININGS}); '' for none")
    p.add_argument("--epochs", type=int, default=None, help="cap every point at this many epochs (a quick check "
                                                            "of the script; not the comparison)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    levers = [x for x in a.levers.split(",") if x]
    points = [x for x in a.points.split(",") if x]
    for name, chosen in (("--levers", levers), ("--points", points)):
        if chosen and (chosen[0] != "old" or any(x not in POINTS for x in chosen)):
            raise SystemExit(f"{name} must start with old and name only {', '.join(POINTS)}; got {','.join(chosen)!r}")

    data = load(a.data, app_name="train-speed")
    cfg, split, vocab, train = data.cfg, data.split, data.vocab, data.train
    valid = split.valid
    config = model_config(cfg.train.model, len(vocab), "sasrec")
    new = train_settings(cfg.train, torch.device("cpu"))   # train.precision resolved for this CPU
    settings = {point: point_settings(point, new, a.threads) for point in POINTS}
    if a.epochs is not None:
        settings = {point: replace(x, epochs=a.epochs, patience=min(x.patience, a.epochs)) for point, x in settings.items()}
    torch.set_num_threads(a.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()}, {os.cpu_count()} CPUs, native bf16: "
          f"{cpu_bf16_supported()}, torch {torch.__version__}, {a.threads} torch thread(s) per training; "
          f"{split.info}; {valid.users} validation users", flush=True)
    for point in dict.fromkeys(levers + points):
        print(f"  {point}: {settings[point]}, fused AdamW {POINTS[point][1]}", flush=True)

    def validate(m):
        return rank_phase(SequenceModelScorer(m, vocab.item_ids, valid), valid, (10,)).means()

    started = time.perf_counter()
    lever_rows = []
    if levers:                                     # time per epoch, no validation, two interleaved rounds
        print(f"\nTime per epoch, {a.lever_epochs}-epoch runs, seed {cfg.train.seed}, two rounds:", flush=True)
        for _ in range(2):
            for point in levers:
                short = replace(settings[point], seed=cfg.train.seed, epochs=max(a.lever_epochs, 2),
                                warmup_epochs=0.0)
                with adamw(POINTS[point][1]):
                    t0 = time.perf_counter()
                    fit(train, config, short, stop_after=a.lever_epochs)
                    lever_rows.append({"point": point, "seconds_per_epoch": (time.perf_counter() - t0) / a.lever_epochs})
                print(f"{point:>12}: {lever_rows[-1]['seconds_per_epoch']:.2f} s/epoch", flush=True)
        print("\n" + lever_table(lever_rows, levers), flush=True)

    rows = []
    for i in range(a.seeds if points else 0):      # interleaved: old, ..., new for one seed, then the next
        seed = cfg.train.seed + i
        for point in points:
            with adamw(POINTS[point][1]):
                t0 = time.perf_counter()
                result = fit(train, config, replace(settings[point], seed=seed), valid=validate)
                select_s = time.perf_counter() - t0
            per_epoch = select_s / len(result.curve)
            curve = [r["ndcg@10"] for r in result.curve]
            row = {"point": point, "seed": seed, "valid_ndcg@10": result.best_metrics["ndcg@10"],
                   "last10_ndcg@10": statistics.fmean(curve[-10:]),
                   "best_epoch": result.best_epoch, "epochs_run": len(result.curve), "seconds_per_epoch": per_epoch,
                   "select_s": select_s, "refit_s": result.best_epoch * per_epoch,
                   "total_s": select_s + result.best_epoch * per_epoch, "curve": curve}
            rows.append(row)
            print(f"{point:>12} seed {seed}: valid ndcg@10 {row['valid_ndcg@10']:.4f}  best epoch "
                  f"{row['best_epoch']}/{row['epochs_run']}  {per_epoch:.2f} s/epoch  select {select_s:.0f} s  "
                  f"+ refit {row['refit_s']:.0f} s = {row['total_s']:.0f} s", flush=True)

    print(f"\nall in {time.perf_counter() - started:.0f} s\n")
    summary = {}
    if rows:
        cap = settings["new"].epochs
        if "new" in points and cap < settings["old"].epochs:   # the epoch cap alone, read off old's own curves
            derived = f"old, epochs capped at {cap}"
            rows += [capped(r, cap, settings["old"].patience, derived) for r in rows if r["point"] == "old"]
            points = [points[0], derived, *points[1:]]
        summary = summarise(rows, points)
        print(table(summary, points))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": a.threads,
                       "settings": {p: {**settings[p].__dict__, "fused_adamw": POINTS[p][1]} for p in POINTS},
                       "levers": lever_rows, "rows": rows, "summary": summary}, f, indent=2)


def capped(row: dict, cap: int, patience: int, name: str) -> dict:
    """What ``row``'s training would have given with at most ``cap`` epochs: the same run, stopped earlier.

    Exact, not a model of it: training is deterministic and the epochs before the cap do not depend on it
    (the learning rate is constant; with a decaying schedule the horizon would move and this would not hold).
    """
    curve = row["curve"][:cap]
    best_epoch, run = 0, len(curve)
    for epoch, value in enumerate(curve, 1):
        if best_epoch == 0 or value > curve[best_epoch - 1]:
            best_epoch = epoch
        if epoch - best_epoch >= patience:
            run = epoch
            break
    per_epoch = row["seconds_per_epoch"]
    return {**row, "point": name, "valid_ndcg@10": curve[best_epoch - 1], "last10_ndcg@10": statistics.fmean(curve[:run][-10:]),
            "best_epoch": best_epoch, "epochs_run": run, "select_s": run * per_epoch, "refit_s": best_epoch * per_epoch,
            "total_s": (run + best_epoch) * per_epoch, "curve": curve[:run]}


def lever_table(rows: list[dict], levers: list[str]) -> str:
    """Seconds per epoch of each point (mean of its runs) and the speed-up over ``old``."""
    mean = {p: statistics.fmean(r["seconds_per_epoch"] for r in rows if r["point"] == p) for p in levers}
    lines = ["| point | s/epoch | speed-up per epoch |", "|---|---|---|"]
    lines += [f"| {p} | {mean[p]:.2f} | {mean['old'] / mean[p]:.2f}x |" for p in levers]
    return "\n".join(lines)


def summarise(rows: list[dict], points: list[str]) -> dict[str, dict]:
    """Per point: means over seeds, the NDCG's sd, and the total time as a ratio to ``old``'s (mean of totals)."""
    out: dict[str, dict] = {}
    for point in points:
        mine = [r for r in rows if r["point"] == point]
        ndcg = [r["valid_ndcg@10"] for r in mine]
        out[point] = {
            "ndcg_mean": statistics.fmean(ndcg), "ndcg_sd": statistics.stdev(ndcg) if len(ndcg) > 1 else float("nan"),
            "ndcg_by_seed": ndcg, "best_epochs": [r["best_epoch"] for r in mine],
            "last10_mean": statistics.fmean(r["last10_ndcg@10"] for r in mine),
            "epochs_run": [r["epochs_run"] for r in mine],
            "seconds_per_epoch": statistics.fmean(r["seconds_per_epoch"] for r in mine),
            "select_s": statistics.fmean(r["select_s"] for r in mine),
            "total_s": statistics.fmean(r["total_s"] for r in mine),
        }
    for point in points:
        out[point]["speedup"] = out["old"]["total_s"] / out[point]["total_s"]
        out[point]["speedup_per_epoch"] = out["old"]["seconds_per_epoch"] / out[point]["seconds_per_epoch"]
    return out


def table(summary: dict[str, dict], points: list[str]) -> str:
    lines = ["| point | epochs to best | epochs run | s/epoch | select s | select + refit s | speed-up | "
             "valid NDCG@10, mean ± sd | by seed | mean of the last 10 epochs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for point in points:
        s = summary[point]
        lines.append(
            f"| {point} | {'/'.join(map(str, s['best_epochs']))} | {'/'.join(map(str, s['epochs_run']))} | "
            f"{s['seconds_per_epoch']:.2f} | {s['select_s']:.0f} | {s['total_s']:.0f} | {s['speedup']:.2f}x "
            f"({s['speedup_per_epoch']:.2f}x per epoch) | {s['ndcg_mean']:.4f} ± {s['ndcg_sd']:.4f} | "
            f"{' / '.join(f'{v:.4f}' for v in s['ndcg_by_seed'])} | {s['last10_mean']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
