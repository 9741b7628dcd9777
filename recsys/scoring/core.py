"""The scoring core: histories in, top-N out, in big device-sized chunks. Pure torch/numpy/pyarrow.

Everything that touches one user's data is vectorised over a whole chunk: histories arrive as an
Arrow list column (offsets + flat values), become one padded tensor, are encoded in one forward
pass, scored against the candidate item matrix (tiled over the catalog when it is large, with a
running top-N merge), masked (already-seen items) and cut to the top N on the device. Only the top
N per user leave the device, and they leave as Arrow list arrays, never as Python lists.

The top N never sorts the whole score matrix (:func:`exact_topk`): on the CPU, users are scored a
block of rows at a time, so the block's ``[rows, items]`` scores stay in cache between the product,
the masking and the selection; the selection takes each group's best score in one vectorised
pass, keeps the N + 1 best groups (which must hold the N best items) and picks the N best among their
few thousand members (on the CPU, only the hundred or so members at or above the (N+1)-th group
maximum are ordered). The result is exact, in a documented order: score descending, ties by
candidate column ascending (which is model item index ascending).

``dtype="bfloat16"`` scores in bf16 on CPUs that run it natively (AVX-512-BF16 or AMX-BF16, see
:func:`cpu_bf16_supported`) and on CUDA: the encoder, the product and the selection of ``1.5 N``
candidates run in bf16, and those candidates are rescored in fp32, so the published scores are fp32 and the list
differs from fp32's only where bf16 rounding (of the encoder, which runs under bf16 autocast, and of
the product) moved a true top-N item below ``1.5 N`` or reordered near-ties.

``dtype="int8"`` does the same with 8-bit integer products on CPUs that have integer dot-product
instructions (AMX-INT8, AVX-512-VNNI or AVX-VNNI, see :func:`cpu_int8_refusal`): the encoder's large
linear layers are dynamically quantized, the product with the candidates runs against the item matrix
quantized per item once per model load (:mod:`recsys.model.int8`), and the ``1.5 N`` candidates it
preselects are rescored in fp32 against the fp32 item rows, so the published scores are fp32 dot
products of the user vector and the items.

The operators' rules (docs/rules.md) act here as data, not as a second pass: each user's rule-excluded items
arrive with the chunk and become (row, column) pairs masked in the same selection as the known items (and
dropped from the known items the repeat blend merges); ``RuleParams`` masks every known item (``touched``), caps
the known items a list holds (``min_new_items``) and fills lists left short from the popularity ranking, only
with items not off limits for the user (``fill``). The fallback's rows are filled from the fallback list the same
way, so an excluded item reaches no list.

The repeat blend may weigh new items' recent popularity (``RepeatBlend.popularity_weight``): the weighted prior of
each candidate (``recent_users``: users of the last day) is added to the product's scores before the selection
(and to the fp32 rescoring), so it orders the new items at no cost beyond one add per score. It may weigh
item-to-item scores too (``RepeatBlend.item_to_item_weight``, :mod:`recsys.model.item_to_item`): per row block, the
weights' rows of the user's known items are summed (one ``embedding_bag`` over ``[weighted items, weighted
candidates]``) and added to the weighted candidates' columns of each tile's scores before the selection, and to the
rescoring.

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
from recsys.model import int8 as int8_kernels
from recsys.model.base import SequenceRecommender
from recsys.model.item_to_item import ItemToItem, user_scores
from recsys.model.precision import cpu_bf16_supported, cpu_int8_refusal
from recsys.model.repeats import MASK_KNOWN, SECONDS_PER_DAY, RepeatBlend, merge_known, popularity_prior
from recsys.scoring.params import DEFAULT_RULES, RuleParams
from recsys.sequences import Sequences, Vocabulary, lookup_sorted

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# scoring.dtype values: the float ones, and int8 (quantized products, the item rows kept in fp32 for rescoring)
DTYPES = (*_DTYPES, "int8")

# CPU row blocks: one block's [rows, items] score matrix is kept near this size, so it is still in
# cache when it is masked and its top N selected: faster than one whole-chunk matrix (measured:
# docs/performance.md, "Figures that lived in the code").
CPU_BLOCK_BYTES = 16 * 2**20
# exact_topk on accelerators: strided groups of GROUP columns; direct selection below this many groups
# per wanted item (too few groups to filter anything). Measured on an H200 (docs/performance.md, GPU).
GROUP = 16
MIN_GROUPS_PER_ITEM = 4
# exact_topk on the CPU: contiguous groups of CPU_GROUP columns (a max over 32 adjacent floats is two
# AVX-512 vectors; groups of 16, 20, 25, 40 and 50 were slower), grouped while there are at least
# CPU_MIN_GROUPS_PER_ITEM groups per wanted item. Faster on the CPU than the strided groups' path
# (measured: docs/performance.md, "The fast core"; benchmarks/core_breakdown.py shows the share in the
# whole core).
CPU_GROUP = 32
CPU_MIN_GROUPS_PER_ITEM = 2
# bf16: candidates preselected per wanted item, then rescored in fp32. With an fp32 encoder, 1.5 N
# preselected gives the fp32 lists exactly, as 2 N does, so 1.5 N; the bf16 product alone saves
# little, because the selection costs the same: the speed comes from encoding under bf16 autocast
# (which moves near-ties, so the lists overlap fp32's rather than equal them), which the CPU path
# therefore does too, as CUDA always did (measured: docs/performance.md, "The fast core" and
# "Figures that lived in the code").
BF16_PRESELECT = 1.5
ENCODE_BF16_ON_CPU = True
# int8: which parts run in int8 (benchmarks/int8_parts.py measures each alone and both; docs/performance.md)
INT8_ENCODER = True
INT8_PRODUCT = True


class UnsupportedDtype(ValueError):
    """The device cannot run this scoring dtype natively: a configuration error wherever it is raised.

    Raised on an executor, it reaches the driver inside Spark's error text, where the nightly job finds
    it by this class's name (:func:`recsys.pipelines.nightly_stages.score`) and reports it as bad configuration (exit 2).
    """


def check_dtype(dtype: str, device: torch.device) -> None:
    """Refuse a scoring dtype the device cannot run natively, naming what to use instead."""
    if dtype not in DTYPES:
        raise ValueError(f"scoring.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype == "int8":
        if device.type != "cpu":
            raise UnsupportedDtype(f"scoring.dtype=int8 is for CPUs (AMX-INT8 or AVX-512-VNNI/AVX-VNNI); on {device} "
                                   "use bfloat16 or float16")
        refusal = cpu_int8_refusal()
        if refusal:
            raise UnsupportedDtype(f"scoring.dtype=int8 needs a CPU with AMX-INT8, AVX-512-VNNI or AVX-VNNI and "
                                   f"torch's oneDNN int8 kernels, but {refusal}. Use scoring.dtype=float32 on these "
                                   "workers (or bfloat16 where the CPU has AVX-512-BF16 or AMX-BF16)")
        return
    if device.type != "cpu" or dtype == "float32":
        return
    if dtype == "float16":
        raise UnsupportedDtype("scoring.dtype=float16 is for CUDA devices; on the CPU use float32, or bfloat16 "
                               "where the CPU supports it (AVX-512-BF16 or AMX-BF16)")
    if not cpu_bf16_supported():
        raise UnsupportedDtype("scoring.dtype=bfloat16 needs a CPU with AVX-512-BF16 or AMX-BF16 (see the flags in "
                               "/proc/cpuinfo); this one has neither, so bf16 would be emulated and slower than fp32. "
                               "Use scoring.dtype=float32 on these workers")


def _order_keys(vals: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is (score descending, column ascending), one key per (score, column).

    The float's bits, made monotone (negative floats flipped), above the inverted column: unique
    keys make torch.topk's result fully determined. NaN sorts first, as torch.topk puts it.
    """
    v = vals.float() + 0.0                                   # -0.0 -> +0.0: equal scores, equal keys
    bits = v.view(torch.int32).long()                        # [..] sign-extended
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)     # monotone in v over all non-NaN floats
    key = torch.where(torch.isnan(v), torch.full_like(key, 2**31 - 1), key)
    return key * 2**32 + (2**32 - 1 - cols)


