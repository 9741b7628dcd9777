"""int8 inference for the scoring core (``scoring.dtype=int8``): dynamically quantized linear layers
and an item matrix quantized once per model load. Pure torch.

The kernel is torch's dynamic quantized linear (``torch.ops.quantized.linear_dynamic``, what
``torch.ao.quantization.quantize_dynamic`` swaps ``nn.Linear`` for) with its weights packed for the
``onednn`` engine: weights int8 per output channel (symmetric), activations quantized per tensor to
uint8 inside the kernel on every call, int32 accumulation, and fp32 out with the scales and the bias
applied in the same pass. oneDNN runs it on AMX-INT8 or AVX-512-VNNI/AVX-VNNI; where a CPU has none
of them the scoring core refuses int8 (:func:`recsys.model.precision.cpu_int8_refusal`).

Why this kernel, measured on one thread (docs/performance.md, "int8 where the CPU has integer dot
products" and "Figures that lived in the code"): of torch's CPU int8 paths it is the one whose
activation quantization and output scaling cost least. The ``fbgemm``/``x86`` engines' packing of the
same layers ran slower than ``onednn``'s at these sizes; ``torch._int_mm`` needs the activation
quantized and the int32 result rescaled by separate passes over memory (on the encoder's layers those
cost more than the product saved); oneDNN's fused ``onednn::qlinear_pointwise`` is an internal op of
the inductor that crashes on an input it does not expect, and needs the same separate activation
quantization. Why not quantize everything: a layer pays only where its product is large next to
quantizing its input (:data:`ENCODER_LINEARS`).

``torch.ao.quantization`` warns that it is deprecated in favour of torchao, whose CPU int8 path is
built on ``torch._int_mm`` (above); the kernel used here is what both the deprecated module and
inductor's x86 quantization call. If a torch release drops it, the refusal check reports the engine
missing and ``scoring.dtype=int8`` is refused (exit 2), never silently slower.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

# The encoder layers quantized, by their dotted names' last two parts. Per layer at SASRec's default
# size (benchmarks/int8_parts.py), the widest-output layers (attn.qkv, mlp.fc) gain most from int8, the
# square attn.proj nothing, and mlp.proj little (quantizing a 256-wide input costs about as much as its
# product). And on the trained default model, each layer added to int8 lowers the top-20 overlap with
# fp32: only qkv alone keeps it above the 0.99 target with margin (rescaling channels through the layer
# norms, SmoothQuant's trick, did not move it). So only the query-key-value layers run in int8.
# Measured: docs/performance.md, "Figures that lived in the code".
ENCODER_LINEARS = ("attn.qkv",)


@contextlib.contextmanager
def _onednn_engine():
    """Pack weights for oneDNN. The packed object keeps its engine: calls work whatever the global
    engine is later, so the setting is changed only while packing and put back at once."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "onednn"
    try:
        with warnings.catch_warnings():   # torch 2.13 warns that quantized tensor creation is deprecated
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.backends.quantized.engine = previous


def quantize_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: [R, D] float -> (codes [R, D] int8, scales [R] float64), ``row ~ codes * scale``.

    An all-zero row (the padding item) gets scale 1, so it stays exactly zero.
    """
    matrix = matrix.detach().float()
    scales = matrix.abs().amax(dim=1).double() / 127.0                       # [R]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(matrix.double() / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def pack(codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.ScriptObject:
    """int8 weight rows (one per output feature) and their scales -> oneDNN's packed linear weight."""
    zero_points = torch.zeros(len(scales), dtype=torch.long)
    with _onednn_engine():
        weight = torch._make_per_channel_quantized_tensor(codes.contiguous(), scales.double().contiguous(),
                                                          zero_points, 0)
        return torch.ops.quantized.linear_prepack(weight, None if bias is None else bias.detach().float())


