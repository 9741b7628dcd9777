"""SASRec: a causal transformer over a user's most recent items (Kang & McAuley, 2018).

Pre-norm blocks as in nanoGPT, learned positions and one item embedding table that is both the
input embedding and the output layer, so a user vector scores items by a dot product with
:meth:`SASRec.item_embeddings` (the :class:`~recsys.model.base.SequenceRecommender` contract).

Two properties the rest of the system relies on:

- Padding never changes the result for real items. Sequences are left-padded and positions count
  back from the newest item, so the newest item always sits at position ``max_len - 1`` whatever
  the padding. Padding keys are masked out of attention, and every position may attend to itself,
  so no attention row is ever fully masked (a fully masked row is a softmax over nothing, NaN).
  A real item therefore sees exactly the same inputs however much padding precedes it, and
  all-padding rows give finite (meaningless) vectors.
- :meth:`SASRec.encode` is the nightly scoring hot path: it needs only the newest position's output,
  so the last block computes keys and values for every position but the query, attention output
  and feed-forward for that one position only. Rows are encoded in blocks of similar length
  (sorted by length), each block cut to its longest row; a block without padding needs no mask
  (plain causal attention), and all attention goes through fused ``scaled_dot_product_attention``.

Device and dtype are the caller's choice: the module creates every tensor on the device of its input.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from recsys.model.base import drop_padding_columns
from recsys.model.configs import SASRecConfig

__all__ = ["SASRec", "SASRecConfig"]

# On CPU, encode() works through a batch this many rows at a time: the intermediates of 64 users
# ([64 * max_len, 4 * dim] floats, about 3 MB at the defaults) stay in cache and the allocator
# reuses them, where one [4096 * 50, 256] activation is 200 MB of fresh pages per call, which made
# encoding markedly slower (benchmarks/sasrec_encode.py; docs/performance.md, "Figures that lived in
# the code"). Not applied on accelerators, where large batches are what keeps the device busy.
CPU_ENCODE_ROWS = 64


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on the CPU in bf16 (the scoring core's autocast), in fp32.

    At SASRec's sizes the CPU's fused bf16 attention is slower than its fp32 one, causal and for the
    last query alone (measured: docs/performance.md, "The fast core"), and attention holds no matrix
    product large enough for bf16 to pay; fp32 is also the more accurate. The result goes back to
    bf16 for the next projection.
    """
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _output_features(layer: nn.Module, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Output features ``lo:hi`` of a linear layer at ``x``, computed for those features only: a slice
    of an ``nn.Linear``'s weight, or the part an int8 layer prepared for them
    (:meth:`recsys.model.int8.Int8Linear.rows`, the scoring core's ``scoring.dtype=int8``)."""
    if isinstance(layer, nn.Linear):
        bias = None if layer.bias is None else layer.bias[lo:hi]
        return F.linear(x, layer.weight[lo:hi], bias)
    return layer.rows(lo, hi)(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: SASRecConfig):
        super().__init__()
        self.heads = config.heads
        self.dim = config.dim
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.resid_dropout = nn.Dropout(config.dropout)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.heads, self.dim // self.heads).transpose(1, 2)  # [B, H, T, D/H]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, L, D], ``mask`` [B, 1, L, L] bool (True: may attend), or None: causal only -> [B, L, D]."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(self.dim, dim=2)                     # 3 x [B, L, D]
        y = _attention(
            self._split_heads(q), self._split_heads(k), self._split_heads(v),
            attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None,
        )                                                                # [B, H, T, D/H]
        y = y.transpose(1, 2).reshape(B, T, D)                           # [B, T, D]
        return self.resid_dropout(self.proj(y))

    def forward_last(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Only the last position's output: ``x`` [B, L, D], ``mask`` [B, 1, 1, L] or None (every key
        is real) -> [B, 1, D]. The last query sees every key, so no causal mask is needed.

        On CUDA, SDPA's cuDNN backend is excluded here: it failed on exactly this shape (one query,
        bf16, 65,536 rows, torch 2.11 on an H200); the memory-efficient and math kernels take it.
        """
        B, L, D = x.shape
        q = _output_features(self.qkv, x[:, -1:], 0, D)                  # [B, 1, D]
        k, v = _output_features(self.qkv, x, D, 3 * D).split(D, dim=2)   # 2 x [B, L, D]
        backends = (sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
                    if x.device.type == "cuda" else contextlib.nullcontext())
        with backends:
            y = _attention(
                self._split_heads(q), self._split_heads(k), self._split_heads(v),
                attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            )                                                            # [B, H, 1, D/H]
        y = y.transpose(1, 2).reshape(B, 1, D)                           # [B, 1, D]
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: SASRecConfig):
        super().__init__()
        self.fc = nn.Linear(config.dim, 4 * config.dim)
        self.proj = nn.Linear(4 * config.dim, config.dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: SASRecConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.dim)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)                            # [B, L, D]
        return x + self.mlp(self.ln_2(x))                                # [B, L, D]

    def forward_last(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The block's output at the last position only: [B, L, D] -> [B, 1, D]."""
        x_last = x[:, -1:] + self.attn.forward_last(self.ln_1(x), mask)  # [B, 1, D]
        return x_last + self.mlp(self.ln_2(x_last))                      # [B, 1, D]


class SASRec(nn.Module):
    """Implements :class:`~recsys.model.base.SequenceRecommender`.

    Input ``seq`` is [B, L] item indices with ``L <= max_len``, left-padded with 0, newest last.
    """

    def __init__(self, config: SASRecConfig):
        super().__init__()
        self.config = config
        self.max_len = config.max_len
        self.num_items = config.num_items
        self.item_emb = nn.Embedding(config.num_items + 1, config.dim, padding_idx=0)
        self.pos_emb = nn.Embedding(config.max_len, config.dim)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()

    def item_embeddings(self) -> torch.Tensor:
        """[num_items + 1, D], the same parameter the input embedding uses (row 0 is padding, zero)."""
        return self.item_emb.weight

    def _embed_only(self, seq: torch.Tensor) -> torch.Tensor:
        """Input embeddings [B, L, D]."""
        if seq.dim() != 2:
            raise ValueError(f"seq must be [batch, length], got shape {tuple(seq.shape)}")
        B, L = seq.shape
        if L > self.max_len:
            raise ValueError(f"seq has {L} columns but the model reads at most max_len={self.max_len}: "
                             "keep the most recent items (recsys.sequences.pad_left)")
        # Positions count back from the newest item, so padding does not shift them.
        pos = torch.arange(self.max_len - L, self.max_len, device=seq.device)      # [L]
        return self.emb_dropout(self.item_emb(seq) + self.pos_emb(pos))            # [B, L, D]

    def _embed(self, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings [B, L, D] and the attention mask [B, 1, L, L] (True: may attend)."""
        x = self._embed_only(seq)                                                  # [B, L, D]
        L = seq.shape[1]
        idx = torch.arange(L, device=seq.device)
        causal = idx[None, :] <= idx[:, None]                                      # [L, L] key <= query
        self_only = idx[None, :] == idx[:, None]                                   # [L, L]
        real_key = (seq != 0)[:, None, None, :]                                    # [B, 1, 1, L]
        mask = causal & (real_key | self_only)                                     # [B, 1, L, L], B*L*L bytes
        return x, mask

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        """Hidden state per position, [B, L] -> [B, L, D]; position t has read items up to t."""
        x, mask = self._embed(seq)
        for block in self.blocks:
            x = block(x, mask)                                                     # [B, L, D]
        return self.ln_f(x)                                                        # [B, L, D]

    def encode(self, seq: torch.Tensor) -> torch.Tensor:
        """User vectors, [B, L] -> [B, D]: the hidden state at the newest position.

        Equals ``forward(seq)[:, -1]``, computed for less: the last block runs its query and
        feed-forward for the newest position only; on CPU, rows go through in blocks of
        ``CPU_ENCODE_ROWS``, longest histories first, each block cut to its longest row (exact, see
        the module docstring: rows are independent and leading padding changes nothing), so short
        histories do not pay for ``max_len``. Trimming reads one value back from the device per block.
        """
        if seq.device.type == "cpu" and seq.shape[0] > CPU_ENCODE_ROWS:
            lengths = (seq != 0).sum(dim=1)                                         # [B]
            order = torch.argsort(lengths, descending=True, stable=True)            # [B]
            parts = [self._encode(seq[rows]) for rows in order.split(CPU_ENCODE_ROWS)]
            done = torch.cat(parts)                                                 # [B, D] in length order
            out = torch.empty_like(done)
            out[order] = done
            return out
        return self._encode(seq)

    def _encode(self, seq: torch.Tensor) -> torch.Tensor:
        seq, real = drop_padding_columns(seq, seq != 0)                             # [B, L']
        if seq.device.type == "cpu" and bool(real.all()):
            # no padding anywhere in the block: plain causal attention, no mask tensor to build or read
            x = self._embed_only(seq)
            for block in self.blocks[:-1]:
                x = block(x, None)                                                  # [B, L', D]
            x = self.blocks[-1].forward_last(x, None)                               # [B, 1, D]
            return self.ln_f(x[:, 0])
        x, mask = self._embed(seq)
        for block in self.blocks[:-1]:
            x = block(x, mask)                                                      # [B, L', D]
        x = self.blocks[-1].forward_last(x, mask[:, :, -1:, :])                     # [B, 1, D]
        return self.ln_f(x[:, 0])                                                   # [B, D]
