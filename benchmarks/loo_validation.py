"""The ``loo`` split's validation phase, as the training benchmarks train on it.

benchmarks/train_speed.py, batching_speed.py and tune_grid.py train the default model on the same data: the
validation phase's histories (every user's history without its two newest items) mapped onto a vocabulary of
the items seen often enough, with ties broken by seed 7. One reader, so that their figures stay comparable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LooValidation:
    cfg: Any        # recsys.config.RecsysConfig: the default configuration with spark.master=local[2]
    split: Any      # recsys.evaluation.protocols' loo split (its ``info`` line describes the data)
    vocab: Any      # recsys.learning.split.Vocabulary of the validation histories
    train: Any      # the validation histories as item indices, what recsys.model.training.fit takes


def load(data: str, app_name: str) -> LooValidation:
    """Read the dataset root ``data`` (the input layout, e.g. recsys import-movielens --out) through a local Spark
    session that is stopped before any training starts, so that it takes no CPU from the timed runs."""
    from recsys.config import load_config
    from recsys.evaluation import protocols
    from recsys.learning.split import build_vocabulary
    from recsys.spark.session import build_session

    cfg = load_config(overrides=["spark.master=local[2]"])
    spark = build_session(cfg.spark, app_name=app_name)
    try:
        split = protocols.load_loo(spark, data, tie_break_seed=7, event_types=cfg.history.event_types)
    finally:
        spark.stop()
    vocab = build_vocabulary(split.valid.history, cfg.train.min_item_count)
    train, _ = vocab.map_sequences(split.valid.history)
    return LooValidation(cfg=cfg, split=split, vocab=vocab, train=train)
