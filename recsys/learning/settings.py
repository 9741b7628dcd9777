"""The typed configuration translated into the models' own settings.

The models know no configuration object (they run where there is none, e.g. a bare GPU box); this
is the one place that reads ``train.model.*`` and ``train.*`` into the dataclasses they take.
"""
from __future__ import annotations

from typing import Any

from recsys.config import ModelConfig, TrainConfig
from recsys.errors import ConfigError


def model_config(model: ModelConfig, num_items: int, model_type: str | None = None):
    """The config dataclass of ``model_type`` (default: the selected one) from its config section."""
    from recsys.model.registry import MODEL_TYPES

    model_type = model_type or model.type
    config_cls, _ = MODEL_TYPES[model_type]
    return config_cls(num_items=num_items, **model.section(model_type).model_dump())


def train_settings(train: TrainConfig, device: Any = None):
    """The training loop's settings (epochs, batch, optimiser, loss, early stop, seed, precision) from ``train.*``.

    With the training ``device``, ``train.precision`` is resolved for it (``auto`` becomes ``bf16`` or
    ``fp32``), so the run's parameters say what ran and a ``bf16`` the device cannot run natively is a
    ConfigError (exit 2) before any training starts; without it, ``auto`` stays for ``fit`` to resolve.
    """
    from recsys.model.precision import resolve_precision
    from recsys.model.training import TrainSettings

    precision = train.precision
    if device is not None:
        try:
            precision = resolve_precision(precision, device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return TrainSettings(epochs=train.epochs, batch_size=train.batch_size, learning_rate=train.learning_rate,
                         weight_decay=train.weight_decay, patience=train.patience,
                         patience_windows=train.patience_windows, seed=train.seed,
                         warmup_epochs=train.warmup_epochs, lr_decay=train.lr_decay,
                         window_offsets=train.window_offsets, loss=train.loss, negatives=train.negatives,
                         precision=precision, batching=train.batching)
