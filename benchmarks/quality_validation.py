"""Tune sequence-model settings on the VALIDATION phase of `recsys evaluate`'s split; never touches the test.

    PYTHONPATH=. python benchmarks/quality_validation.py --data .recsys/ml-small [--protocol loo]
        [--model sasrec|gru4rec] [--epochs 30] [--patience 8] [--batch 32] [--lr 0.002]
        [--dim 64] [--layers 2] [--heads 2] [--max-len 50] [--dropout 0.2] [--threads 2]

Builds the split exactly as `recsys evaluate` does (protocols.load_loo / load_temporal: the
project's history builder, tie seed 7), trains on the validation phase's histories and prints the
validation NDCG@10 / HR@10 after every epoch, with seconds per epoch. The test phase is built (the
split is one object) but never scored: this is the script the defaults in recsys/default.yaml
were chosen with (README "Recommendation quality"), so what it prints is fair to tune on.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from recsys.config import load_config
    from recsys.evaluation import protocols
    from recsys.evaluation.ranking import SequenceModelScorer, rank_phase
    from recsys.model.registry import MODEL_TYPES
    from recsys.model.training import FitCallbacks, TrainSettings, fit
    from recsys.spark.session import build_session
    from recsys.learning.split import build_vocabulary

    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--protocol", choices=protocols.PROTOCOLS, default="loo")
    p.add_argument("--test-days", type=int, default=365)
    p.add_argument("--model", choices=sorted(MODEL_TYPES), default="sasrec")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    cfg = load_config(overrides=[f"spark.master=local[{a.threads}]"])
    spark = build_session(cfg.spark, app_name="quality-validation")
    try:
        if a.protocol == "loo":
            split = protocols.load_loo(spark, a.data, tie_break_seed=7)
        else:
            split = protocols.load_temporal(spark, a.data, split_date=None, test_days=a.test_days, tie_break_seed=7)
    finally:
        spark.stop()
    valid = split.valid
    vocab = build_vocabulary(valid.history, 1)
    train, _ = vocab.map_sequences(valid.history)
    fields = dict(num_items=len(vocab), dim=a.dim, layers=a.layers, max_len=a.max_len, dropout=a.dropout)
    if a.model == "sasrec":
        fields["heads"] = a.heads
    config_cls, _ = MODEL_TYPES[a.model]
    config = config_cls(**fields)
    settings = TrainSettings(epochs=a.epochs, batch_size=a.batch, learning_rate=a.lr, weight_decay=a.weight_decay,
                             patience=a.patience, seed=a.seed, num_threads=a.threads)
    print(f"{split.info}; validation users {valid.users}; {config}; {settings}", flush=True)

    def validate(model):
        return rank_phase(SequenceModelScorer(model, vocab.item_ids, valid), valid, (10,)).means()

    started = time.perf_counter()
    cpu_started = time.process_time()

    def progress(row: dict) -> None:
        print(f"epoch {row['epoch']:3d}  loss {row['train_loss']:.3f}  valid ndcg@10 {row['ndcg@10']:.4f}  "
              f"hr@10 {row['hr@10']:.4f}  {row['seconds']:.1f} s", flush=True)

    torch.set_num_threads(a.threads)
    result = fit(train, config, settings, valid=validate, callbacks=FitCallbacks(progress=progress))
    print(f"best epoch {result.best_epoch}: valid ndcg@10 {result.best_metrics['ndcg@10']:.4f} "
          f"hr@10 {result.best_metrics['hr@10']:.4f}; {time.perf_counter() - started:.0f} s wall, "
          f"{time.process_time() - cpu_started:.0f} s CPU")


if __name__ == "__main__":
    main()
