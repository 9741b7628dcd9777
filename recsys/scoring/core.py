"""The scoring core: histories in, top-N out, in big device-sized chunks. Pure torch/numpy/pyarrow.

Everything that touches one user's data is vectorised over a whole chunk: histories arrive as an
Arrow list column (offsets + flat values), become one padded tensor, are encoded in one forward
pass, scored against the candidate item matrix (tiled over the catalog when it is large, with a
running top-N merge), masked (already-seen items) and cut to the top N on the device. Only the top
N per user leave the device, and they leave as Arrow list arrays, never as Python lists.

No pyspark or mlflow here: the same code runs inside the Spark UDF, in the benchmark's bare-core
baseline, in tests, and on a GPU machine that has neither installed.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from recsys.data.contracts import RECOMMENDATION_TYPE, SOURCE_MODEL, SOURCE_POPULARITY
from recsys.model.base import SequenceRecommender
from recsys.sequences import Sequences, Vocabulary, pad_left

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(requested: str, spark_gpus: list[str] | None = None) -> torch.device:
    """The device a worker scores on.

    ``auto`` prefers the GPU Spark assigned to this task (its resource addresses), then any CUDA
    device, then the CPU. Spark does not schedule GPUs in local mode, so an empty assignment is
    normal there and falls back cleanly.
    """
    if requested == "cpu":
        return torch.device("cpu")
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"scoring.device={requested!r} but CUDA is not available on this worker; use auto or cpu")
        return torch.device(requested)
    if requested != "auto":
        raise ValueError(f"unknown device {requested!r}; use auto, cpu, cuda or cuda:N")
    if torch.cuda.is_available():
        if spark_gpus:
            return torch.device(f"cuda:{int(spark_gpus[0])}")
        return torch.device("cuda")
    return torch.device("cpu")


@dataclass(frozen=True)
class Candidates:
    """The items a run may recommend: available in the catalog snapshot and known to the model."""

    index: np.ndarray     # [C] int64 model item indices (1..num_items), sorted, unique
    item_ids: np.ndarray  # [C] int64 external item ids, aligned with ``index``

    def __post_init__(self) -> None:
        if len(self.index) != len(self.item_ids):
            raise ValueError("candidate index and item_ids must have the same length")
        if len(self.index) and np.any(np.diff(self.index) <= 0):
            raise ValueError("candidate indices must be sorted and unique")


@dataclass(frozen=True)
class Fallback:
    """Ranked items for users the model cannot score (no known history, or a non-finite vector)."""

    name: str
    item_ids: np.ndarray  # [F] int64, best first, all candidates
    scores: np.ndarray    # [F] float32


@dataclass
class ChunkStats:
    """Per-worker counters, shipped back to the driver as data (never as accumulators)."""

    users: int = 0
    history_items: int = 0
    unknown_items: int = 0
    model_users: int = 0
    fallback_users: int = 0
    nonfinite_users: int = 0
    short_lists: int = 0
    chunks: int = 0
    encode_s: float = 0.0
    score_s: float = 0.0
    to_arrow_s: float = 0.0

    def add(self, other: "ChunkStats") -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))


@dataclass
class Scorer:
    """A model prepared for one candidate set on one device: built once per worker, then reused.

    Preparing gathers the candidate rows of the item-embedding table into one contiguous matrix
    (so unavailable items are never scored, rather than scored and masked) and builds the lookup
    that maps a history item to its candidate column for seen-item masking.
    """

    model: SequenceRecommender
    vocab: Vocabulary
    candidates: Candidates
    fallback: Fallback
    top_n: int
    device: torch.device
    dtype: str = "float32"
    item_tile: int = 0
    _cand_emb: torch.Tensor = field(init=False, repr=False)
    _cand_of_item: torch.Tensor = field(init=False, repr=False)
    _cand_ids: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        num_items = int(self.model.num_items)
        if len(self.vocab) != num_items:
            raise ValueError(f"vocabulary has {len(self.vocab)} items but the model has {num_items}")
        idx = torch.as_tensor(self.candidates.index, dtype=torch.long)
        if len(idx) and (int(idx.min()) < 1 or int(idx.max()) > num_items):
            raise ValueError(f"candidate indices must lie in 1..{num_items}")
        with torch.inference_mode():
            emb = self.model.item_embeddings().detach()
            self._cand_emb = emb.index_select(0, idx.to(emb.device)).to(self.device, torch.float32).contiguous()  # [C, D]
        lookup = torch.full((num_items + 1,), -1, dtype=torch.long)
        lookup[idx] = torch.arange(len(idx), dtype=torch.long)
        self._cand_of_item = lookup.to(self.device)  # [num_items + 1] -> candidate column or -1
        self._cand_ids = np.ascontiguousarray(self.candidates.item_ids, dtype=np.int64)
        if self.dtype != "float32" and self.device.type == "cuda":
            self._cand_emb = self._cand_emb.to(_DTYPES[self.dtype])

    @property
    def num_candidates(self) -> int:
        return len(self._cand_ids)

    def score(self, user_ids: np.ndarray, history_ids: Sequences) -> tuple[pa.RecordBatch, ChunkStats]:
        """Top-N for one chunk of users -> (Arrow batch: user_id, recommendations, source), stats.

        ``history_ids`` are external item ids, oldest first; items the model does not know are
        dropped and counted, and users left with no known item get the fallback.
        """
        histories, unknown = self.vocab.map_sequences(history_ids)
        stats = ChunkStats(users=len(histories), chunks=1, history_items=len(history_ids.items), unknown_items=unknown)
        n_users = len(histories)
        lengths = histories.lengths
        has_history = lengths > 0
        model_rows = np.flatnonzero(has_history)
        k = min(self.top_n, self.num_candidates)

        top_idx = np.zeros((n_users, k), dtype=np.int64)
        top_val = np.full((n_users, k), -np.inf, dtype=np.float32)
        use_fallback = ~has_history
        if len(model_rows) and k > 0:
            sub = histories.take(model_rows) if len(model_rows) != n_users else histories
            vals, idx, finite, enc_s, sc_s = self._score_model_users(sub, k)
            top_val[model_rows] = vals
            top_idx[model_rows] = idx
            bad = model_rows[~finite]
            use_fallback[bad] = True
            stats.nonfinite_users = int(len(bad))
            stats.encode_s, stats.score_s = enc_s, sc_s

        t0 = time.perf_counter()
        valid = np.isfinite(top_val)                                  # [U, k] masked slots are -inf
        item_ids = self._cand_ids[top_idx] if k else np.zeros((n_users, 0), np.int64)
        scores = top_val
        if use_fallback.any():
            item_ids, scores, valid = self._apply_fallback(use_fallback, item_ids, scores, valid, k)
        counts = valid.sum(axis=1)
        offsets = np.zeros(n_users + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        recs = pa.ListArray.from_arrays(
            pa.array(offsets, type=pa.int32()),
            pa.StructArray.from_arrays(
                [pa.array(item_ids[valid], type=pa.int64()), pa.array(scores[valid].astype(np.float32), type=pa.float32())],
                fields=list(RECOMMENDATION_TYPE.value_type),
            ),
            type=RECOMMENDATION_TYPE,
        )
        source = pa.DictionaryArray.from_arrays(
            pa.array(use_fallback.astype(np.int8)), pa.array([SOURCE_MODEL, self.fallback.name])
        ).cast(pa.string())
        batch = pa.RecordBatch.from_arrays(
            [pa.array(np.asarray(user_ids, dtype=np.int64)), recs, source],
            names=["user_id", "recommendations", "source"],
        )
        stats.fallback_users = int(use_fallback.sum())
        stats.model_users = n_users - stats.fallback_users
        stats.short_lists = int((counts < self.top_n).sum())
        stats.to_arrow_s = time.perf_counter() - t0
        return batch, stats

    def _score_model_users(self, histories: Sequences, k: int):
        """Encode, score against candidates (tiled), mask seen, top-k. Returns numpy arrays."""
        device = self.device
        max_len = int(self.model.max_len)
        t0 = time.perf_counter()
        seq = torch.from_numpy(pad_left(histories, max_len))           # [B, L] int64, newest last
        if device.type == "cuda":
            seq = seq.pin_memory().to(device, non_blocking=True)
        with torch.inference_mode(), self._autocast():
            user = self.model.encode(seq)                              # [B, D]
            finite = torch.isfinite(user).all(dim=1)                   # [B]
            user = torch.where(finite[:, None], user, torch.zeros_like(user))
            user = user.to(self._cand_emb.dtype)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            rows, cols = self._seen_columns(histories)                 # [S], [S] seen (row, candidate col)
            vals, idx = self._topk_tiled(user, rows, cols, k)          # [B, k], [B, k]
            vals = vals.float().cpu().numpy()
            idx = idx.cpu().numpy()
            finite_np = finite.cpu().numpy()
        t2 = time.perf_counter()
        return vals, idx, finite_np, t1 - t0, t2 - t1

    def _seen_columns(self, histories: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
        """Every history item that is a candidate, as (row, candidate column) pairs on the device."""
        items = torch.from_numpy(histories.items)
        rows = torch.repeat_interleave(torch.arange(len(histories)), torch.from_numpy(histories.lengths))
        if self.device.type == "cuda":
            items, rows = items.to(self.device, non_blocking=True), rows.to(self.device, non_blocking=True)
        cols = self._cand_of_item[items]                               # [S] -1 where not a candidate
        keep = cols >= 0
        return rows[keep], cols[keep]

    def _topk_tiled(self, user: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, k: int):
        """Top-k over all candidates, one item tile at a time, merging a running top-k.

        The score matrix of one tile is [B, tile]; with item_tile=0 the whole candidate set is
        one tile. Seen items are set to -inf inside the tile they fall in, before its top-k.
        """
        num_c = self.num_candidates
        tile = self.item_tile if 0 < self.item_tile < num_c else num_c
        best_val: torch.Tensor | None = None
        best_idx: torch.Tensor | None = None
        for start in range(0, num_c, tile):
            stop = min(start + tile, num_c)
            scores = user @ self._cand_emb[start:stop].T               # [B, T]
            if scores.dtype != torch.float32 and self.device.type != "cuda":
                scores = scores.float()
            if len(cols):
                in_tile = (cols >= start) & (cols < stop) if tile != num_c else None
                r, c = (rows, cols) if in_tile is None else (rows[in_tile], cols[in_tile] - start)
                scores.index_put_((r, c), torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device))
            kt = min(k, stop - start)
            v, i = torch.topk(scores, kt, dim=1)                       # [B, kt]
            i = i + start
            if best_val is None:
                best_val, best_idx = v, i
            else:
                v = torch.cat([best_val, v], dim=1)                    # [B, k + kt]
                i = torch.cat([best_idx, i], dim=1)
                best_val, pos = torch.topk(v, min(k, v.shape[1]), dim=1)
                best_idx = torch.gather(i, 1, pos)
        assert best_val is not None and best_idx is not None
        return best_val, best_idx

    def _apply_fallback(self, rows_mask: np.ndarray, item_ids: np.ndarray, scores: np.ndarray,
                        valid: np.ndarray, k: int):
        """Overwrite the rows in ``rows_mask`` with the fallback ranking (same width k)."""
        fb_ids = np.zeros(k, dtype=np.int64)
        fb_scores = np.full(k, -np.inf, dtype=np.float32)
        n = min(k, len(self.fallback.item_ids))
        fb_ids[:n] = self.fallback.item_ids[:n]
        fb_scores[:n] = self.fallback.scores[:n]
        item_ids = item_ids.copy()
        scores = scores.copy()
        valid = valid.copy()
        item_ids[rows_mask] = fb_ids
        scores[rows_mask] = fb_scores
        valid[rows_mask] = np.isfinite(fb_scores)
        return item_ids, scores, valid

    def _autocast(self):
        if self.device.type == "cuda" and self.dtype != "float32":
            return torch.autocast("cuda", dtype=_DTYPES[self.dtype])
        return contextlib.nullcontext()


def popularity_fallback(item_ids: np.ndarray, counts: np.ndarray, top_n: int) -> Fallback:
    """Most frequent candidate items first; score = share of events, so it reads like a probability."""
    item_ids = np.asarray(item_ids, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.float64)
    order = np.lexsort((item_ids, -counts))[:top_n]    # by count desc, then item id for determinism
    total = counts.sum() or 1.0
    return Fallback(SOURCE_POPULARITY, item_ids[order], (counts[order] / total).astype(np.float32))
