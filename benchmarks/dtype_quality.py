"""Scoring quality of the low-precision dtypes (bf16, int8) on a trained model: top-N overlap with
fp32, and the fast fp32 core against the reference core, over every user of a MovieLens dataset
(default: ml-latest-small).

Trains the default SASRec (the embedded config's train section) on every user's full rating
sequence, or loads one saved by an earlier run (``--model``), then scores every user's latest
``max_len`` items with the reference core (full forward, torch.topk, fp32), the fast fp32 core and
the core at each of ``--dtypes`` this CPU runs (the others are left out with the core's reason).
Prints, per N: the share of users whose fast-fp32 list is identical to the reference's, and for each
dtype the mean overlap of its list with the fp32 one, the share of identical lists, and the largest
difference between the two cores' scores of the same item.

    python benchmarks/dtype_quality.py --data ../shared/data/ml-latest-small --model /tmp/ml-small-sasrec
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from recsys.config import load_config
from recsys.data.movielens import read_ratings
from recsys.model.io import load_model, save_model
from recsys.model.training import fit
from recsys.scoring.core import Candidates, Fallback, ReferenceScorer, Scorer, check_dtype
from recsys.sequences import Sequences, Vocabulary
from recsys.learning.settings import model_config, train_settings
from recsys.learning.split import build_vocabulary


def sequences(ratings: Path) -> Sequences:
    users, items, ts, _ = read_ratings(ratings)
    order = np.lexsort((ts, users))          # by user, then time (ties: file order)
    users, items = users[order], items[order]
    _, counts = np.unique(users, return_counts=True)
    return Sequences(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), items.astype(np.int64))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data/ml-latest-small"))
    ap.add_argument("--model", type=Path, default=Path("/tmp/recsys-ml-small-sasrec"),
                    help="trained model directory: loaded if present, else trained and saved there")
    ap.add_argument("--top-n", type=int, nargs="+", default=[20, 100])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "int8"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config()
    seqs = sequences(args.data / "ratings.csv")
    if (args.model / "config.json").exists():
        loaded = load_model(args.model)
        model, vocab = loaded.model, Vocabulary(loaded.item_ids)
    else:
        vocab = build_vocabulary(seqs, cfg.train.min_item_count)
        mapped, _ = vocab.map_sequences(seqs)
        t0 = time.perf_counter()
        model = fit(mapped, model_config(cfg.train.model, len(vocab), "sasrec"), train_settings(cfg.train)).model.eval()
        print(f"trained the default SASRec on {len(seqs)} users in {time.perf_counter() - t0:.0f} s")
        save_model(model, vocab.item_ids, args.model)
    index = np.arange(1, len(vocab) + 1, dtype=np.int64)
    out: dict = {"users": len(seqs), "items": len(vocab)}
    dtypes = []
    for dtype in args.dtypes:
        try:
            check_dtype(dtype, torch.device("cpu"))
            dtypes.append(dtype)
        except ValueError as e:
            print(f"{dtype} left out: {e}")
            out[f"{dtype}_skipped"] = str(e)
    for n in args.top_n:
        common = dict(model=model, vocab=vocab, candidates=Candidates(index, vocab.item_ids),
                      fallback=Fallback("none", np.zeros(0, np.int64), np.zeros(0, np.float32)), top_n=n,
                      device=torch.device("cpu"))
        ref, _, _, _ = ReferenceScorer(**common).topn(seqs)
        fp32, s32, _, _ = Scorer(**common).topn(seqs)
        identical = float((ref == fp32).all(axis=1).mean())
        row = out[f"top{n}"] = {"fp32_identical_to_reference": identical}
        print(f"top {n}: fast fp32 lists identical to the reference core's: {identical:.4f} of users")
        for dtype in dtypes:
            low, s_low, _, _ = Scorer(**common, dtype=dtype).topn(seqs)
            overlap = float(np.mean([len(np.intersect1d(a, b)) / n for a, b in zip(fp32, low)]))
            diffs = [np.abs(sa[ia] - sb[ib]).max(initial=0.0) for a, sa, b, sb in zip(fp32, s32, low, s_low)
                     for _, ia, ib in [np.intersect1d(a, b, return_indices=True)]]
            row.update({f"{dtype}_overlap_with_fp32": overlap,
                        f"{dtype}_identical_lists": float((fp32 == low).all(axis=1).mean()),
                        f"{dtype}_max_abs_score_diff_same_item": float(max(diffs))})
            print(f"  {dtype}: overlap with fp32 {overlap:.4f}, identical lists "
                  f"{row[f'{dtype}_identical_lists']:.4f}, largest score difference on a shared item "
                  f"{row[f'{dtype}_max_abs_score_diff_same_item']:.4f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