def linear(x: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """``x`` [..., in] fp32 times a packed int8 weight (+ its bias) -> [..., out] fp32; ``x`` is
    quantized to uint8 per tensor by the kernel (asymmetric: its own minimum and maximum)."""
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, False)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` run by :func:`linear`, for inference. ``parts``: output-feature ranges
    ``(lo, hi)`` packed separately too, for code that applies only some of a layer's outputs
    (SASRec's last block computes the query of the newest position only, :meth:`rows`)."""

    def __init__(self, layer: nn.Linear, parts: tuple[tuple[int, int], ...] = ()):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        weight = layer.weight.detach().float().cpu()
        bias = None if layer.bias is None else layer.bias.detach().float().cpu()
        codes, scales = quantize_rows(weight)
        self._packed = pack(codes, scales, bias)
        self._parts = {(lo, hi): _Part(pack(codes[lo:hi], scales[lo:hi], None if bias is None else bias[lo:hi]))
                       for lo, hi in parts}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self._packed)

    def rows(self, lo: int, hi: int) -> nn.Module:
        """The layer's output features ``lo:hi`` as a layer of their own (prepared at construction)."""
        try:
            return self._parts[(lo, hi)]
        except KeyError:
            raise KeyError(f"Int8Linear has no part ({lo}, {hi}) prepared; it has {sorted(self._parts)}") from None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (oneDNN)"


class _Part(nn.Module):
    def __init__(self, packed: torch.ScriptObject):
        super().__init__()
        self._packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self._packed)


def quantize_encoder(model: nn.Module, names: tuple[str, ...] = ENCODER_LINEARS) -> nn.Module:
    """A copy of ``model`` for inference with its ``nn.Linear`` layers named in ``names`` (by the last two
    parts of their dotted names) replaced by :class:`Int8Linear`; embeddings are shared, not copied.

    A query-key-value layer (``attn.qkv``) also gets its query and key-value thirds packed apart, for
    SASRec's last block. A model with none of these layers (GRU4Rec) comes back as it is: its encoder
    stays fp32 and only the product with the items runs in int8.
    """
    chosen = [name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and ".".join(name.split(".")[-2:]) in names]
    if not chosen:
        return model
    memo = {id(m): m for m in model.modules() if isinstance(m, nn.Embedding)}
    quantized = copy.deepcopy(model, memo).eval()
    for name in chosen:
        module = quantized.get_submodule(name)
        parent_name, _, attr = name.rpartition(".")
        parent = quantized.get_submodule(parent_name)
        d = module.in_features
        parts = ((0, d), (d, module.out_features)) if name.endswith("attn.qkv") and module.out_features == 3 * d else ()
        setattr(parent, attr, Int8Linear(module, parts))
    return quantized


@dataclass(frozen=True)
class Int8Model:
    """What the int8 scoring path needs of one model, built once per model load (the worker caches
    it next to the model, ``recsys.scoring.cache.INT8``): the encoder with its large linear layers in
    int8, and the item embedding table quantized per item. Candidate sets gather and pack their rows
    (:meth:`pack_items`), so a new catalog snapshot re-quantizes nothing."""

    encoder: nn.Module
    item_codes: torch.Tensor     # [num_items + 1, D] int8
    item_scales: torch.Tensor    # [num_items + 1] float64

    def pack_items(self, index: torch.Tensor) -> torch.ScriptObject:
        """The rows ``index`` (model item indices, in candidate-column order) packed as one int8 weight."""
        return pack(self.item_codes.index_select(0, index), self.item_scales.index_select(0, index))


def quantize_for_scoring(model: nn.Module, encoder: bool = True) -> Int8Model:
    """``model`` (a :class:`~recsys.model.base.SequenceRecommender`, on the CPU) -> its :class:`Int8Model`.

    ``encoder=False`` keeps the encoder in fp32 (only the product with the items in int8).
    """
    with torch.inference_mode():
        codes, scales = quantize_rows(model.item_embeddings().detach().cpu())
    return Int8Model(quantize_encoder(model) if encoder else model, codes, scales)
