"""Items a user already knows, competing with items new to them: the repeat blend. Pure numpy/torch.

On a log where users come back (edits, purchases, plays), most of what a user does tomorrow is an item
they know: masking every known item caps a list's hit rate at the share of users who do something new.
On a log without repeats (ratings: each item once) a known item is never the next one, and masking is
right. The blend learns which of the two a log is, and the balance in between, from the log itself.

Each candidate gets a blended score on one log scale, and the list is the top N of both kinds merged:

- a known item ``i`` (in the user's history, available, known to the model):
  ``repeat_bias + log(count_i) - age_weight * log1p(age_days_i)`` — how often the user had it in the
  window and how long ago they last did;
- a new item at rank ``r`` (0 = best) of the model's ranking of the items the user does not know:
  ``-new_rank_weight * log1p(r)`` — the model orders the new items, the blend says what a rank is worth
  against a known item.

The model's ranking of new items may carry a recent-popularity prior: each new item's score plus
``popularity_weight * log1p(users)``, ``users`` the users who had the item on the day before the lists' day
(:func:`popularity_prior`). On a log where what is new to a user tomorrow is what many had today (edits of a
page in the news), that ranks new items better than the model alone; on another it ranks them worse, so the
weight is chosen with the others, 0 (no prior) among the choices.

It may also carry item-to-item scores (:mod:`recsys.model.item_to_item`, EASE fitted at training): each new item's
score plus ``item_to_item_weight`` times what the user's known items say for it. Chosen the same way, 0 among the
choices.

The five weights are chosen at training (:func:`fit_blend`) on held-out days: for each validation day,
the users active that day, their history before it, and what they did that day; the weights that give the
best NDCG@10 of those lists win (or the best HR@10, ties by NDCG@10: the job's ``train.repeats.objective``).
A log without repeats chooses ``repeat_bias = -inf``: known items are masked, and the lists are the model's
alone, exactly as without a blend.

Rank-based scores for new items, rather than the model's own, keep the blend free of the model's scale
and cheap: the model's top N of new items is what the core selects anyway, and the merge with a few known
items per user is a small top-N over ``[users, N + known]``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from recsys.model.item_to_item import ItemToItem
    from recsys.sequences import Sequences

SECONDS_PER_DAY = 86_400.0
NDCG_K = 10

# The grid :func:`fit_blend` searches. repeat_bias: the gate (-inf: mask); age_weight: how much an old
# interaction counts less; new_rank_weight: how fast a new item's worth falls with its rank. The popularity
# weights (how much the new items' recent popularity adds to the model's scores) are the job's setting,
# train.repeats.popularity_weights; without them, none (0).
REPEAT_BIASES = (-math.inf, *np.arange(-6.0, 10.01, 0.5).round(2).tolist())
AGE_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0)
NEW_RANK_WEIGHTS = (0.5, 1.0, 1.5, 2.0, 3.0)
NO_PRIOR = (0.0,)
# ranking validation rows: at most RANK_ROWS rows at once, fewer on a large catalog, so one [rows, items] fp32 score
# matrix stays within RANK_BYTES
RANK_BYTES = 256 * 2**20
RANK_ROWS = 512


def popularity_prior(users: np.ndarray) -> np.ndarray:
    """The recent-popularity prior of new items from the users who had each on the day before the lists' day:
    ``log1p(users)``, added to the model's scores times the blend's ``popularity_weight``. One definition for
    the fit's validation days and the night's lists, so what was chosen is what is applied.

    >>> popularity_prior(np.array([0, 1, 9])).round(3).tolist()
    [0.0, 0.693, 2.303]
    """
    return np.log1p(np.clip(np.asarray(users, dtype=np.float64), 0, None))


@dataclass(frozen=True)
class RepeatBlend:
    """How a user's known items compete with new ones (see the module docstring). Saved with the model."""

    repeat_bias: float = -math.inf
    age_weight: float = 0.0
    new_rank_weight: float = 1.0
    popularity_weight: float = 0.0   # 0: new items ranked by the model alone (and in every model saved before it)
    item_to_item_weight: float = 0.0   # 0: no item-to-item scores (and in every model saved before them)
    figures: dict = field(default_factory=dict, compare=False)   # what the fit measured (validation users, NDCG)

    @property
    def masks_known(self) -> bool:
        """True when known items never enter a list (a log without repeats, or no blend)."""
        return not math.isfinite(self.repeat_bias)

    def repeat_scores(self, counts: np.ndarray | torch.Tensor, age_days: np.ndarray | torch.Tensor):
        """Blended scores of known items from their counts (>= 1) and ages in days (>= 0).

        >>> RepeatBlend(2.0, 1.0, 1.0).repeat_scores(np.array([1, 4]), np.array([0.0, 6.0])).round(3).tolist()
        [2.0, 1.44]
        """
        lib = torch if isinstance(counts, torch.Tensor) else np
        counts = counts.float() if lib is torch else np.asarray(counts, dtype=np.float64)
        age = age_days.float() if lib is torch else np.asarray(age_days, dtype=np.float64)
        return self.repeat_bias + lib.log(lib.clip(counts, 1, None)) - self.age_weight * lib.log1p(lib.clip(age, 0, None))

    def new_scores(self, k: int, device: torch.device | None = None) -> torch.Tensor:
        """Blended scores of the new items at ranks 0..k-1: [k], decreasing.

        >>> [round(float(s), 3) for s in RepeatBlend(2.0, 1.0, 1.0).new_scores(3)]
        [-0.0, -0.693, -1.099]
        """
        ranks = torch.arange(k, dtype=torch.float32, device=device)
        return -self.new_rank_weight * torch.log1p(ranks)

    def to_json(self) -> str:
        data = asdict(self)
        data["repeat_bias"] = None if self.masks_known else self.repeat_bias
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RepeatBlend":
        data = json.loads(text)
        bias = data.get("repeat_bias")
        return cls(repeat_bias=-math.inf if bias is None else float(bias), age_weight=float(data.get("age_weight", 0.0)),
                   new_rank_weight=float(data.get("new_rank_weight", 1.0)),
                   popularity_weight=float(data.get("popularity_weight", 0.0)),
                   item_to_item_weight=float(data.get("item_to_item_weight", 0.0)),
                   figures=dict(data.get("figures") or {}))


