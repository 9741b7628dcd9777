"""Model types by the name saved in ``config.json``, so loading never unpickles a class.

A model type is a frozen config dataclass and an ``nn.Module`` built from it alone
(``model_cls(config)``); adding a type is its config dataclass in ``recsys.model.configs.MODEL_CONFIGS``
(which the configuration and the evaluation list follow), its module here, and its config section.
"""
from __future__ import annotations

from recsys.model.configs import MODEL_CONFIGS
from recsys.model.gru4rec import GRU4Rec
from recsys.model.sasrec import SASRec

MODEL_CLASSES: dict[str, type] = {"sasrec": SASRec, "gru4rec": GRU4Rec}
if set(MODEL_CLASSES) != set(MODEL_CONFIGS):
    raise ImportError(f"model types with a config but no module, or the reverse: {set(MODEL_CLASSES) ^ set(MODEL_CONFIGS)}")

MODEL_TYPES: dict[str, tuple[type, type]] = {name: (MODEL_CONFIGS[name], MODEL_CLASSES[name]) for name in MODEL_CONFIGS}


def build_model(config: object):
    """A fresh model of the type whose config dataclass ``config`` is (exact class)."""
    for _, (config_cls, model_cls) in MODEL_TYPES.items():
        if type(config) is config_cls:
            return model_cls(config)
    raise ValueError(f"{type(config).__name__} is not the config of a registered model type "
                     f"(known: {', '.join(sorted(MODEL_TYPES))}): add it to recsys.model.registry.MODEL_TYPES")


def model_type_of(model: object) -> str:
    """The registered name of ``model``'s class (exact class, so a subclass must register itself)."""
    for name, (_, model_cls) in MODEL_TYPES.items():
        if type(model) is model_cls:
            return name
    raise ValueError(f"{type(model).__name__} is not a registered model type "
                     f"(known: {', '.join(sorted(MODEL_TYPES))}): add it to recsys.model.registry.MODEL_TYPES")
