"""Save and load models as plain files: a JSON config, safetensors weights and the item vocabulary.

Never pickled modules: loading a pickle runs whatever code it names, and ties the file to the class
layout of the code that wrote it. Here the model is rebuilt from its registered type and config, and
only numbers are read. A model directory holds:

    config.json           {"format_version": 1, "model_type": "sasrec", "model": {...config fields},
                           "metadata": {...}}
    weights.safetensors   the state dict; tied weights are one parameter, so they are stored once
    item_ids.npy          int64 [num_items]: item_ids[i] is the external item id of model index i + 1
    repeats.json          optional: how the user's known items compete with new ones
                          (:class:`recsys.model.repeats.RepeatBlend`); absent: known items are masked
    new_item_ids.npy      optional: int64, sorted: the items this model knows and the version it was trained
                          to replace (the alias holder then) did not; the nightly job counts how many of them
                          its lists recommend. Absent: no version came before, or saved elsewhere
    item_to_item.npz      optional: item-to-item weights (:class:`recsys.model.item_to_item.ItemToItem`), saved
                          when the repeat blend weighs them; absent: none

``config.json`` is written last, so a directory whose writing was interrupted fails to load with
"missing config.json" rather than loading half a model.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys.model import item_to_item as i2i
from recsys.model.registry import MODEL_TYPES, model_type_of
from recsys.model.repeats import MASK_KNOWN, RepeatBlend

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
ITEM_IDS_FILE = "item_ids.npy"
REPEATS_FILE = "repeats.json"
NEW_ITEM_IDS_FILE = "new_item_ids.npy"


@dataclass(frozen=True, eq=False)
class LoadedModel:
    model: torch.nn.Module        # in eval mode, on the requested device
    item_ids: np.ndarray          # [num_items] int64, external id of model index i + 1
    model_type: str
    config: Any                   # the model type's config dataclass
    metadata: dict = field(default_factory=dict)
    blend: RepeatBlend = MASK_KNOWN   # how known items compete with new ones; masked when the model has none
    item_to_item: i2i.ItemToItem | None = None   # the item-to-item weights the blend weighs; None: none saved


def save_model(model: torch.nn.Module, item_ids: np.ndarray, directory: Path, *,
               metadata: dict | None = None, blend: RepeatBlend | None = None,
               new_item_ids: np.ndarray | None = None, item_to_item: i2i.ItemToItem | None = None) -> Path:
    """Write ``model`` and its vocabulary to ``directory`` (created if needed); returns ``directory``.

    ``metadata`` must be JSON-serialisable (training figures, data digests, ...); it is returned
    unchanged by :func:`load_model`. ``blend``: the repeat blend fitted with the model (None: none, so
    known items are masked when it scores). ``new_item_ids``: the items of ``item_ids`` the version this one
    replaces did not know (:func:`read_new_item_ids`). ``item_to_item``: the weights ``blend`` weighs (None: none).
    """
    directory = Path(directory)
    model_type = model_type_of(model)
    config = model.config
    item_ids = np.asarray(item_ids)
    if item_ids.ndim != 1 or not np.issubdtype(item_ids.dtype, np.integer):
        raise ValueError(f"item_ids must be a 1-d integer array, got {item_ids.dtype} with shape {item_ids.shape}")
    if len(item_ids) != config.num_items:
        raise ValueError(f"item_ids has {len(item_ids)} entries but the model has num_items={config.num_items}: "
                         "item_ids[i] must be the external id of model index i + 1")
    if len(np.unique(item_ids)) != len(item_ids):
        raise ValueError("item_ids has duplicates: each model index must map to a distinct external item id")
    document = {"format_version": FORMAT_VERSION, "model_type": model_type,
                "model": dataclasses.asdict(config), "metadata": dict(metadata or {})}
    try:
        config_text = json.dumps(document, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serialisable (plain numbers, strings, lists, dicts): {exc}") from exc

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).unlink(missing_ok=True)  # an interrupted overwrite must not look complete
    _save_weights(model, directory / WEIGHTS_FILE)
    np.save(directory / ITEM_IDS_FILE, item_ids.astype(np.int64), allow_pickle=False)
    (directory / NEW_ITEM_IDS_FILE).unlink(missing_ok=True)
    if new_item_ids is not None:
        np.save(directory / NEW_ITEM_IDS_FILE, np.unique(np.asarray(new_item_ids, dtype=np.int64)), allow_pickle=False)
    (directory / i2i.FILE).unlink(missing_ok=True)
    if item_to_item is not None:
        item_to_item.save(directory / i2i.FILE)
    (directory / REPEATS_FILE).unlink(missing_ok=True)
    if blend is not None:
        (directory / REPEATS_FILE).write_text(blend.to_json() + "\n")
    (directory / CONFIG_FILE).write_text(config_text + "\n")
    return directory


def load_model(directory: Path, device: str | torch.device = "cpu") -> LoadedModel:
    """Rebuild a model saved by :func:`save_model`, in eval mode on ``device``.

    Every inconsistency is a ``ValueError`` that names the file and what to do about it.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"model directory {directory} does not exist: pass the directory save_model wrote")
    for name in (CONFIG_FILE, WEIGHTS_FILE, ITEM_IDS_FILE):
        if not (directory / name).is_file():
            raise ValueError(f"{directory} has no {name}: not a complete recsys model directory "
                             f"(expected {CONFIG_FILE}, {WEIGHTS_FILE}, {ITEM_IDS_FILE}; re-save it with save_model)")

    model_type, config, metadata = _read_config(directory / CONFIG_FILE)
    _, model_cls = MODEL_TYPES[model_type]
    model = model_cls(config)
    _load_weights(model, directory / WEIGHTS_FILE, config)

    item_ids = read_item_ids(directory)
    if len(item_ids) != config.num_items:
        raise ValueError(f"{directory / ITEM_IDS_FILE} has {len(item_ids)} ids but {CONFIG_FILE} says "
                         f"num_items={config.num_items}: the files come from different models")
    blend = MASK_KNOWN
    if (directory / REPEATS_FILE).is_file():
        try:
            blend = RepeatBlend.from_json((directory / REPEATS_FILE).read_text())
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{directory / REPEATS_FILE} is not a repeat blend ({exc}): restore it from the saved "
                             "model, or delete it to mask known items") from exc
    item_to_item = i2i.ItemToItem.load(directory / i2i.FILE) if (directory / i2i.FILE).is_file() else None
    if blend.item_to_item_weight and item_to_item is None:
        raise ValueError(f"{directory / REPEATS_FILE} weighs item-to-item scores but {directory / i2i.FILE} is "
                         "missing: restore it from the saved model, or delete repeats.json to mask known items")
    return LoadedModel(model=model.to(device).eval(), item_ids=item_ids.astype(np.int64, copy=False),
                       model_type=model_type, config=config, metadata=metadata, blend=blend, item_to_item=item_to_item)