MASK_KNOWN = RepeatBlend()


def merge_known(new_vals: torch.Tensor, new_cols: torch.Tensor, known_rows: torch.Tensor, known_cols: torch.Tensor,
                known_scores: torch.Tensor, k: int, *, max_known: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge each user's known items into their list of new items, best blended score first.

    ``new_vals`` [B, k'] are the blended scores of the new items by rank (-inf for an empty slot),
    ``new_cols`` [B, k'] their candidate columns; ``known_rows``/``known_cols``/``known_scores`` [S] the known
    items (row sorted ascending). ``max_known``: the most known items a list may hold (a rule keeping room for
    new ones); None: no limit. -> (scores [B, k], columns [B, k]), ties by column ascending.

    >>> new_vals, new_cols = torch.tensor([[0.0, -0.7, -1.1]]), torch.tensor([[5, 6, 7]])
    >>> vals, cols = merge_known(new_vals, new_cols, torch.tensor([0]), torch.tensor([2]), torch.tensor([-0.5]), 3)
    >>> cols.tolist()                                  # the known item 2 (-0.5) between the new 5 and 6
    [[5, 2, 6]]
    """
    n_users = new_vals.shape[0]
    dev = new_vals.device
    if len(known_rows) == 0:
        return new_vals[:, :k], new_cols[:, :k]
    per_user = torch.bincount(known_rows, minlength=n_users)                          # [B]
    width = int(per_user.max())
    starts = torch.cumsum(per_user, 0) - per_user                                     # [B]
    slot = torch.arange(len(known_rows), device=dev) - starts[known_rows]             # [S] place in the user's row
    vals = torch.full((n_users, width), float("-inf"), device=dev)
    cols = torch.zeros((n_users, width), dtype=torch.long, device=dev)
    vals[known_rows, slot] = known_scores.float()
    cols[known_rows, slot] = known_cols
    keep = min(width, k if max_known is None else max(0, min(k, max_known)))
    if keep < width:
        top = torch.topk(vals, keep, dim=1)
        vals, cols = top.values, torch.gather(cols, 1, top.indices)
    merged_vals = torch.cat([new_vals.float(), vals], 1)
    merged_cols = torch.cat([new_cols, cols], 1)
    # ties by column ascending, as the core orders its lists; -inf slots stay last
    key = torch.argsort(merged_cols, dim=1, stable=True)
    merged_vals, merged_cols = torch.gather(merged_vals, 1, key), torch.gather(merged_cols, 1, key)
    order = torch.argsort(merged_vals, dim=1, descending=True, stable=True)[:, :k]
    return torch.gather(merged_vals, 1, order), torch.gather(merged_cols, 1, order)


# ------------------------------------------------------------------------------------------------ the fit


@dataclass(frozen=True)
class BlendValidation:
    """Held-out days, model-ranked: what :func:`fit_blend` chooses the weights on.

    One row per (user, validation day): the user's known items before that day (their counts and ages in
    days), which of them the user had on that day (``known_target``), and the model's ranks (0 = best,
    among the items the user did not know) of the new items the user had on that day, once per ranking of new items:
    a popularity weight and an item-to-item weight (the model's scores plus the first times :func:`popularity_prior`
    and the second times the item-to-item scores).
    """

    known_counts: np.ndarray      # [S, K] float, 0 where padded
    known_ages: np.ndarray        # [S, K] float days
    known_target: np.ndarray      # [S, K] bool
    new_target_ranks: np.ndarray  # [P, S, T] float ranks of the day's new items under each ranking (weights
                                  # below); inf: padded or not rankable
    targets: np.ndarray           # [S] int: how many distinct items the user had that day (the NDCG's ideal)
    known_index: np.ndarray | None = None   # [S, K] the known items' model indices: equal blended scores rank by
                                            # it, as the core's lists do (by candidate column); None: history order
    popularity_weights: tuple[float, ...] = (0.0,)   # [P] the popularity weight of each ranking
    item_to_item_weights: tuple[float, ...] | None = None   # [P] the item-to-item weight of each; None: all 0

    def __post_init__(self) -> None:
        if self.new_target_ranks.ndim != 3 or len(self.new_target_ranks) != len(self.popularity_weights):
            raise ValueError(f"new_target_ranks has shape {self.new_target_ranks.shape}; expected one [S, T] slice "
                             f"per popularity weight {self.popularity_weights}")
        if self.item_to_item_weights is not None and len(self.item_to_item_weights) != len(self.popularity_weights):
            raise ValueError(f"{len(self.item_to_item_weights)} item-to-item weights for "
                             f"{len(self.popularity_weights)} rankings: one (popularity, item-to-item) pair per slice "
                             "of new_target_ranks")

    @property
    def rankings(self) -> tuple[tuple[float, float], ...]:
        """(popularity weight, item-to-item weight) of each slice of ``new_target_ranks``."""
        i2i = self.item_to_item_weights or (0.0,) * len(self.popularity_weights)
        return tuple((float(p), float(c)) for p, c in zip(self.popularity_weights, i2i))

    @property
    def samples(self) -> int:
        return len(self.targets)

    @classmethod
    def empty(cls) -> "BlendValidation":
        """No rows: the start of a sum over chunks."""
        none = np.zeros((0, 1))
        return cls(none, none, none.astype(bool), np.full((1, 0, 1), np.inf), np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class BlendSums:
    """What the validation rows add up to for each candidate blend: sums, so that rows ranked a chunk at a
    time (or by different processes) add up before the one division that chooses (:func:`choose_blend`)."""

    candidates: tuple[RepeatBlend, ...]   # the grid, in the order ties are broken (masking first)
    ndcg: np.ndarray                      # [G] sum of the rows' NDCG@10
    hits: np.ndarray                      # [G] rows with a hit in the top 10
    rows: int
    known_targets: int                    # the day's items the user knew, over all rows
    targets: int                          # every day's items, over all rows

    def add(self, other: "BlendSums") -> "BlendSums":
        if self.candidates != other.candidates:
            raise ValueError("blend sums over different grids cannot be added")
        return BlendSums(self.candidates, self.ndcg + other.ndcg, self.hits + other.hits, self.rows + other.rows,
                         self.known_targets + other.known_targets, self.targets + other.targets)


def blend_grid(biases=REPEAT_BIASES, age_weights=AGE_WEIGHTS, rank_weights=NEW_RANK_WEIGHTS,
               popularity_weights=NO_PRIOR, item_to_item_weights=NO_PRIOR) -> tuple[RepeatBlend, ...]:
    """The candidate blends, in the order ties go: without item-to-item scores first, then by their weight; within
    one, without the popularity prior first, then by its weight; within one, masking first (it does not depend on the
    age and rank weights: listed once)."""
    grid = []
    for c in item_to_item_weights:
        for p in popularity_weights:
            grid += ([RepeatBlend(popularity_weight=float(p), item_to_item_weight=float(c))]
                     if any(not math.isfinite(b) for b in biases) else [])
            grid += [RepeatBlend(float(b), float(a), float(w), float(p), float(c)) for a in age_weights for b in biases
                     if math.isfinite(b) for w in rank_weights]
    return tuple(grid)


def rankings_of(popularity_weights=NO_PRIOR, item_to_item_weights=NO_PRIOR) -> tuple[tuple[float, float], ...]:
    """Every (popularity weight, item-to-item weight) pair of the grid: the rankings of new items the validation
    rows are ranked under (:func:`rank_validation_days`)."""
    return tuple((float(p), float(c)) for c in item_to_item_weights for p in popularity_weights)


def blend_sums(valid: BlendValidation, candidates: tuple[RepeatBlend, ...]) -> BlendSums:
    """NDCG@10 and hit sums of every candidate over the rows of ``valid``.

    Exact for positions under 10 without building any list: a known item's place is the number of known
    items above it plus the number of new ranks whose score beats it; a new item's place is its rank plus
    the number of known items at or above its score.
    """
    ndcg = np.zeros(len(candidates))
    hits = np.zeros(len(candidates))
    if valid.samples:
        ideal = _ideal_dcg(valid.targets)
        present = valid.known_counts > 0
        log_counts = np.log(np.clip(valid.known_counts, 1, None))
        log_ages = np.log1p(np.clip(valid.known_ages, 0, None))
        # only a new item ranked under 10 can reach a top-10 place: each row's smallest ranks, as many columns as
        # the row with the most such items needs (exact; a day with dozens of new items costs no more)
        useful = int((valid.new_target_ranks < NDCG_K).sum(2).max(initial=0))
        new_ranks = np.sort(valid.new_target_ranks, axis=2)[:, :, :max(1, useful)]      # [P, S, T']
        slice_of = {pair: i for i, pair in enumerate(valid.rankings)}
        missing = sorted({_ranking(c) for c in candidates} - set(slice_of))
        if missing:
            raise ValueError(f"the validation rows were ranked under (popularity, item-to-item) weights "
                             f"{valid.rankings}, not {missing}: rank them under every weight of the grid")
        # candidates that differ only in repeat_bias and the new items' ranking share the known items' places: scored
        # together, one bias per slice, the new items' places once per ranking
        groups: dict[tuple[float, float], list[int]] = {}
        for g, blend in enumerate(candidates):
            groups.setdefault((0.0 if blend.masks_known else blend.age_weight, blend.new_rank_weight), []).append(g)
        ordered: dict[float, tuple[np.ndarray, np.ndarray]] = {}
        entries: dict[tuple[int, ...], _NewEntries] = {}
        position = {g: (slice_of[_ranking(c)], c.repeat_bias) for g, c in enumerate(candidates)}
        for (age_weight, rank_weight), members in groups.items():
            if age_weight not in ordered:
                base = np.where(present, log_counts - age_weight * log_ages, -np.inf)
                # the 10 best known items per row in this weight's order (ties as the core breaks them): the others
                # never reach a top-10 place
                order = (np.argsort(-base, axis=1, kind="stable") if valid.known_index is None else
                         np.lexsort((valid.known_index, -base), axis=1))[:, :NDCG_K]
                ordered[age_weight] = (np.take_along_axis(base, order, 1), np.take_along_axis(valid.known_target, order, 1))
            top_base, top_target = ordered[age_weight]
            biases = sorted({position[g][1] for g in members})
            slices = tuple(sorted({position[g][0] for g in members}))
            if slices not in entries:
                entries[slices] = _NewEntries.of(new_ranks[list(slices)])
            group_ndcg, group_hits = _score(top_base, top_target, np.array(biases), entries[slices], rank_weight,
                                            ideal)                                                  # [P', B] each
            slice_at = {s: i for i, s in enumerate(slices)}
            bias_at = {b: i for i, b in enumerate(biases)}
            p_at = [slice_at[position[g][0]] for g in members]
            b_at = [bias_at[position[g][1]] for g in members]
            ndcg[members] = group_ndcg[p_at, b_at]
            hits[members] = group_hits[p_at, b_at]
    return BlendSums(candidates, ndcg, hits, int(valid.samples), int(valid.known_target.sum()), int(valid.targets.sum()))


def _ranking(blend: RepeatBlend) -> tuple[float, float]:
    return float(blend.popularity_weight), float(blend.item_to_item_weight)


OBJECTIVES = ("ndcg_at_10", "hr_at_10")


def choose_blend(sums: BlendSums, objective: str = "ndcg_at_10") -> RepeatBlend:
    """The candidate with the best mean of ``objective`` (``ndcg_at_10``; or ``hr_at_10``, ties by NDCG@10; further
    ties: the earlier, no item-to-item scores, no prior and masking first), its figures attached: the chosen one's,
    masking's and the best without the popularity prior's (what the prior added) and without item-to-item scores.

    HR@10 counts a list that holds any of the day's items wherever it holds it; NDCG@10 also weighs where. On a log
    with repeats, NDCG@10 fills a list's first places with known items; HR@10 leaves more of them to new items when
    a known item's hit holds anyway further down (docs/quality.md, "The blend's objective")."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown blend objective {objective!r}; expected one of {OBJECTIVES}")
    if sums.rows == 0:
        return RepeatBlend(figures={"validation_rows": 0, "why": "no validation rows: known items masked"})
    mean_ndcg, mean_hr = sums.ndcg / sums.rows, sums.hits / sums.rows
    # (first, then) the figures compared, so a tie on the first goes to the second before the earlier candidate
    keys = (mean_ndcg, mean_ndcg) if objective == "ndcg_at_10" else (mean_hr, mean_ndcg)
    best = 0
    for g in range(1, len(sums.candidates)):
        if keys[0][g] > keys[0][best] + 1e-12 or (abs(keys[0][g] - keys[0][best]) <= 1e-12
                                                   and keys[1][g] > keys[1][best] + 1e-12):
            best = g
    masked = next((g for g, c in enumerate(sums.candidates) if c.masks_known and _ranking(c) == (0.0, 0.0)), None)
    no_prior = [g for g, c in enumerate(sums.candidates) if not c.popularity_weight]
    no_i2i = [g for g, c in enumerate(sums.candidates) if not c.item_to_item_weight]
    nan = float("nan")
    figures = {"validation_rows": sums.rows, "objective": objective,
               "ndcg_at_10": round(float(mean_ndcg[best]), 6),
               "hr_at_10": round(float(mean_hr[best]), 6),
               "masked_ndcg_at_10": nan if masked is None else round(float(mean_ndcg[masked]), 6),
               "masked_hr_at_10": nan if masked is None else round(float(mean_hr[masked]), 6),
               "no_prior_ndcg_at_10": round(float(mean_ndcg[no_prior].max()), 6) if no_prior else nan,
               "no_item_to_item_ndcg_at_10": round(float(mean_ndcg[no_i2i].max()), 6) if no_i2i else nan,
               "known_target_share": round(sums.known_targets / max(1, sums.targets), 6)}
    return replace(sums.candidates[best], figures=figures)


def fit_blend(valid: BlendValidation, *, biases=REPEAT_BIASES, age_weights=AGE_WEIGHTS,
              rank_weights=NEW_RANK_WEIGHTS, popularity_weights: tuple[float, ...] | None = None,
              item_to_item_weights: tuple[float, ...] | None = None, objective: str = "ndcg_at_10") -> RepeatBlend:
    """The weights with the best ``objective`` over the validation rows (ties: the more cautious, masking first):
    :func:`blend_sums` over the grid, then :func:`choose_blend`. ``popularity_weights``, ``item_to_item_weights``:
    None, the ones the rows were ranked under."""
    ranked_p = tuple(dict.fromkeys(p for p, _ in valid.rankings))
    ranked_c = tuple(dict.fromkeys(c for _, c in valid.rankings))
    grid = blend_grid(biases, age_weights, rank_weights, ranked_p if popularity_weights is None else popularity_weights,
                      ranked_c if item_to_item_weights is None else item_to_item_weights)
    return choose_blend(blend_sums(valid, grid), objective)


def _ideal_dcg(targets: np.ndarray) -> np.ndarray:
    discounts = 1.0 / np.log2(np.arange(NDCG_K) + 2.0)
    cumulative = np.concatenate([[0.0], np.cumsum(discounts)])
    return cumulative[np.clip(targets, 0, NDCG_K)]


@dataclass(frozen=True)
class _NewEntries:
    """The new items ranked under 10 (the only ones that can reach a top-10 place) of P rankings, one entry each,
    grouped by (ranking, row) with the best rank first: what :func:`_score` places among the known items."""

    ranking: np.ndarray     # [E] the ranking's slice
    row: np.ndarray         # [E]
    rank: np.ndarray        # [E] int, under NDCG_K
    starts: np.ndarray      # [Q] the first entry of each (ranking, row) pair
    rankings: int           # P

    @classmethod
    def of(cls, new_ranks: np.ndarray) -> "_NewEntries":
        """From ``new_ranks`` [P, S, T], each row's ranks ascending along T."""
        ranking, row, col = np.nonzero(new_ranks < NDCG_K)          # (ranking, row) pairs contiguous, rank ascending
        rank = new_ranks[ranking, row, col].astype(np.int64)
        return cls(ranking, row, rank, _run_starts(ranking, row), len(new_ranks))


def _run_starts(*keys: np.ndarray) -> np.ndarray:
    """Where each run of equal ``keys`` (equal in every one of them, runs contiguous) starts: the offsets
    ``np.add.reduceat`` sums them by."""
    if not len(keys[0]):
        return np.zeros(0, np.int64)
    change = np.zeros(len(keys[0]) - 1, bool)
    for key in keys:
        change |= key[1:] != key[:-1]
    return np.flatnonzero(np.r_[True, change])


def _score(top_base: np.ndarray, top_target: np.ndarray, biases: np.ndarray, new: _NewEntries, rank_weight: float,
           ideal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([P, B] sums of NDCG@10, [P, B] rows with a hit) of the merged lists under B repeat biases and P rankings of
    new items. ``top_base`` [S, K]: each row's best known items' scores without the bias, descending along K (-inf:
    padding), ``top_target`` [S, K] which of them the user had that day; ``new``: the new items ranked under 10.

    One comparison decides both orders: a new item at rank ``r`` (score ``-w log1p(r)``) is above a known item
    with blended score ``s`` when ``-w log1p(r) > s``, else below it. So a known item's place is its column plus
    the ranks that beat it (``beaten``), and a new item's is its rank plus the known items with ``beaten <= r``.
    Only what can change a row's figures is computed: the known items the user had that day, and the rows with a
    new item ranked under 10; every other row adds its known items' figures as they are. Places are integers
    under ``2 * NDCG_K``, so each one's gain is looked up (0 from place 10 on)."""
    n_rows, n_known = top_base.shape
    n_biases = len(biases)
    # ranks' scores ascending once negated: beaten = #{r : -w log1p(r) > s} is a sorted search of -s
    negated_rank_score = rank_weight * np.log1p(np.arange(NDCG_K))
    scale = np.where(ideal > 0, ideal, 1.0)

    # the known items the user had that day: their places and gains, summed per row (rows in order, columns too)
    t_row, t_col = np.nonzero(top_target)
    t_starts = _run_starts(t_row)
    known_gain = np.zeros((n_biases, n_rows))
    known_hit = np.zeros((n_biases, n_rows), dtype=bool)
    if len(t_row):
        t_place = t_col + np.searchsorted(negated_rank_score, -(top_base[t_row, t_col][None] + biases[:, None]))
        known_gain[:, t_row[t_starts]] = np.add.reduceat(_GAIN[t_place], t_starts, axis=1)
        # places grow along K (columns descend in score): the row's first target holds its best place
        known_hit[:, t_row[t_starts]] = t_place[:, t_starts] < NDCG_K
    known_ndcg = np.where(ideal > 0, known_gain / scale, 0.0)                    # [B, S] the rows' known items alone
    ndcg = np.broadcast_to(known_ndcg.sum(-1), (new.rankings, n_biases)).copy()  # [P, B]
    hits = np.broadcast_to(known_hit.sum(-1).astype(np.float64), (new.rankings, n_biases)).copy()
    if not len(new.row):
        return ndcg, hits

    # rows with a new item under 10: how many known items sit at or above each rank r (beaten <= r), per bias
    rows, at = np.unique(new.row, return_inverse=True)
    beaten = np.searchsorted(negated_rank_score, -(top_base[rows][None] + biases[:, None, None]))   # [B, U, K]
    cells = np.arange(n_biases * len(rows))[:, None] * (NDCG_K + 1) + beaten.reshape(-1, n_known)
    above_rank = np.cumsum(np.bincount(cells.ravel(), minlength=n_biases * len(rows) * (NDCG_K + 1))
                           .reshape(n_biases, len(rows), NDCG_K + 1), axis=2)                       # [B, U, 11]
    new_place = new.rank + above_rank[:, at, new.rank]                                              # [B, E]
    new_gain = np.add.reduceat(_GAIN[new_place], new.starts, axis=1)                               # [B, Q]
    pair_row, pair_ranking = new.row[new.starts], new.ranking[new.starts]
    # a pair's row with its new items in place of its known items alone, per ranking
    with_new = np.where(ideal[pair_row] > 0, (known_gain[:, pair_row] + new_gain) / scale[pair_row], 0.0)
    # ranks ascend within a pair and places with them: its first new item holds its best place
    hit_added = (new_place[:, new.starts] < NDCG_K) & ~known_hit[:, pair_row]
    ndcg += _sum_by(with_new - known_ndcg[:, pair_row], pair_ranking, new.rankings)
    hits += _sum_by(hit_added.astype(np.float64), pair_ranking, new.rankings)
    return ndcg, hits


def _sum_by(values: np.ndarray, group: np.ndarray, groups: int) -> np.ndarray:
    """[groups, B]: ``values`` [B, Q] summed over the columns of each group."""
    return (values @ (group[:, None] == np.arange(groups))).T


# the NDCG gain of each list place under 2 * NDCG_K + 1 (0 from NDCG_K on: not in the top 10)
_GAIN = np.where(np.arange(2 * NDCG_K + 1) < NDCG_K, 1.0 / np.log2(np.arange(2 * NDCG_K + 1) + 2.0), 0.0)


# ------------------------------------------------------------------------------------------------ validation rows


@dataclass(frozen=True)
class ValidationDays:
    """Held-out days as collected from the events (id space, model-independent): one row per (user, day)."""

    histories: "Sequences"       # item ids before the day, oldest first
    counts: np.ndarray           # [H] aligned with histories.items: events with the item before the day
    last_us: np.ndarray          # [H] aligned: the latest of them, epoch microseconds
    day_start_us: np.ndarray     # [S] the day's first instant, epoch microseconds
    targets: "Sequences"         # the distinct items the user had that day

    @property
    def rows(self) -> int:
        return len(self.day_start_us)


@dataclass(frozen=True)
class RecentUsers:
    """How many users had each item on each day: the popularity prior's counts on the days before the validation
    days, over every user of the log (the validation rows are a sample). One entry per (day, item) with users."""

    day_us: np.ndarray     # [R] int64 the day's first instant, epoch microseconds
    item_ids: np.ndarray   # [R] int64
    users: np.ndarray      # [R] int64 distinct users with the item that day

    def prior_by_day(self, day_starts_us: np.ndarray, vocab) -> np.ndarray:
        """[D, N + 1] :func:`popularity_prior` of each model index (column 0: padding, 0) on the day before each
        of the days ``day_starts_us`` [D]: what a night's lists for that day would add."""
        out = np.zeros((len(day_starts_us), len(vocab) + 1))
        before = np.asarray(day_starts_us, dtype=np.int64) - int(SECONDS_PER_DAY * 1e6)
        for d, start in enumerate(before):
            on_day = self.day_us == start
            index = vocab.index_of(self.item_ids[on_day])
            known = index > 0
            out[d, index[known]] = popularity_prior(self.users[on_day][known])
        return out


def rank_validation_days(model: torch.nn.Module, item_ids: np.ndarray, days: ValidationDays, *,
                         recent: RecentUsers | None = None, popularity_weights=NO_PRIOR,
                         item_to_item: "ItemToItem | None" = None, item_to_item_weights=NO_PRIOR) -> BlendValidation:
    """The model's ranks of each day's new items, and the known items' counts and ages: what the fit needs.

    A known item is one in the history that the model knows (only those can be listed); a new target's rank
    counts the items scored higher among those the user does not know (0 = best), once per pair of a popularity
    weight and an item-to-item weight (:func:`rankings_of`): the model's score plus the first times the day's prior
    from ``recent`` (None: no prior) plus the second times the scores of ``item_to_item`` (fitted on what the model
    trained on, not on the rows' own items; None: none). A target the model does not know cannot be ranked (inf),
    but still counts in the day's ideal. Ranked on the model's device.
    """
    from recsys.sequences import Vocabulary

    vocab = Vocabulary(item_ids)
    histories, _ = vocab.map_sequences(days.histories)                    # model indices, unknown dropped
    known_mask = vocab.index_of(days.histories.items) > 0
    counts, last_us = days.counts[known_mask], days.last_us[known_mask]
    row_of = np.repeat(np.arange(days.rows), days.histories.lengths)[known_mask]
    width = max(1, int(histories.lengths.max(initial=0)))
    place = np.arange(len(histories.items)) - histories.offsets[row_of]
    known_counts = np.zeros((days.rows, width))
    known_ages = np.zeros((days.rows, width))
    known_counts[row_of, place] = counts
    known_ages[row_of, place] = (days.day_start_us[row_of] - last_us) / (SECONDS_PER_DAY * 1e6)
    target_idx = vocab.index_of(days.targets.items)
    target_row = np.repeat(np.arange(days.rows), days.targets.lengths)
    known_target = np.zeros((days.rows, width), dtype=bool)
    known_index = np.zeros((days.rows, width), dtype=np.int64)
    known_index[row_of, place] = histories.items
    # a day's targets against the row's known items: (row, model index) pairs of both, matched at once
    pair_known = row_of * (len(vocab) + 1) + histories.items
    pair_target = target_row * (len(vocab) + 1) + target_idx
    is_known_target = np.isin(pair_target, pair_known) & (target_idx > 0)
    known_target[row_of, place] = np.isin(pair_known, pair_target)
    new_at = np.flatnonzero(~is_known_target)
    new_counts = np.bincount(target_row[new_at], minlength=days.rows)
    new_width = max(1, int(new_counts.max(initial=0)))
    rankings = rankings_of(popularity_weights, item_to_item_weights)
    new_ranks = np.full((len(rankings), days.rows, new_width), np.inf)
    new_place = np.arange(len(new_at)) - (np.cumsum(new_counts) - new_counts)[target_row[new_at]]
    # what each ranking adds to the model's scores; without the prior or item-to-item scores, nothing: a weight then
    # ranks as the model alone (and identical rankings are ranked once)
    effective = tuple((p if recent is not None else 0.0, c if item_to_item is not None else 0.0) for p, c in rankings)
    distinct = tuple(dict.fromkeys(effective))
    prior = None
    if recent is not None and any(p for p, _ in distinct):
        day_starts, day_of_row = np.unique(days.day_start_us, return_inverse=True)
        prior = (recent.prior_by_day(day_starts, vocab), day_of_row)
    i2i = None
    if item_to_item is not None and any(c for _, c in distinct):
        i2i = _item_to_item_on(vocab, item_to_item)
    ranked = _new_target_ranks(model, histories, target_row[new_at], target_idx[new_at], rankings=distinct,
                               prior=prior, item_to_item=i2i)
    new_ranks[:, target_row[new_at], new_place] = ranked[[distinct.index(e) for e in effective]]
    return BlendValidation(known_counts, known_ages, known_target, new_ranks, days.targets.lengths.astype(np.int64),
                           known_index, tuple(p for p, _ in rankings), tuple(c for _, c in rankings))


def _item_to_item_on(vocab, item_to_item: "ItemToItem") -> tuple[np.ndarray, np.ndarray]:
    """The item-to-item weights among the items the model knows, and their model indices: ([V', V'], [V'])."""
    known, index = item_to_item.known_to(vocab)
    return item_to_item.weights[np.ix_(known, known)], index


def _new_target_ranks(model: torch.nn.Module, histories: "Sequences", rows_all: np.ndarray, targets: np.ndarray, *,
                      rankings: tuple[tuple[float, float], ...] = ((0.0, 0.0),),
                      prior: tuple[np.ndarray, np.ndarray] | None = None,
                      item_to_item: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """For each ranking (popularity weight, item-to-item weight) and each new target (its row, its model index): items
    scored above it among those its user does not know (inf: the model does not know the target, or the user has no
    known item to be encoded) -> [P, targets]. ``prior``: ([D, N + 1] each day's prior, [rows] each row's day);
    ``item_to_item``: ([V', V'] weights, [V'] their model indices); None: none (its weights add nothing)."""
    from recsys.model.item_to_item import user_scores
    from recsys.sequences import pad_left

    out = np.full((len(rankings), len(rows_all)), np.inf)
    usable = (targets > 0) & (histories.lengths[rows_all] > 0)
    model = model.eval()
    device = next(model.parameters()).device
    with torch.inference_mode():
        items = model.item_embeddings().detach().to(device).float()           # [N + 1, D]
        day_prior = None if prior is None else torch.as_tensor(prior[0], dtype=torch.float32, device=device)
        if item_to_item is not None:
            i2i_weights = torch.as_tensor(item_to_item[0], dtype=torch.float32, device=device)     # [V', V']
            i2i_index = torch.as_tensor(item_to_item[1], dtype=torch.long, device=device)         # [V']
            i2i_row = torch.full((len(items),), -1, dtype=torch.long, device=device)              # index -> row
            i2i_row[i2i_index] = torch.arange(len(i2i_index), device=device)
        # a [rows, N + 1] score matrix (and, with the prior, its rows' priors and their sum) kept near RANK_BYTES
        batch = max(1, min(RANK_ROWS, RANK_BYTES // (4 * len(items))))
        for lo in range(0, histories.__len__(), batch):
            rows = np.arange(lo, min(lo + batch, len(histories)))
            pick = np.flatnonzero(usable & (rows_all >= lo) & (rows_all < rows[-1] + 1))
            if not len(pick):
                continue
            part = histories.take(rows)
            seq = torch.from_numpy(pad_left(part, model.max_len)).to(device)          # [b, L]
            scores = model.encode(seq).float() @ items.T                              # [b, N + 1]
            scores[:, 0] = float("-inf")                                              # padding never competes
            known = torch.from_numpy(pad_left(part, max(1, int(part.lengths.max(initial=0))))).to(device)
            scores.scatter_(1, known, float("-inf"))                                  # the user's known items
            scores[:, 0] = float("-inf")
            local = torch.as_tensor(rows_all[pick] - lo, device=device)
            target = torch.as_tensor(targets[pick], device=device)
            row_prior = (None if day_prior is None else
                         day_prior[torch.as_tensor(prior[1][rows], device=device)])   # [b, N + 1] each row's day's
            row_i2i = None
            if item_to_item is not None:                                              # [b, N + 1] the user's items say
                flat = torch.from_numpy(np.asarray(part.items, dtype=np.int64)).to(device)
                owner = torch.repeat_interleave(torch.arange(len(rows), device=device),
                                                torch.from_numpy(np.asarray(part.lengths, dtype=np.int64)).to(device))
                row_i2i = torch.zeros_like(scores)
                row_i2i[:, i2i_index] = user_scores(i2i_weights, owner, i2i_row[flat], len(rows))
            # each target's row of each addend, taken once (at most a batch of targets at a time, so the copies
            # stay within the batch's own size): the rankings below add them up for these rows only
            for t_lo in range(0, len(local), batch):
                at = slice(t_lo, t_lo + batch)
                own_scores = scores[local[at]]                                        # [t, N + 1]
                own_prior = None if row_prior is None else row_prior[local[at]]
                own_i2i = None if row_i2i is None else row_i2i[local[at]]
                at_target = torch.arange(len(own_scores), device=device)
                for p, (weight, i2i_weight) in enumerate(rankings):
                    ranked = (own_scores if own_prior is None or not weight else
                              torch.add(own_scores, own_prior, alpha=weight))
                    if own_i2i is not None and i2i_weight:
                        ranked = torch.add(ranked, own_i2i, alpha=i2i_weight)
                    own = ranked[at_target, target[at]]                               # [t]
                    above = (ranked > own[:, None]).sum(1)                            # [t]
                    out[p, pick[at]] = above.cpu().numpy().astype(np.float64)
    return out