def _keyed_topk(vals: torch.Tensor, cols: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best (score, column) pairs of each row, in the documented order. [n, m] -> 2 x [n, k]."""
    _, pos = torch.topk(_order_keys(vals, cols), k, dim=1)   # sorted: best first
    return torch.gather(vals, 1, pos), torch.gather(cols, 1, pos)


def _unique_floor(top: torch.Tensor) -> torch.Tensor:
    """[n, k+1] values (any order), the k+1 best of their rows by torch.topk -> [n] bool: the smallest
    is strictly below the other k and no value is NaN, so the k best of the row are exactly the k
    others, whatever torch.topk did with ties below them."""
    floor = top.amin(dim=1, keepdim=True)
    return ((top == floor).sum(dim=1) == 1) & ~torch.isnan(top).any(dim=1)


def _select_ordered(vals: torch.Tensor, cols: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`_keyed_topk`, for less: a float ``torch.topk`` of ``k + 1`` (unsorted) finds the k
    best wherever its smallest value is unique (:func:`_unique_floor`), and only those ``k + 1`` are
    ordered by key; rows with a tie at the k-th place (or a NaN) take :func:`_keyed_topk` whole."""
    n, m = vals.shape
    if m <= k + 1:
        return _keyed_topk(vals, cols, k)
    top, pos = torch.topk(vals, k + 1, dim=1, sorted=False)                    # [n, k+1]
    out_vals, out_cols = _keyed_topk(top, torch.gather(cols, 1, pos), k)       # drops the unique floor, orders
    bad = ~_unique_floor(top)
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(1)
        out_vals[rows], out_cols[rows] = _keyed_topk(vals[rows], cols[rows], k)
    return out_vals, out_cols


def exact_topk(scores: torch.Tensor, k: int, group: int | None = None,
               exact: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of each row of ``scores`` [n, C] -> (values [n, k], columns [n, k] int64), without
    sorting the rows.

    >>> values, columns = exact_topk(torch.tensor([[0.125, 0.75, 0.5, 0.75]]), 2)
    >>> values.tolist(), columns.tolist()             # the tie at 0.75: column 1 before column 3
    ([[0.75, 0.75]], [[1, 3]])

    Exact: the same values as ``torch.topk(scores, k)``, ordered by score descending and, among
    equal scores, by column ascending (torch.topk leaves the order of ties unspecified). NaN ranks
    first, as in torch.topk.

    How: columns fall into groups, and one vectorised max finds each group's best. The k-th best of
    the group maxima, ``t``, is at most the k-th best score (the k best groups hold k distinct scores
    >= t), so every top-k score is >= t and its group's maximum too: the groups whose maximum is >= t
    hold the whole answer. When exactly k groups reach ``t`` (the (k+1)-th group maximum is below it,
    read off an unsorted top ``k + 1`` of the maxima, :func:`_unique_floor`), the ``k + 1`` best
    groups' members are a superset of the answer. Rows where more groups tie at ``t`` (many equal
    scores, e.g. a row mostly masked to -inf) or that hold a NaN are answered over the whole row
    instead. With ``exact=False`` (the bf16 preselection, whose candidates are rescored and ordered
    later) the k best come back in any order, and ties at the k-th place are broken as it happens;
    on accelerators such rows keep the groups torch.topk chose.

    The groups are laid out for the device: on the CPU, ``CPU_GROUP`` adjacent columns, and only the
    members at or above the (k+1)-th group maximum (about k of them) are ordered
    (:func:`_topk_over_contiguous_groups`); on accelerators, every ``C // GROUP``-th column, and the
    k best members are picked by a top-k (:func:`_topk_over_strided_groups`).
    """
    n, num_c = scores.shape
    on_cpu = scores.device.type == "cpu"
    group = (CPU_GROUP if on_cpu else GROUP) if group is None else group
    groups = num_c // group if group > 1 else 0
    per_item = CPU_MIN_GROUPS_PER_ITEM if on_cpu else MIN_GROUPS_PER_ITEM
    if k == 0 or groups < max(k + 1, per_item * k):
        full = torch.arange(num_c, device=scores.device).expand(n, num_c)
        return _select_ordered(scores, full, k) if exact else _keyed_topk(scores, full, k)
    if on_cpu:
        return _topk_over_contiguous_groups(scores, k, group, exact)
    return _topk_over_strided_groups(scores, k, group, exact)


def _whole_rows(scores: torch.Tensor, vals: torch.Tensor, cols: torch.Tensor, k: int, bad: torch.Tensor,
                exact: bool = True) -> None:
    """Answer the ``bad`` rows over the whole row, in place: a tie at the threshold, or a NaN."""
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(1)
        full = torch.arange(scores.shape[1], device=scores.device).expand(len(rows), scores.shape[1])
        select = _select_ordered if exact else _keyed_topk
        vals[rows], cols[rows] = select(scores[rows], full, k)


def _topk_over_contiguous_groups(scores: torch.Tensor, k: int, group: int,
                                 exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`exact_topk` with groups of ``group`` adjacent columns (the CPU layout).

    The ``k + 1`` best groups' members are read as whole rows of a sliding-window view (one copy of
    ``group`` adjacent floats per group), and only those at or above the threshold ``t`` (the
    (k+1)-th group maximum) are kept: at least k + 1 of them, usually a few more. They are compacted
    to the left of a ``[n, most kept]`` block, -inf after them, and the k best are ordered by key.
    Columns past the last whole group are always kept as members. Scores of another dtype are
    converted to fp32 first (the values come back in fp32): the CPU's max over adjacent bf16 columns
    is not vectorised, and the conversion costs far less than that loses (measured: docs/performance.md,
    "Figures that lived in the code").
    """
    if scores.dtype != torch.float32:
        scores = scores.float()
    n, num_c = scores.shape
    groups = num_c // group
    body = groups * group
    dev = scores.device
    row_stride = scores.stride(0)
    if scores.stride(1) != 1:
        scores = scores.contiguous()
        row_stride = num_c
    best = scores.as_strided((n, groups, group), (row_stride, group, 1)).amax(dim=2)   # [n, G] group maxima
    top_g, gi = torch.topk(best, k + 1, dim=1, sorted=False)                          # [n, k+1], any order
    floor = top_g.amin(dim=1, keepdim=True)                                            # [n, 1]: t
    # row r's group j starts at element r * row_stride + j * group of the storage
    windows = (n - 1) * row_stride + num_c - group + 1 if n else 0                     # each element's next `group`
    storage = scores.as_strided((windows, group), (1, 1), scores.storage_offset())
    starts = (gi * group + torch.arange(n, device=dev)[:, None] * row_stride).reshape(-1)
    members = storage.index_select(0, starts).view(n, (k + 1) * group)                # [n, (k+1) * group]
    rest = num_c - body
    if rest:
        members = torch.cat([members, scores[:, body:]], dim=1)                         # [n, (k+1) * group + rest]
    keep = members >= floor                                                             # [n, M]
    counts = keep.sum(dim=1)                                                            # [n], each >= k + 1
    if exact:   # a tie at the threshold could leave out an item that belongs in the answer
        bad = ~_unique_floor(top_g)
    else:       # any k best will do, ties included; only rows where nearly everything ties go whole
        bad = counts > 2 * (k + 1)
    if rest:
        bad |= torch.isnan(scores[:, body:]).any(dim=1)
    if bool(bad.any()):
        # rows answered over the whole row keep nothing here, so one user whose scores all tie (a
        # zero vector: no usable history) does not widen the whole block to every member
        keep &= ~bad[:, None]
        counts = counts.masked_fill(bad, 0)
    width = max(int(counts.max()), k) if n else k
    r, c = keep.nonzero(as_tuple=True)                                                  # row-major: rows sorted
    slot = torch.arange(len(r), device=dev) - (torch.cumsum(counts, 0) - counts)[r]
    in_group = c < (k + 1) * group
    col = torch.where(in_group, gi[r, (c // group).clamp_(max=k)] * group + c % group, body + c - (k + 1) * group)
    vals = scores.new_full((n, width), float("-inf"))
    cols = torch.full((n, width), num_c, dtype=torch.long, device=dev)                  # after every real column
    vals[r, slot] = members[r, c]
    cols[r, slot] = col
    if exact:
        out_vals, out_cols = _keyed_topk(vals, cols, k)                                 # [n, k] x 2
    else:                                                                               # any order: rescored later
        out_vals, pos = torch.topk(vals, k, dim=1, sorted=False)
        out_cols = torch.gather(cols, 1, pos)
    _whole_rows(scores, out_vals, out_cols, k, bad, exact)
    return out_vals, out_cols


def _topk_over_strided_groups(scores: torch.Tensor, k: int, group: int,
                              exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`exact_topk` with column ``c`` in group ``c % G`` (the accelerator layout): one max over
    a [n, group, G] view finds each group's best; the k best of the ``k + 1`` best groups' members
    are picked by a float top-k (:func:`_select_ordered`)."""
    n, num_c = scores.shape
    groups = num_c // group
    body = groups * group
    best = scores[:, :body].view(n, group, groups).amax(dim=1)                # [n, G] group maxima
    top_g, gi = torch.topk(best, k + 1, dim=1, sorted=False)                  # [n, k+1], any order
    strides = torch.arange(0, body, groups, device=scores.device)             # [group]
    cols = (gi[:, :, None] + strides[None, None, :]).reshape(n, (k + 1) * group)   # [n, (k+1) * group]
    if body < num_c:                                                          # the columns past the last group
        rest = torch.arange(body, num_c, device=scores.device).expand(n, num_c - body)
        cols = torch.cat([cols, rest], dim=1)
    members = torch.gather(scores, 1, cols)                                   # [n, (k+1) * group (+ rest)]
    if not exact:                                                             # any order: rescored and ordered later
        vals, pos = torch.topk(members, k, dim=1, sorted=False)
        return vals, torch.gather(cols, 1, pos)
    vals, cols = _select_ordered(members, cols, k)                            # [n, k] x 2
    _whole_rows(scores, vals, cols, k, ~_unique_floor(top_g))
    return vals, cols


def resolve_device(requested: str, spark_gpus: list[str] | None = None) -> torch.device:
    """The device a worker scores on.

    ``auto`` prefers the GPU Spark assigned to this task (its resource addresses), then any CUDA
    device, then the CPU. Spark does not schedule GPUs in local mode, so an empty assignment is
    normal there and falls back cleanly.

    >>> resolve_device("cpu")
    device(type='cpu')
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

    >>> from recsys.sequences import Vocabulary
    >>> candidates, unknown = candidate_set(np.array([10, 20, 99]), Vocabulary(np.array([30, 10, 20])))
    >>> candidates.item_ids.tolist(), candidates.index.tolist(), unknown     # 99: not in the vocabulary
    ([10, 20], [2, 3], 1)
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

    >>> counts_per_candidate(np.array([10, 20]), np.array([20, 20, 10, 99]), np.array([1, 2, 5, 7])).tolist()
    [5, 3]
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


@dataclass(frozen=True)
class KnownItems:
    """What the repeats of each history item say, aligned with a chunk's flat history items."""

    counts: np.ndarray     # [S] int64 events with the item in the window
    last_us: np.ndarray    # [S] int64 the latest of them, epoch microseconds
    now_us: int            # the instant the lists are for (the night), epoch microseconds


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
    # dtype int8: the model's int8 parts, built once per model load (the worker caches them with the
    # model, recsys.scoring.cache.INT8); None: built here
    int8: int8_kernels.Int8Model | None = field(default=None, repr=False)
    # how the user's known items compete with new ones (saved with the model); masked: never listed
    blend: RepeatBlend = MASK_KNOWN
    # the operators' rules applied to each list (recommend.*: touched items masked, the least number of new
    # items, what fills a short list); the per-user exclusions come with each chunk (topn's ``excluded``)
    rules: RuleParams = DEFAULT_RULES
    # users per candidate in the window, aligned with ``candidates``: the popularity ranking short lists are
    # filled from (rules.fill); None: the fallback list's ranking
    popularity: np.ndarray | None = field(default=None, repr=False)
    # users per candidate on the last day before the lists' day, aligned with ``candidates``: the new items'
    # recent-popularity prior, added to their scores times ``blend.popularity_weight``; None: no prior
    recent_users: np.ndarray | None = field(default=None, repr=False)
    # the item-to-item weights saved with the model, added to new items' scores times ``blend.item_to_item_weight``;
    # None: none
    item_to_item: ItemToItem | None = field(default=None, repr=False)
    _cand_emb: torch.Tensor = field(init=False, repr=False)
    _int8_tiles: list | None = field(init=False, repr=False)
    _cand_emb32: torch.Tensor = field(init=False, repr=False)
    _cand_of_item: torch.Tensor = field(init=False, repr=False)
    _cand_ids: torch.Tensor = field(init=False, repr=False)
    _vocab_sorted: torch.Tensor = field(init=False, repr=False)
    _vocab_order: torch.Tensor = field(init=False, repr=False)
    _fallback_cols: torch.Tensor = field(init=False, repr=False)
    _fallback_scores: torch.Tensor = field(init=False, repr=False)
    _fill_cols: torch.Tensor = field(init=False, repr=False)
    _fill_scores: torch.Tensor = field(init=False, repr=False)
    _prior: torch.Tensor | None = field(init=False, repr=False)   # [C] fp32 weighted prior, None: none
    # item-to-item: [V', W] weighted rows of the weighted items the model knows, restricted to the W candidate columns
    # that have weights; those columns ascending ([W], and as numpy for the tiles' bounds); model index -> row (-1);
    # candidate column -> position among the W (-1). None: no item-to-item scores
    _i2i_weights: torch.Tensor | None = field(init=False, repr=False)
    _i2i_cols: torch.Tensor = field(init=False, repr=False)
    _i2i_cols_np: np.ndarray = field(init=False, repr=False)
    _i2i_row_of_index: torch.Tensor = field(init=False, repr=False)
    _i2i_pos_of_col: torch.Tensor = field(init=False, repr=False)
    _staging: "_HostStaging" = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_dtype(self.dtype, self.device)
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
            self._cand_emb32 = cand_emb.contiguous()                                    # rescoring (bf16/fp16/int8)
            self._cand_emb = cand_emb.to(_DTYPES.get(self.dtype, torch.float32)).contiguous()
        lookup = torch.full((num_items + 1,), -1, dtype=torch.long)
        lookup[idx] = torch.arange(len(idx), dtype=torch.long)
        self._cand_of_item = lookup.to(dev)                                  # [num_items + 1] -> column or -1
        self._cand_ids = torch.as_tensor(self.candidates.item_ids, dtype=torch.long).to(dev)   # [C]
        self._int8_tiles = None
        if self.dtype == "int8":
            if self.int8 is None:
                self.int8 = int8_kernels.quantize_for_scoring(self.model)
            if INT8_PRODUCT:   # packed per item tile, once per candidate set: the quantized rows come from self.int8
                tile = self.tile_size(self.row_block(1 << 62), 4)
                self._int8_tiles = [(lo, min(lo + tile, len(idx)), self.int8.pack_items(idx[lo:lo + tile]))
                                    for lo in range(0, len(idx), tile)]
        order = np.argsort(self.vocab.item_ids, kind="stable")
        self._vocab_sorted = torch.as_tensor(self.vocab.item_ids[order]).to(dev)              # [V] sorted ids
        self._vocab_order = torch.as_tensor(order + 1, dtype=torch.long).to(dev)              # -> model index
        # the fallback list and the popularity ranking, as candidate columns best first (filled from on the device)
        by_id = np.argsort(self.candidates.item_ids, kind="stable")
        pos, found = lookup_sorted(self.candidates.item_ids[by_id], np.asarray(self.fallback.item_ids, dtype=np.int64))
        self._fallback_cols = torch.as_tensor(by_id[pos[found]], dtype=torch.long).to(dev)
        self._fallback_scores = torch.as_tensor(np.asarray(self.fallback.scores, dtype=np.float32)[found]).to(dev)
        if self.popularity is None:
            self._fill_cols, self._fill_scores = self._fallback_cols, self._fallback_scores
        else:
            counts = np.asarray(self.popularity, dtype=np.float64)
            if len(counts) != len(self.candidates.item_ids):
                raise ValueError(f"popularity has {len(counts)} counts for {len(self.candidates.item_ids)} candidates")
            order = np.lexsort((self.candidates.item_ids, -counts))   # as popularity_fallback ranks: count, then id
            self._fill_cols = torch.as_tensor(order, dtype=torch.long).to(dev)
            self._fill_scores = torch.as_tensor((counts[order] / (counts.sum() or 1.0)).astype(np.float32)).to(dev)
        self._prior = None
        if self.blend.popularity_weight and self.recent_users is not None:
            if len(self.recent_users) != len(self.candidates.item_ids):
                raise ValueError(f"recent_users has {len(self.recent_users)} counts for "
                                 f"{len(self.candidates.item_ids)} candidates")
            prior = self.blend.popularity_weight * popularity_prior(self.recent_users)
            self._prior = torch.as_tensor(prior, dtype=torch.float32).to(dev)
        self._prepare_item_to_item(num_items)
        self._staging = _HostStaging(dev)

    def _prepare_item_to_item(self, num_items: int) -> None:
        """The item-to-item weights in the core's terms (see the fields), when the blend weighs them."""
        self._i2i_weights = None
        if not self.blend.item_to_item_weight:
            return
        if self.item_to_item is None:
            raise ValueError(f"the repeat blend weighs item-to-item scores ({self.blend.item_to_item_weight:g}) but no "
                             "item-to-item weights came with the model")
        dev = self.device
        rows, index = self.item_to_item.known_to(self.vocab)                       # [V'] the ones the model knows
        cols = self._cand_of_item.cpu().numpy()[index]                              # [V'] candidate column or -1
        scored = np.flatnonzero(cols >= 0)
        order = scored[np.argsort(cols[scored], kind="stable")]                     # weighted candidates by column
        weights = self.item_to_item.weights[np.ix_(rows, rows[order])]             # [V', W]
        self._i2i_weights = torch.as_tensor(self.blend.item_to_item_weight * weights, dtype=torch.float32).to(dev)
        self._i2i_cols_np = cols[order].astype(np.int64)
        self._i2i_cols = torch.as_tensor(self._i2i_cols_np).to(dev)
        row_of_index = torch.full((num_items + 1,), -1, dtype=torch.long)
        row_of_index[torch.as_tensor(index)] = torch.arange(len(rows))
        self._i2i_row_of_index = row_of_index.to(dev)
        pos_of_col = torch.full((self.num_candidates,), -1, dtype=torch.long)
        pos_of_col[torch.as_tensor(self._i2i_cols_np)] = torch.arange(len(order))
        self._i2i_pos_of_col = pos_of_col.to(dev)

    @property
    def num_candidates(self) -> int:
        return int(self._cand_ids.shape[0])

    @property
    def known_items_compete(self) -> bool:
        """Whether a user's known items may enter the lists, at the repeat blend's scores: neither the blend nor the
        touched-items rule masks them. Otherwise every listed score is the model's (or the popularity fill's)."""
        return not (self.blend.masks_known or self.rules.touched)

    def score(self, user_ids: np.ndarray, history_ids: Sequences, known: "KnownItems | None" = None,
              excluded: Sequences | None = None) -> tuple[pa.RecordBatch, ChunkStats]:
        """Top-N for one chunk of users -> (Arrow batch: user_id, recommendations, source), stats.

        ``history_ids`` are external item ids, oldest first; items the model does not know are
        dropped and counted, and users left with no known item get the fallback, as do users whose
        vector comes out non-finite (a NaN must never rank first). ``known``: what the repeats of each
        history item say, for a blend that lets known items compete (None: every known item counts once,
        seen just now). ``excluded``: each user's items the rules exclude (``recommend.exclude.events``).
        """
        ids, scores, use_fallback, stats = self.topn(history_ids, known, excluded)
        t0 = time.perf_counter()
        batch, counts = _to_arrow(np.asarray(user_ids, dtype=np.int64), ids, scores, use_fallback, self.fallback.name)
        stats.short_lists = int((counts < self.top_n).sum())
        stats.to_arrow_s = time.perf_counter() - t0
        return batch, stats

    def topn(self, history_ids: Sequences, known: "KnownItems | None" = None,
             excluded: Sequences | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, ChunkStats]:
        """-> (item ids [U, k], scores [U, k] float32, fallback rows [U] bool, stats); k = min(N, candidates).

        With a blend that masks known items (or the ``touched`` rule), the scores are the model's (plus the new
        items' popularity prior where the blend weighs it) and known items never appear; with one that lets them
        compete, known and new items are merged by blended score (:mod:`recsys.model.repeats`), at most ``k -
        rules.min_new_items`` of them known. ``excluded``: each user's items the rules exclude, aligned with
        ``history_ids``: masked in the selection, dropped from the known items, never in the user's list (the
        fallback's included). With ``rules.fill`` popularity, a list left short takes the most popular items neither
        masked for the user nor listed, each scored its popularity share capped at the score before it (so lists
        stay ordered). Slots that could not be filled (fewer eligible candidates than k) hold a -inf score.
        """
        n_users = len(history_ids)
        k = min(self.top_n, self.num_candidates)
        stats = ChunkStats(users=n_users, chunks=1, history_items=len(history_ids.items))
        t0 = time.perf_counter()
        with torch.inference_mode():
            items = self._staging.to_device(history_ids.items, slot=0)              # [S] external ids
            lengths = self._staging.to_device(history_ids.lengths, slot=1)          # [U]
            prepared = self._prepare(items, lengths, n_users)
            seq, seen_rows, seen_cols, seen_at, known_per_user, unknown, history = prepared
            mask_known = not self.known_items_compete
            ex_rows, ex_cols = self._excluded_pairs(excluded, n_users)
            if len(ex_rows):   # masked in the selection with the known items; never merged back as known items
                num_c = self.num_candidates
                drop = torch.isin(seen_rows * num_c + seen_cols, ex_rows * num_c + ex_cols)
                sel_rows, sel_cols = torch.cat([seen_rows, ex_rows]), torch.cat([seen_cols, ex_cols])
                order = torch.argsort(sel_rows, stable=True)                      # _select wants rows sorted
                sel_rows, sel_cols = sel_rows[order], sel_cols[order]
                seen_rows, seen_cols, seen_at = seen_rows[~drop], seen_cols[~drop], seen_at[~drop]
            else:
                sel_rows, sel_cols = seen_rows, seen_cols
            # what no slot of the user's list may hold: the rules' exclusions, and known items when masked
            off_rows, off_cols = (sel_rows, sel_cols) if mask_known else (ex_rows, ex_cols)
            with self._autocast():
                user = self._encode(seq)                                            # [B, D]
            finite = torch.isfinite(user).all(dim=1)                                # [B]
            usable = finite & (known_per_user > 0)
            nonfinite = ~finite & (known_per_user > 0)
            user = torch.where(usable[:, None], user, torch.zeros_like(user)).float()   # [B, D]
            self._sync()
            t1 = time.perf_counter()
            vals, cols = self._select(user, sel_rows, sel_cols, k, history)         # [B, k], [B, k] new items
            if not mask_known:
                vals, cols = self._blend(vals, cols, seen_rows, seen_cols, seen_at, known, k)
            vals = vals.float()
            if k:
                fallback_rows = torch.nonzero(~usable).squeeze(1)                   # [F] the fallback's users
                if len(fallback_rows):
                    vals[fallback_rows], cols[fallback_rows] = float("-inf"), 0
                    self._fill(vals, cols, fallback_rows, off_rows, off_cols, self._fallback_cols,
                               self._fallback_scores)
                if self.rules.fill == "popularity":
                    short = torch.nonzero(torch.isneginf(vals[:, -1])).squeeze(1)   # [R] lists left short
                    self._fill(vals, cols, short, off_rows, off_cols, self._fill_cols, self._fill_scores)
            ids = self._cand_ids[cols]                                              # [B, k] external ids
            vals_np = vals.cpu().numpy()
            ids_np = ids.cpu().numpy()
            usable_np = usable.cpu().numpy()
            stats.unknown_items = int(unknown)
            stats.nonfinite_users = int(nonfinite.sum())
        stats.encode_s, stats.score_s = t1 - t0, time.perf_counter() - t1
        use_fallback = ~usable_np
        stats.fallback_users = int(use_fallback.sum())
        stats.model_users = n_users - stats.fallback_users
        return ids_np, vals_np, use_fallback, stats

    def _prepare(self, items: torch.Tensor, lengths: torch.Tensor, n_users: int):
        """Ids -> model indices, the padded model input, the (row, column) pairs to mask, and every known history
        item's (row, model index), rows ascending. On device.

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
        at = torch.nonzero(seen).squeeze(1)                                         # [seen] flat history positions
        history = (rows[known], index[known])        # every known history item (row, model index): item-to-item
        return seq, rows[seen], cols[seen], at, total_known, int((~known).sum()), history

    def _excluded_pairs(self, excluded: Sequences | None, n_users: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each user's rule-excluded items -> the (row, candidate column) pairs among them, rows ascending.
        Items the model does not know, or that are no candidates, cannot be listed anyway and are left out."""
        dev = self.device
        if excluded is None or not len(excluded.items):
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return empty, empty
        if len(excluded) != n_users:
            raise ValueError(f"excluded items for {len(excluded)} users, histories for {n_users}")
        items = self._staging.to_device(excluded.items, slot=2)                     # [X] external ids
        lengths = self._staging.to_device(excluded.lengths, slot=3)                 # [U]
        num_v = self._vocab_sorted.shape[0]
        pos = torch.searchsorted(self._vocab_sorted, items).clamp_(max=max(num_v - 1, 0))
        in_vocab = self._vocab_sorted[pos] == items if num_v else torch.zeros_like(items, dtype=torch.bool)
        index = torch.where(in_vocab, self._vocab_order[pos], torch.zeros_like(pos))
        rows = torch.repeat_interleave(torch.arange(n_users, device=dev), lengths)  # [X]
        cols = self._cand_of_item[index]                                            # [X] column or -1
        keep = in_vocab & (cols >= 0)
        return rows[keep], cols[keep]

    def _fill(self, vals: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor, off_rows: torch.Tensor,
              off_cols: torch.Tensor, ranking_cols: torch.Tensor, ranking_scores: torch.Tensor) -> None:
        """In place: the empty (-inf) slots of ``rows`` take the first items of the ranking that are neither off
        limits for the user (``off_rows``/``off_cols`` pairs) nor listed already, each scored its ranking score
        capped at the score before it. A list's items come first and its empty slots last, as top-k leaves them.

        Vectorised over the rows: only the first ``k + most off-limits pairs of a row`` ranked items can be
        needed (each row skips at most that many), so that prefix of the ranking is tested for every row at once.
        """
        if not len(rows) or not len(ranking_cols):
            return
        num_c, k = self.num_candidates, vals.shape[1]
        v, c = vals[rows], cols[rows]                                               # [R, k]
        listed = ~torch.isneginf(v)                                                 # [R, k]
        filled = listed.sum(1)                                                      # [R]
        off_per_row = (torch.bincount(off_rows, minlength=len(vals))[rows] if len(off_rows)
                       else torch.zeros_like(filled))                               # [R]
        width = min(len(ranking_cols), k + int(off_per_row.max()))
        cand = ranking_cols[:width].expand(len(rows), width)                        # [R, W] columns, best first
        keys = rows[:, None] * num_c + cand                                         # [R, W]
        taken = torch.cat([off_rows * num_c + off_cols, (rows[:, None] * num_c + c)[listed]])
        ok = ~torch.isin(keys, taken)                                               # [R, W] eligible and unlisted
        rank = torch.cumsum(ok, 1)                                                  # [R, W] 1-based among eligible
        take = ok & (rank <= (k - filled)[:, None])
        r, w = take.nonzero(as_tuple=True)
        last = v.gather(1, (filled - 1).clamp(min=0)[:, None]).squeeze(1)          # [R] the last listed score
        before = torch.where(filled > 0, last, torch.full_like(last, float("inf")))
        slot = filled[r] + rank[r, w] - 1
        v[r, slot] = torch.minimum(ranking_scores[w].to(v.dtype), before[r])
        c[r, slot] = cand[r, w]
        vals[rows], cols[rows] = v, c

    def _blend(self, new_vals: torch.Tensor, new_cols: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
               at: torch.Tensor, known: "KnownItems | None", k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The new items' top k merged with the user's known candidates by blended score (recsys.model.repeats),
        a list holding at most ``k - recommend.min_new_items`` known items."""
        max_known = k - self.rules.min_new_items if self.rules.min_new_items else None
        dev = new_vals.device
        if known is None:
            counts = torch.ones(len(at), device=dev)
            ages = torch.zeros(len(at), device=dev)
        else:
            picked = at.cpu().numpy()       # the known items' rows: a copy, so Arrow's read-only buffers are not shared
            counts = torch.from_numpy(np.asarray(known.counts)[picked]).to(dev)
            last = torch.from_numpy(np.asarray(known.last_us, dtype=np.float64)[picked]).to(dev)
            ages = ((known.now_us - last) / (SECONDS_PER_DAY * 1e6)).float()
        rank_scores = self.blend.new_scores(new_vals.shape[1], device=dev)[None, :].expand_as(new_vals)
        new_scores = torch.where(torch.isneginf(new_vals), new_vals, rank_scores)
        return merge_known(new_scores, new_cols, rows, cols, self.blend.repeat_scores(counts, ages), k,
                           max_known=max_known)

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

    def row_block(self, rows: int) -> int:
        """Users per block of the score matrix: on the CPU, as many as keep one block's scores near
        ``CPU_BLOCK_BYTES`` (in cache while masked and selected); on a GPU the whole chunk.

        Counted in fp32 bytes whatever the dtype: the CPU selection works on fp32 scores, so a bf16
        block is converted to one (:func:`_topk_over_contiguous_groups`). Sized by its 2-byte
        elements instead, a bf16 block held twice the users and its fp32 copy twice ``CPU_BLOCK_BYTES``, and
        scoring was slower (measured: docs/performance.md, "Figures that lived in the code")."""
        if self.device.type != "cpu":
            return max(rows, 1)
        fit = CPU_BLOCK_BYTES // max(1, self.num_candidates * 4)
        return int(min(max(rows, 1), max(16, fit)))

    def _select(self, user: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, k: int,
                history: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Top-k candidate columns of every user: one row block at a time, seen items masked in the
        block's scores before its selection. ``user`` [B, D] fp32 -> (values [B, k] fp32, columns [B, k]).
        ``history``: every known history item's (row, model index), rows ascending, for item-to-item scores."""
        n_users = len(user)
        block = self.row_block(n_users)
        starts = torch.arange(0, n_users + block, block, device=user.device).clamp_(max=n_users)
        bounds = torch.searchsorted(rows, starts).tolist() if len(rows) else [0] * len(starts)  # rows are sorted
        use_i2i = self._i2i_weights is not None and history is not None
        h_bounds = (torch.searchsorted(history[0], starts).tolist() if use_i2i and len(history[0])
                    else [0] * len(starts))
        vals = torch.empty((n_users, k), dtype=torch.float32, device=user.device)
        out_cols = torch.empty((n_users, k), dtype=torch.long, device=user.device)
        for b, lo in enumerate(range(0, n_users, block)):
            hi = min(lo + block, n_users)
            r, c = rows[bounds[b]:bounds[b + 1]] - lo, cols[bounds[b]:bounds[b + 1]]
            term = None
            if use_i2i:
                h_rows, h_index = history[0][h_bounds[b]:h_bounds[b + 1]], history[1][h_bounds[b]:h_bounds[b + 1]]
                term = self._item_to_item_scores(h_rows - lo, h_index, hi - lo)
            vals[lo:hi], out_cols[lo:hi] = self._select_block(user[lo:hi], r, c, k, term)
        return vals, out_cols

    def _item_to_item_scores(self, rows: torch.Tensor, index: torch.Tensor, n_rows: int) -> torch.Tensor:
        """[n_rows, W] weighted item-to-item scores of the weighted candidates, from the rows' known items."""
        assert self._i2i_weights is not None
        return user_scores(self._i2i_weights, rows, self._i2i_row_of_index[index], n_rows)

    def _tiles(self, rows: int) -> list:
        """(first column, end column, packed int8 items or None) of each item tile a row block is scored over."""
        if self._int8_tiles is not None:
            return self._int8_tiles
        num_c = self.num_candidates
        tile = self.tile_size(rows, self._cand_emb.element_size())
        return [(start, min(start + tile, num_c), None) for start in range(0, num_c, tile)]

    def _select_block(self, user: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, k: int,
                      term: torch.Tensor | None = None):
        """One row block: product, masking and exact top-k, over item tiles when the catalog is tiled.

        bf16/fp16 and int8 products preselect ``BF16_PRESELECT * k`` candidates, rescored in fp32 below.
        ``term``: [b, W] item-to-item scores of the weighted candidates (``_i2i_cols``), added before both."""
        low_precision = self._cand_emb.dtype != torch.float32 or self._int8_tiles is not None
        want = min(self.num_candidates, int(BF16_PRESELECT * k)) if low_precision else k
        u = user.to(self._cand_emb.dtype)
        num_c = self.num_candidates
        neg_inf = torch.tensor(float("-inf"), dtype=u.dtype, device=u.device)
        best_val: torch.Tensor | None = None
        best_col: torch.Tensor | None = None
        for start, stop, packed in self._tiles(len(user)):
            if packed is not None:
                scores = int8_kernels.linear(u, packed)                              # [b, T] fp32, int8 product
            else:
                scores = u @ self._cand_emb[start:stop].T                            # [b, T]
            if self._prior is not None:                                              # new items' popularity prior
                scores += self._prior[start:stop].to(scores.dtype)
            if term is not None:                                                     # item-to-item scores
                a, z = np.searchsorted(self._i2i_cols_np, [start, stop])
                if z > a:
                    scores.index_add_(1, self._i2i_cols[a:z] - start, term[:, a:z].to(scores.dtype))
            if len(cols):
                in_tile = (cols >= start) & (cols < stop) if stop - start < num_c else slice(None)
                scores.index_put_((rows[in_tile], cols[in_tile] - start), neg_inf)
            v, c = exact_topk(scores, min(want, stop - start), exact=not low_precision)  # [b, kt] x 2
            c = c + start
            if best_val is None:
                best_val, best_col = v, c
            else:                                                                    # running merge, same order
                merged_val, merged_col = torch.cat([best_val, v], 1), torch.cat([best_col, c], 1)
                best_val, best_col = _keyed_topk(merged_val, merged_col, min(want, merged_val.shape[1]))
        assert best_val is not None and best_col is not None
        if not low_precision:
            return best_val, best_col
        # rescore the preselected candidates in fp32; masked (-inf) slots stay masked
        rows32 = self._cand_emb32.index_select(0, best_col.reshape(-1)).view(*best_col.shape, -1)  # [b, want, D]
        # a broadcast multiply and sum, not bmm: a batch of [want, D] x [D] products is a thousand tiny
        # matrix-vector calls to the BLAS, several times slower (measured: docs/performance.md,
        # "Figures that lived in the code")
        exact = (rows32 * user[:, None, :]).sum(2)                              # [b, want]
        if self._prior is not None:
            exact += self._prior[best_col]
        if term is not None:
            pos = self._i2i_pos_of_col[best_col]                                    # [b, want] -1: no weights
            exact += torch.where(pos >= 0, term.gather(1, pos.clamp(min=0)), torch.zeros_like(exact))
        exact = torch.where(torch.isneginf(best_val), torch.full_like(exact, float("-inf")), exact)
        return _keyed_topk(exact, best_col, k)

    def _encode(self, seq: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None and INT8_ENCODER:
            return self.int8.encoder.encode(seq)
        return self.model.encode(seq)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _autocast(self):
        if self.dtype in ("bfloat16", "float16") and (self.device.type == "cuda" or ENCODE_BF16_ON_CPU):
            return torch.autocast(self.device.type, dtype=_DTYPES[self.dtype])
        return contextlib.nullcontext()


class ReferenceScorer(Scorer):
    """The core as it was before the fast paths, kept so ``recsys bench`` shows their speed-up on the
    same cores in the same run: every position of every history encoded (the model's full forward),
    one product against all candidates, seen items masked, ``torch.topk`` over the whole matrix, fp32.

    Its lists are the fast core's lists (the fp32 path is exact); only a tie at the N-th place may
    be broken differently, since torch.topk leaves the order of ties unspecified.
    """

    def __post_init__(self) -> None:
        if self.dtype != "float32":
            raise ValueError("the reference core runs in float32 only")
        super().__post_init__()

    def _encode(self, seq: torch.Tensor) -> torch.Tensor:
        forward = type(self.model).forward
        if forward is torch.nn.Module.forward:      # a model with encode() only
            return self.model.encode(seq)
        return self.model(seq)[:, -1]                                               # [B, L, D] -> [B, D]

    def _select(self, user: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, k: int,
                history: tuple[torch.Tensor, torch.Tensor] | None = None):
        scores = user @ self._cand_emb.T                                            # [B, C]
        if self._prior is not None:
            scores += self._prior
        if self._i2i_weights is not None and history is not None:
            scores[:, self._i2i_cols] += self._item_to_item_scores(history[0], history[1], len(user))
        if len(cols):
            scores.index_put_((rows, cols), torch.tensor(float("-inf"), device=scores.device))
        return torch.topk(scores, k, dim=1)


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
    """Most frequent candidate items first; score = share of events, so it reads like a probability.

    >>> fallback = popularity_fallback(np.array([10, 20, 30]), np.array([5, 9, 5]), 2)
    >>> fallback.item_ids.tolist(), [round(float(s), 3) for s in fallback.scores]
    ([20, 10], [0.474, 0.263])
    """
    item_ids = np.asarray(item_ids, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.float64)
    order = np.lexsort((item_ids, -counts))[:top_n]    # by count desc, then item id for determinism
    total = counts.sum() or 1.0
    return Fallback(SOURCE_POPULARITY, item_ids[order], (counts[order] / total).astype(np.float32))
