"""The vocabulary's floor (`train.min_item_count`) on the VALIDATION phase: what leaving rare items out costs and saves.

    PYTHONPATH=. python benchmarks/item_floor.py --data .bench/ml-small [--minimums 1,2,3,5] [--seeds 3]
        [--workers 2] [--json .bench/item_floor.json]

The full softmax scores every training position against every item of the vocabulary, so an epoch's cost
grows with the items; on MovieLens a third of the catalog is items rated once. Each minimum builds the
vocabulary of the `loo` split's validation histories as training does (items seen at least that many times;
histories collapse repeats), maps the histories onto it and trains the default model (recsys/default.yaml as it
is, early stopping on the validation interaction) with each seed, in ``--workers`` one-thread processes, as
benchmarks/tune_grid.py does. The figure is the best validation NDCG@10: a validation target left out of the
vocabulary counts as a miss, so the floor's cost in lists is inside it. The test interaction is never scored.
Times per epoch are comparable within one run only.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from loo_validation import load
from tune_grid import _train, seed_summary


def main() -> None:
    from recsys.learning.settings import train_settings
    from recsys.learning.split import build_vocabulary

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset root in the input layout (recsys import-movielens --out)")
    p.add_argument("--minimums", default="1,2,3,5", help="comma-separated train.min_item_count values")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    minimums = [int(m) for m in a.minimums.split(",")]
    if not minimums or min(minimums) < 1:
        raise SystemExit(f"--minimums must be whole numbers of at least 1, got {a.minimums!r}")

    data = load(a.data, app_name="item-floor")
    cfg, valid = data.cfg, data.split.valid
    settings = train_settings(cfg.train)
    cfg_dict = {"model": cfg.train.model.sasrec.model_dump(), "settings": settings.__dict__}
    vocabularies = {m: build_vocabulary(valid.history, m) for m in minimums}
    mapped = {m: v.map_sequences(valid.history)[0] for m, v in vocabularies.items()}
    print(f"{data.split.info}; {valid.users} validation users; items by minimum: "
          f"{ {m: len(v.item_ids) for m, v in vocabularies.items()} }", flush=True)

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")       # no spinning threads between trainings
    jobs = [(m, cfg.train.seed + i) for m in minimums for i in range(a.seeds)]
    rows = []
    started = time.perf_counter()
    with ProcessPoolExecutor(a.workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_train, f"min_item_count_{m}", {}, seed, mapped[m], valid, vocabularies[m].item_ids,
                               cfg_dict, {}) for m, seed in jobs]
        for (m, _), future in zip(jobs, futures):
            row = {**future.result(), "min_item_count": m}
            rows.append(row)
            print(f"min_item_count {m} ({row['items']} items) seed {row['seed']}: valid ndcg@10 "
                  f"{row['valid_ndcg@10']:.4f}  hr@10 {row['valid_hr@10']:.4f}  best epoch "
                  f"{row['best_epoch']}/{row['epochs_run']}  {row['seconds_per_epoch']:.2f} s/epoch", flush=True)

    print(f"\n{len(jobs)} trainings in {time.perf_counter() - started:.0f} s\n")
    print("| train.min_item_count | items | valid NDCG@10, mean over seeds | sd | by seed | valid HR@10 | best epoch "
          "| s/epoch |")
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for m in minimums:
        s = summary[m] = {"items": len(vocabularies[m].item_ids),
                          **seed_summary([r for r in rows if r["min_item_count"] == m])}
        seeds = " / ".join(f"{v:.4f}" for v in s["by_seed"])
        print(f"| {m} | {s['items']:,} | {s['mean']:.4f} | {s['sd']:.4f} | {seeds} | "
              f"{s['hr@10']:.4f} | {'/'.join(map(str, s['best_epochs']))} | {s['seconds_per_epoch']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
