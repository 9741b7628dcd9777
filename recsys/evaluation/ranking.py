"""Ranking a phase's catalog for every evaluated user, the same way for every model.

A model enters evaluation as a :class:`RankingScorer`: scores for a batch of evaluated users over the
phase's candidates (column 0 is padding, column ``c`` is ``phase.candidates[c - 1]``). Everything
after that — excluding each user's history, the rank of every target, the top-k lists, the
per-user metrics — is this module's, built on :func:`recsys.model.metrics.target_ranks`, so
popularity, ALS and the neural models are measured by one implementation.

Conventions (those of ``target_ranks``): ties count against the target; a NaN target is a miss and
a NaN competitor counts as above it; a target the model cannot score (not in its vocabulary, or
not an available candidate) is a miss. Items a model cannot score get ``-inf`` and never compete.
"""
from __future__ import annotations

import warnings

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from recsys.evaluation.protocols import Phase
from recsys.model.metrics import SELECTION_METRIC, target_ranks, user_metrics
from recsys.sequences import Sequences, Vocabulary, pad_left

VALID_SELECTION = f"valid_{SELECTION_METRIC}"   # a model's figure on the validation phase, in details and notes
PAIR_BUDGET = 2_000_000     # (target x candidate) cells ranked at once: bounds memory, not results


class RankingScorer(Protocol):
    """A model as evaluation sees it."""

    def scores(self, rows: np.ndarray) -> torch.Tensor:
        """[b, C + 1] float32 scores for the evaluated users ``rows`` (indices into the split's users)
        over the phase's candidates; column 0 is padding; ``-inf`` marks items the model cannot score."""
        ...


@dataclass(frozen=True)
class PhaseResult:
    """Per evaluated user: metric values (for means and bootstrap) and the top-k list."""

    per_user: dict[str, np.ndarray]   # "ndcg@10" -> [E]
    top: np.ndarray                   # [E, max k] candidate indices (1-based), best first; 0: no item
    per_seed: dict[str, np.ndarray] | None = None   # "ndcg@10" -> [S, E]: one row per training seed (S >= 2)

    def means(self) -> dict[str, float]:
        return {name: float(values.mean()) for name, values in self.per_user.items()}

    @property
    def seeds(self) -> int:
        return 1 if not self.per_seed else len(next(iter(self.per_seed.values())))

    def seed_means(self, metric: str) -> list[float]:
        """The metric's mean over users for each training seed (one value without seeds)."""
        rows = self.per_seed[metric] if self.per_seed else self.per_user[metric][None, :]
        return [float(np.nanmean(row)) for row in rows]


def merge_seeds(results: list[PhaseResult]) -> PhaseResult:
    """One model trained with several seeds, ranked on one phase -> one result: each user's value is
    the mean over seeds (what the table shows), and the per-seed values are kept so the bootstrap can
    resample seeds as well as users. The top lists (coverage) are the first seed's."""
    if len(results) == 1:
        return results[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)      # a user with no list has NaN pop_pct in every seed
        per_seed = {m: np.stack([r.per_user[m] for r in results]) for m in results[0].per_user}
        return PhaseResult({m: np.nanmean(v, axis=0) for m, v in per_seed.items()}, results[0].top, per_seed)


def candidate_index(phase: Phase, item_ids: np.ndarray) -> np.ndarray:
    """1-based candidate index of each external id, 0 for items that are not candidates."""
    return Vocabulary(phase.candidates).index_of(np.asarray(item_ids, dtype=np.int64))


def item_popularity_percentile(phase: Phase) -> np.ndarray:
    """[C + 1] each candidate's popularity percentile in the phase's history (100: the most popular).

    The share of candidates with at most as many interactions, so ties share the higher value.
    """
    counts = interaction_counts(phase)[1:]
    order = np.sort(counts)
    pct = np.searchsorted(order, counts, side="right") / max(1, len(counts)) * 100.0
    return np.concatenate([[0.0], pct])


def interaction_counts(phase: Phase) -> np.ndarray:
    """[C + 1] number of users with each candidate in their phase history (column 0: 0)."""
    index = candidate_index(phase, phase.history.items)
    return np.bincount(index[index > 0], minlength=len(phase.candidates) + 1).astype(np.float64)