def read_item_ids(directory: Path) -> np.ndarray:
    """The model's vocabulary (``item_ids.npy``: the external id of model index i + 1), without loading the
    weights; a file that is not a plain 1-d integer array is a ``ValueError`` naming it."""
    path = Path(directory) / ITEM_IDS_FILE
    try:
        item_ids = np.load(path, allow_pickle=False)
    except ValueError as exc:  # object arrays need pickle, which we refuse
        raise ValueError(f"{path} is not a plain integer array ({exc}): re-save the model") from exc
    if item_ids.ndim != 1 or not np.issubdtype(item_ids.dtype, np.integer):
        raise ValueError(f"{path} must hold a 1-d integer array, got {item_ids.dtype} with shape {item_ids.shape}")
    return item_ids


def read_new_item_ids(directory: Path) -> np.ndarray | None:
    """The model's new items (``new_item_ids.npy``, sorted), or None when it records none; without loading
    the weights."""
    path = Path(directory) / NEW_ITEM_IDS_FILE
    return np.load(path, allow_pickle=False).astype(np.int64, copy=False) if path.exists() else None


def _read_config(path: Path) -> tuple[str, Any, dict]:
    try:
        document = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}): restore it from the saved model") from exc
    if not isinstance(document, dict):
        raise ValueError(f"{path} must hold a JSON object")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {version!r}, this recsys reads {FORMAT_VERSION}: "
                         "load it with the recsys version that wrote it, or re-save the model")
    model_type = document.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path} names model_type {model_type!r}, known types: {', '.join(sorted(MODEL_TYPES))}: "
                         "upgrade recsys or fix the file")
    config_cls, _ = MODEL_TYPES[model_type]
    fields = document.get("model")
    if not isinstance(fields, dict):
        raise ValueError(f"{path} must have a 'model' object with the {model_type} config fields")
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{path} has unknown {model_type} config fields {unknown} (known: {sorted(known)})")
    try:
        config = config_cls(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path} has an invalid {model_type} config: {exc}") from exc
    metadata = document.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: 'metadata' must be a JSON object")
    return model_type, config, metadata


def _load_weights(model: torch.nn.Module, path: Path, config: Any) -> None:
    tensors = _read_weights(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path} does not match the config in {CONFIG_FILE}: missing {missing}, "
                         f"unexpected {unexpected}; the files come from different models or versions")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{path}: {name} has shape {list(tensor.shape)} but {CONFIG_FILE} ({config}) "
                             f"implies {list(expected[name].shape)}; the files come from different models")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{path}: {name} has dtype {tensor.dtype}, expected floating point weights")
    model.load_state_dict(tensors, strict=True)


def _save_weights(model: torch.nn.Module, path: Path) -> None:
    """safetensors: raw tensors behind a JSON header, so loading never runs pickle."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc}); models are loaded only from "
                         f"safetensors weights, never from pickles - re-save the model with save_model") from None
