"""The typed configuration translated into the models' own settings.

The models know no configuration object (they run where there is none, e.g. a bare GPU box); this
is the one place that reads ``train.model.*`` and ``train.*`` into the dataclasses they take.
"""
from __future__ import annotations

from recsys.config import ModelConfig, TrainConfig


def model_config(model: ModelConfig, num_items: int, model_type: str | None = None):
    """The config dataclass of ``model_type`` (default: the selected one) from its config section."""
    from recsys.model.registry import MODEL_TYPES

    model_type = model_type or model.type
    config_cls, _ = MODEL_TYPES[model_type]
    return config_cls(num_items=num_items, **model.section(model_type).model_dump())


def train_settings(train: TrainConfig):
    """The training loop's settings (epochs, batch, optimiser, loss, early stop, seed) from ``train.*``."""
    from recsys.model.training import TrainSettings

    return TrainSettings(epochs=train.epochs, batch_size=train.batch_size, learning_rate=train.learning_rate,
                         weight_decay=train.weight_decay, patience=train.patience, seed=train.seed,
                         warmup_epochs=train.warmup_epochs, lr_decay=train.lr_decay,
                         window_offsets=train.window_offsets, loss=train.loss, negatives=train.negatives)