def rank_phase(scorer: RankingScorer, phase: Phase, ks: Sequence[int], *, batch_users: int = 256,
               device: str | torch.device = "cpu") -> PhaseResult:
    """Score every evaluated user, rank their targets and take their top ``max(ks)``."""
    ks = sorted(set(int(k) for k in ks))
    top_k = min(ks[-1], len(phase.candidates))
    popularity_pct = torch.from_numpy(item_popularity_percentile(phase))
    history = phase.history.take(phase.rows)
    exclude_all = _map(history, phase)
    target_all = _map(phase.targets, phase)
    ranks, tops = [], []
    for start in range(0, phase.users, batch_users):
        batch = np.arange(start, min(start + batch_users, phase.users))
        scores = scorer.scores(phase.rows[batch]).to(device=device, dtype=torch.float32)     # [b, C+1]
        if scores.shape != (len(batch), len(phase.candidates) + 1):
            raise ValueError(f"a scorer returned shape {tuple(scores.shape)}, expected "
                             f"({len(batch)}, {len(phase.candidates) + 1})")
        exclude = exclude_all.take(batch)
        exclude_t = torch.from_numpy(pad_left(exclude, max(1, int(exclude.lengths.max(initial=0))))).to(device)
        ranks.append(_target_ranks(scores, exclude_t, target_all.take(batch), device))
        tops.append(_top(scores, exclude_t, top_k))
    all_ranks = torch.cat(ranks)
    per_user = user_metrics(all_ranks, phase.targets.offsets, ks)
    top = torch.cat(tops).numpy()
    if top.shape[1] < ks[-1]:
        top = np.pad(top, ((0, 0), (0, ks[-1] - top.shape[1])))
    for k in ks:
        chosen = top[:, :k]
        pct = popularity_pct[torch.from_numpy(chosen)].numpy()
        filled = (chosen > 0).sum(axis=1)
        per_user[f"pop_pct@{k}"] = np.where(filled > 0, (pct * (chosen > 0)).sum(axis=1) / np.maximum(filled, 1), np.nan)
    return PhaseResult(per_user, top)


def coverage(top: np.ndarray, k: int, candidates: int) -> float:
    """Share of the candidates that appear in at least one user's top ``k``."""
    chosen = np.unique(top[:, :k])
    return float(np.count_nonzero(chosen) / max(1, candidates))


def _map(seqs: Sequences, phase: Phase) -> Sequences:
    """External ids -> candidate indices, non-candidates kept as 0 (a 0 target is a miss; a 0 exclusion is padding)."""
    return Sequences(seqs.offsets, candidate_index(phase, seqs.items))


