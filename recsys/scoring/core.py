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
from recsys.sequences import Sequences, Vocabulary, lookup_sorted

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


def candidate_set(available_ids: np.ndarray, vocab: Vocabulary) -> tuple[Candidates, int]:
    """The catalog's available items that the model knows -> (candidates, how many it does not know).

    Candidates are ordered by model index (the scorer's column order); an item the model has never
    seen cannot be scored, so it is left out and counted.
    """
    available_ids = np.asarray(available_ids, dtype=np.int64)
    index = vocab.index_of(available_ids)
    known = index > 0
    order = np.argsort(index[known], kind="stable")
    return Candidates(index[known][order], available_ids[known][order]), int((~known).sum())


def counts_per_candidate(candidate_ids: np.ndarray, item_ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(item id, count) pairs -> one count per candidate, aligned with ``candidate_ids``; other items ignored.

    ``candidate_ids`` are in the scorer's column order (model index order), which need not be id
    order: a model's vocabulary may list its items in any order. Used for the users per item in the
    window (the popularity fallback) and the times each item was recommended (the long-tail plot).
    """
    candidate_ids = np.asarray(candidate_ids, dtype=np.int64)
    by_id = np.argsort(candidate_ids, kind="stable")
    pos, found = lookup_sorted(candidate_ids[by_id], np.asarray(item_ids, dtype=np.int64))
    out = np.zeros(len(candidate_ids), dtype=np.int64)
    np.add.at(out, by_id[pos[found]], np.asarray(counts, dtype=np.int64)[found])
    return out


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
    (so unavailable items are never scored, rather than scored and masked), and puts the
    vocabulary and the item -> candidate-column lookup on the device. Scoring a chunk then runs
    entirely on the device: id -> index mapping, padding, encoding, scoring, masking and top-k;
    the host only ships flat Arrow buffers in and the top N out.
    """

    model: SequenceRecommender
    vocab: Vocabulary
    candidates: Candidates
    fallback: Fallback
    top_n: int
    device: torch.device
    dtype: str = "float32"
    item_tile: int = 0
    max_tile_mb: float = 0.0     # with item_tile 0: largest [chunk, tile] score matrix, in MiB (0: no limit)
    _cand_emb: torch.Tensor = field(init=False, repr=False)
    _cand_of_item: torch.Tensor = field(init=False, repr=False)
    _cand_ids: torch.Tensor = field(init=False, repr=False)
    _vocab_sorted: torch.Tensor = field(init=False, repr=False)
    _vocab_order: torch.Tensor = field(init=False, repr=False)
    _fallback_ids: np.ndarray = field(init=False, repr=False)
    _fallback_scores: np.ndarray = field(init=False, repr=False)
    _staging: "_HostStaging" = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        num_items = int(self.model.num_items)
        if len(self.vocab) != num_items:
            raise ValueError(f"vocabulary has {len(self.vocab)} items but the model has {num_items}")
        idx = torch.as_tensor(self.candidates.index, dtype=torch.long)
        if len(idx) and (int(idx.min()) < 1 or int(idx.max()) > num_items):
            raise ValueError(f"candidate indices must lie in 1..{num_items}")
        dev = self.device
        with torch.inference_mode():
            emb = self.model.item_embeddings().detach()
            cand_emb = emb.index_select(0, idx.to(emb.device)).to(dev, torch.float32)   # [C, D]
            if dev.type == "cuda" and self.dtype != "float32":
                cand_emb = cand_emb.to(_DTYPES[self.dtype])
            self._cand_emb = cand_emb.contiguous()
        lookup = torch.full((num_items + 1,), -1, dtype=torch.long)
        lookup[idx] = torch.arange(len(idx), dtype=torch.long)
        self._cand_of_item = lookup.to(dev)                                  # [num_items + 1] -> column or -1
        self._cand_ids = torch.as_tensor(self.candidates.item_ids, dtype=torch.long).to(dev)   # [C]
        order = np.argsort(self.vocab.item_ids, kind="stable")
        self._vocab_sorted = torch.as_tensor(self.vocab.item_ids[order]).to(dev)              # [V] sorted ids
        self._vocab_order = torch.as_tensor(order + 1, dtype=torch.long).to(dev)              # -> model index
        k = min(self.top_n, len(self.candidates.index))
        self._fallback_ids = np.zeros(k, dtype=np.int64)
        self._fallback_scores = np.full(k, -np.inf, dtype=np.float32)
        n = min(k, len(self.fallback.item_ids))
        self._fallback_ids[:n] = self.fallback.item_ids[:n]
        self._fallback_scores[:n] = self.fallback.scores[:n]
        self._staging = _HostStaging(dev)

    @property
    def num_candidates(self) -> int:
        return int(self._cand_ids.shape[0])

    def score(self, user_ids: np.ndarray, history_ids: Sequences) -> tuple[pa.RecordBatch, ChunkStats]:
        """Top-N for one chunk of users -> (Arrow batch: user_id, recommendations, source), stats.

        ``history_ids`` are external item ids, oldest first; items the model does not know are
        dropped and counted, and users left with no known item get the fallback, as do users whose
        vector comes out non-finite (a NaN must never rank first).
        """
        ids, scores, use_fallback, stats = self.topn(history_ids)
        t0 = time.perf_counter()
        batch, counts = _to_arrow(np.asarray(user_ids, dtype=np.int64), ids, scores, use_fallback, self.fallback.name)
        stats.short_lists = int((counts < self.top_n).sum())
        stats.to_arrow_s = time.perf_counter() - t0
        return batch, stats

    def topn(self, history_ids: Sequences) -> tuple[np.ndarray, np.ndarray, np.ndarray, ChunkStats]:
        """-> (item ids [U, k], scores [U, k] float32, fallback rows [U] bool, stats); k = min(N, candidates).

        Slots that could not be filled (fewer unseen candidates than k) hold a -inf score.
        """
        n_users = len(history_ids)
        k = min(self.top_n, self.num_candidates)
        stats = ChunkStats(users=n_users, chunks=1, history_items=len(history_ids.items))
        t0 = time.perf_counter()
        with torch.inference_mode():
            items = self._staging.to_device(history_ids.items, slot=0)              # [S] external ids
            lengths = self._staging.to_device(history_ids.lengths, slot=1)          # [U]
            seq, seen_rows, seen_cols, known_per_user, unknown = self._prepare(items, lengths, n_users)
            with self._autocast():
                user = self.model.encode(seq)                                       # [B, D]
            finite = torch.isfinite(user).all(dim=1)                                # [B]
            usable = finite & (known_per_user > 0)
            nonfinite = ~finite & (known_per_user > 0)
            user = torch.where(usable[:, None], user, torch.zeros_like(user)).to(self._cand_emb.dtype)
            self._sync()
            t1 = time.perf_counter()
            vals, cols = self._topk_tiled(user, seen_rows, seen_cols, k)            # [B, k], [B, k]
            ids = self._cand_ids[cols]                                              # [B, k] external ids
            vals_np = vals.float().cpu().numpy()
            ids_np = ids.cpu().numpy()
            usable_np = usable.cpu().numpy()
            stats.unknown_items = int(unknown)
            stats.nonfinite_users = int(nonfinite.sum())
        stats.encode_s, stats.score_s = t1 - t0, time.perf_counter() - t1
        use_fallback = ~usable_np
        if use_fallback.any():
            ids_np[use_fallback] = self._fallback_ids
            vals_np[use_fallback] = self._fallback_scores
        stats.fallback_users = int(use_fallback.sum())
        stats.model_users = n_users - stats.fallback_users
        return ids_np, vals_np, use_fallback, stats

    def _prepare(self, items: torch.Tensor, lengths: torch.Tensor, n_users: int):
        """Ids -> model indices, the padded model input, and the (row, column) pairs to mask. On device.

        Unknown items are dropped without compacting anything: each known item's place in the
        padded row is its rank from the end among the row's known items.
        """
        dev = self.device
        max_len = int(self.model.max_len)
        num_v = self._vocab_sorted.shape[0]
        pos = torch.searchsorted(self._vocab_sorted, items).clamp_(max=max(num_v - 1, 0))  # [S]
        known = self._vocab_sorted[pos] == items if num_v else torch.zeros_like(items, dtype=torch.bool)
        index = torch.where(known, self._vocab_order[pos], torch.zeros_like(pos))   # [S] model index, 0 unknown
        rows = torch.repeat_interleave(torch.arange(n_users, device=dev), lengths)  # [S] user row of each item
        known_l = known.long()
        csum = torch.cumsum(known_l, 0)                                             # [S] known items so far
        row_end = torch.cumsum(lengths, 0) - 1                                      # [U] last position per row
        total_known = torch.zeros(n_users, dtype=torch.long, device=dev)
        total_known.index_add_(0, rows, known_l)                                    # [U]
        end_csum = torch.where(lengths > 0, csum[row_end.clamp(min=0)], torch.zeros_like(lengths)) if len(csum) \
            else torch.zeros(n_users, dtype=torch.long, device=dev)
        from_end = end_csum[rows] - csum                                            # [S] known items after this one
        place = known & (from_end < max_len)
        seq = torch.zeros((n_users, max_len), dtype=torch.long, device=dev)         # [B, L] newest last
        seq[rows[place], (max_len - 1 - from_end)[place]] = index[place]
        cols = self._cand_of_item[index]                                            # [S] candidate column or -1
        seen = known & (cols >= 0)
        return seq, rows[seen], cols[seen], total_known, int((~known).sum())

    def tile_size(self, rows: int, element_bytes: int) -> int:
        """Items per tile: ``item_tile`` when set; else as many as keep one ``[rows, tile]`` score
        matrix within ``max_tile_mb``, so a large catalog cannot exhaust a GPU's (or a worker's)
        memory whatever the chunk size; else the whole candidate set."""
        num_c = self.num_candidates
        if 0 < self.item_tile < num_c:
            return self.item_tile
        if self.max_tile_mb > 0 and rows > 0:
            fit = int(self.max_tile_mb * 2**20) // (rows * element_bytes)
            return max(1, min(fit, num_c))
        return num_c

    def _topk_tiled(self, user: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, k: int):
        """Top-k over all candidates, one item tile at a time, merging a running top-k.

        The score matrix of one tile is [B, tile]; with item_tile=0 the whole candidate set is
        one tile. Seen items are set to -inf inside the tile they fall in, before its top-k.
        """
        num_c = self.num_candidates
        tile = self.tile_size(len(user), user.element_size())
        neg_inf = torch.tensor(float("-inf"), dtype=user.dtype, device=user.device)
        best_val: torch.Tensor | None = None
        best_idx: torch.Tensor | None = None
        for start in range(0, num_c, tile):
            stop = min(start + tile, num_c)
            scores = user @ self._cand_emb[start:stop].T                             # [B, T]
            if len(cols):
                if tile == num_c:
                    scores.index_put_((rows, cols), neg_inf)
                else:
                    in_tile = (cols >= start) & (cols < stop)
                    scores.index_put_((rows[in_tile], cols[in_tile] - start), neg_inf)
            v, i = torch.topk(scores, min(k, stop - start), dim=1)                   # [B, kt]
            if best_val is None:
                best_val, best_idx = v, i + start
            else:
                v = torch.cat([best_val, v], dim=1)                                  # [B, k + kt]
                i = torch.cat([best_idx, i + start], dim=1)
                best_val, pos = torch.topk(v, k, dim=1)
                best_idx = torch.gather(i, 1, pos)
        assert best_val is not None and best_idx is not None
        return best_val, best_idx

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _autocast(self):
        if self.device.type == "cuda" and self.dtype != "float32":
            return torch.autocast("cuda", dtype=_DTYPES[self.dtype])
        return contextlib.nullcontext()


class _HostStaging:
    """Host -> device copies through reusable pinned buffers (non-blocking); plain views on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[int, torch.Tensor] = {}

    def to_device(self, array: np.ndarray, slot: int) -> torch.Tensor:
        array = np.ascontiguousarray(array, dtype=np.int64)
        if self.device.type != "cuda":
            # zero-copy views of Arrow buffers are read-only, which torch does not allow for tensors
            return torch.from_numpy(array if array.flags.writeable else array.copy())
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < array.size:
            buf = torch.empty(max(array.size, 1 << 16), dtype=torch.long).pin_memory()
            self._buffers[slot] = buf
        staged = buf[: array.size]
        staged.numpy()[:] = array
        # safe to reuse the buffer next chunk: every chunk ends with a device -> host copy (a sync)
        return staged.to(self.device, non_blocking=True)


def _to_arrow(user_ids: np.ndarray, ids: np.ndarray, vals: np.ndarray, use_fallback: np.ndarray,
              fallback_name: str) -> tuple[pa.RecordBatch, np.ndarray]:
    """[U, k] top-N arrays -> one Arrow batch; zero-copy when no slot is masked (the usual case)."""
    n_users, k = ids.shape
    valid = np.isfinite(vals)                                   # masked slots hold -inf
    if valid.all():
        counts = np.full(n_users, k, dtype=np.int64)
        offsets = np.arange(0, (n_users + 1) * k, k, dtype=np.int32) if k else np.zeros(n_users + 1, np.int32)
        flat_ids, flat_vals = ids.reshape(-1), vals.reshape(-1)
    else:
        counts = valid.sum(axis=1)
        offsets = np.zeros(n_users + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        flat_ids, flat_vals = ids[valid], vals[valid]
    recs = pa.ListArray.from_arrays(
        pa.array(offsets, type=pa.int32()),
        pa.StructArray.from_arrays(
            [pa.array(flat_ids, type=pa.int64()), pa.array(flat_vals, type=pa.float32())],
            fields=list(RECOMMENDATION_TYPE.value_type),
        ),
        type=RECOMMENDATION_TYPE,
    )
    source = pa.DictionaryArray.from_arrays(
        pa.array(use_fallback.astype(np.int8)), pa.array([SOURCE_MODEL, fallback_name])
    ).cast(pa.string())
    batch = pa.RecordBatch.from_arrays([pa.array(user_ids), recs, source], names=["user_id", "recommendations", "source"])
    return batch, counts


def popularity_fallback(item_ids: np.ndarray, counts: np.ndarray, top_n: int) -> Fallback:
    """Most frequent candidate items first; score = share of events, so it reads like a probability."""
    item_ids = np.asarray(item_ids, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.float64)
    order = np.lexsort((item_ids, -counts))[:top_n]    # by count desc, then item id for determinism
    total = counts.sum() or 1.0
    return Fallback(SOURCE_POPULARITY, item_ids[order], (counts[order] / total).astype(np.float32))