def _target_ranks(scores: torch.Tensor, exclude: torch.Tensor, targets: Sequences,
                  device: str | torch.device) -> torch.Tensor:
    """[T] rank of every target of the batch's users, user after user, through ``target_ranks``.

    Each (user, target) pair is a row of ``target_ranks`` with the user's scores and exclusions, so
    a user's other targets compete with it: its rank is its position in the user's list.
    """
    owner = torch.from_numpy(np.repeat(np.arange(len(targets)), targets.lengths)).to(device)   # [T]
    items = torch.from_numpy(targets.items).to(device)                                          # [T]
    step = max(1, PAIR_BUDGET // scores.shape[1])
    out = []
    for start in range(0, len(items), step):
        rows = owner[start:start + step]
        out.append(target_ranks(scores[rows], items[start:start + step], exclude[rows]).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def _top(scores: torch.Tensor, exclude: torch.Tensor, k: int) -> torch.Tensor:
    """[b, k] candidate indices of the best non-excluded, scorable items (0 where fewer exist)."""
    masked = torch.nan_to_num(scores, nan=-torch.inf, posinf=torch.finfo(scores.dtype).max)
    masked[:, 0] = -torch.inf
    masked.scatter_(1, exclude, -torch.inf)                   # padding 0 in exclude hits column 0 again
    values, index = masked.topk(k, dim=1)
    return torch.where(torch.isfinite(values), index, torch.zeros_like(index)).cpu()


# --------------------------------------------------------------------------------------------
# Scorers shared by the models: constant scores, and dot products of user and item vectors.


class ConstantScorer:
    """The same scores for every user (popularity)."""

    def __init__(self, scores: np.ndarray):
        self._scores = torch.as_tensor(scores, dtype=torch.float32)[None, :]   # [1, C+1]

    def scores(self, rows: np.ndarray) -> torch.Tensor:
        return self._scores.expand(len(rows), -1).clone()


class FactorScorer:
    """Scores = user vector . item vector, with the model's item ids mapped onto the candidates.

    ``user_vectors(rows) -> [b, D]``; ``item_vectors`` [num_items, D] for the model's items
    ``item_ids`` (its own order). Candidates the model does not know score ``-inf``.
    """

    def __init__(self, phase: Phase, item_ids: np.ndarray, item_vectors: torch.Tensor, user_vectors):
        position = Vocabulary(np.asarray(item_ids, dtype=np.int64)).index_of(phase.candidates)   # [C], 0: unknown
        vectors = item_vectors.detach().float()
        table = torch.cat([torch.zeros(1, vectors.shape[1], dtype=vectors.dtype, device=vectors.device), vectors])
        self._items = table[torch.from_numpy(position).to(vectors.device)]                      # [C, D]
        self._unknown = torch.from_numpy(np.concatenate([[True], position == 0]))               # [C+1]
        self._user_vectors = user_vectors

    def scores(self, rows: np.ndarray) -> torch.Tensor:
        users = self._user_vectors(rows).float()                                                 # [b, D]
        scores = torch.cat([torch.zeros(len(rows), 1, device=users.device),
                            users @ self._items.T.to(users.device)], dim=1)                      # [b, C+1]
        return scores.masked_fill(self._unknown.to(scores.device)[None, :], -torch.inf)


class SequenceModelScorer(FactorScorer):
    """A :class:`~recsys.model.base.SequenceRecommender`: it reads each user's phase history at scoring
    time, as the nightly job does, so it needs no refit to use interactions newer than its training."""

    @torch.no_grad()
    def __init__(self, model, item_ids: np.ndarray, phase: Phase, device: str | torch.device = "cpu"):
        model = model.to(device).eval()
        mapped, _ = Vocabulary(np.asarray(item_ids, dtype=np.int64)).map_sequences(phase.history)

        @torch.no_grad()
        def user_vectors(rows: np.ndarray) -> torch.Tensor:
            seq = torch.from_numpy(pad_left(mapped.take(rows), model.max_len)).to(device)        # [b, L]
            return model.encode(seq)                                                             # [b, D]

        super().__init__(phase, item_ids, model.item_embeddings()[1:], user_vectors)


class CoreScorer:
    """A sequence model ranked by the nightly job's scoring core (``recsys.scoring.core.Scorer``) at a
    given dtype. Its top-N lists become scores (higher for earlier places, ``-inf`` for everything
    not listed), so the metrics at cut-offs up to N measure exactly the lists the job would publish:
    how ``recsys evaluate`` shows that ``scoring.dtype=bfloat16`` does not move quality.

    Users with no history item the model knows get no list here (the job would give them its
    fallback): their targets are misses.
    """

    def __init__(self, model, item_ids: np.ndarray, phase: Phase, top_n: int, dtype: str,
                 device: str | torch.device = "cpu"):
        from recsys.scoring.core import Candidates, Fallback
        from recsys.scoring.core import Scorer as CoreTopN

        vocab = Vocabulary(np.asarray(item_ids, dtype=np.int64))
        index = vocab.index_of(phase.candidates)                                 # [C] model index, 0: unknown
        known = index > 0
        order = np.argsort(index[known])
        self._scorer = CoreTopN(model=model.eval(), vocab=vocab,
                                candidates=Candidates(index[known][order], phase.candidates[known][order]),
                                fallback=Fallback("none", np.zeros(0, np.int64), np.zeros(0, np.float32)),
                                top_n=top_n, device=torch.device(device), dtype=dtype)
        self._phase = phase

    def scores(self, rows: np.ndarray) -> torch.Tensor:
        ids, vals, fallback, _ = self._scorer.topn(self._phase.history.take(np.asarray(rows)))   # [b, k]
        cols = candidate_index(self._phase, ids.reshape(-1)).reshape(ids.shape)                 # [b, k] 1-based
        listed = np.isfinite(vals) & ~fallback[:, None] & (cols > 0)
        out = torch.full((len(rows), len(self._phase.candidates) + 1), -torch.inf)
        r, c = np.nonzero(listed)
        out[torch.from_numpy(r), torch.from_numpy(cols[r, c])] = torch.from_numpy((ids.shape[1] - c).astype(np.float32))
        return out
