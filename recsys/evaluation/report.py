"""The comparison table: per-model means with 95% bootstrap intervals over users, and the paired
difference of every model to a reference (Spark ALS), as text, as JSON and as MLflow figures.

Why intervals: with a few hundred test users a ratio of two NDCGs moves by tens of percent from
one sample of users to another. Resampling *users* (with replacement, seeded) and recomputing each
mean gives the interval; resampling the same users for two models gives the interval of their
*paired* difference, which is much tighter than comparing two separate intervals because both
models face the same hard and easy users.

A model trained with several seeds (``recsys evaluate --seeds N``) varies from one training to
the next too. Its per-user values are averaged over the seeds, and each resample also draws N
seeds with replacement (a two-level bootstrap), so its interval holds the seed variance as well as
the user sampling: a difference outside it is not a lucky initialisation.

A backtest (``recsys backtest``) measures the same users on several nights: its figures are means over
(user, night) pairs, and both users and nights are samples. :class:`TwoWayDraws` resamples users and
nights at once (each pair weighted by how often its user and its night were drawn), so an interval
holds the variation between nights as well as between users.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from recsys.evaluation.ranking import PhaseResult, coverage

MEAN_METRICS = ("ndcg", "hr", "recall", "mrr", "pop_pct")     # per-user values, averaged: bootstrapped
# Catalog coverage is a property of all users' lists together (the size of their union), not a mean:
# a resample with replacement holds only ~63% distinct users, so its coverage is biased low and the
# percentile interval would not even contain the estimate. Coverage is reported without an interval.
LIST_METRICS = ("coverage",)


def metric_names(ks: Sequence[int]) -> list[str]:
    """Column order of the table: for each k, NDCG, HR, recall, MRR, coverage, popularity percentile."""
    return [f"{m}@{k}" for k in ks for m in ("ndcg", "hr", "recall", "mrr", "coverage", "pop_pct")]


@dataclass
class Comparison:
    """Everything the table shows. ``models`` keeps insertion order (the table's row order)."""

    protocol: str
    ks: list[int]
    users: int
    models: dict[str, dict[str, float]] = field(default_factory=dict)              # model -> metric -> mean
    intervals: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    reference: str | None = None
    differences: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)  # (diff, lo, hi)
    ratios: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)       # ndcg@k ratio
    pair_differences: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)  # "a - b"
    default_model: str | None = None
    notes: dict[str, str] = field(default_factory=dict)                              # model -> short remark

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document: ``{"protocol", "k", "models": {name: {metric: value}}}`` (+ the default's name)."""
        return {"protocol": self.protocol, "k": list(self.ks),
                "models": {name: {m: plain(v) for m, v in values.items()} for name, values in self.models.items()},
                "default_model": self.default_model}

    def to_full_json(self) -> dict[str, Any]:
        """Everything, for the MLflow artifact: intervals, differences and ratios too."""
        doc = self.to_json()
        doc.update({
            "users": self.users, "reference": self.reference, "notes": self.notes,
            "intervals": {n: {m: [plain(a), plain(b)] for m, (a, b) in v.items()} for n, v in self.intervals.items()},
            "differences_to_reference": {n: {m: [plain(x) for x in t] for m, t in v.items()}
                                         for n, v in self.differences.items()},
            "ratios_to_reference": {n: {m: [plain(x) for x in t] for m, t in v.items()} for n, v in self.ratios.items()},
            "pair_differences": {n: {m: [plain(x) for x in t] for m, t in v.items()}
                                 for n, v in self.pair_differences.items()},
        })
        return doc


@dataclass(frozen=True)
class Bootstrap:
    """How the intervals are drawn: ``resamples`` seeded resamples of the test users (0: no intervals)."""

    resamples: int
    seed: int


def compare(results: dict[str, PhaseResult], *, protocol: str, ks: Sequence[int], candidates: int,
            reference: str | None, bootstrap: Bootstrap, pairs: Sequence[tuple[str, str]] = ()) -> Comparison:
    """Means, bootstrap intervals and paired differences to ``reference`` for models ranked on one phase;
    and for each ``(a, b)`` in ``pairs``, the paired difference ``a - b`` (e.g. a model and its held-out fit,
    whose seeds pair up: seed i of both is one training). The caller names the default model and adds
    notes on the result (``default_model``, ``notes``): they label rows, they change no figure."""
    resamples, seed = bootstrap.resamples, bootstrap.seed
    if not results:
        raise ValueError("no model results to compare")
    ks = sorted(set(int(k) for k in ks))
    users = {len(r.top) for r in results.values()}
    if len(users) != 1:
        raise ValueError(f"models were ranked on different numbers of users {sorted(users)}: compare one phase only")
    n_users = users.pop()
    if reference is not None and reference not in results:
        reference = None
    out = Comparison(protocol=protocol, ks=ks, users=n_users, reference=reference)
    for name, result in results.items():
        out.models[name] = {}
        for metric in metric_names(ks):
            out.models[name][metric] = _point(result, metric, candidates)

    if resamples > 0:
        draws = _Draws(n_users, resamples, seed)
        for name, result in results.items():
            out.intervals[name] = {m: interval(draws.result_means(result, m))
                                   for m in metric_names(ks) if _has_interval(m, n_users, resamples)}
        if reference is not None:
            ref = results[reference]
            for name, result in results.items():
                if name == reference:
                    continue
                out.differences[name], out.ratios[name] = {}, {}
                for m in metric_names(ks):
                    if not _has_interval(m, n_users, resamples):
                        diff = out.models[name][m] - out.models[reference][m]
                        out.differences[name][m] = (diff, math.nan, math.nan)
                        continue
                    a = draws.result_means(result, m)
                    b = draws.result_means(ref, m)
                    diff = out.models[name][m] - out.models[reference][m]
                    out.differences[name][m] = (diff, *interval(a - b))
                    if m.startswith("ndcg@"):
                        with np.errstate(divide="ignore", invalid="ignore"):
                            ratio = out.models[name][m] / out.models[reference][m] if out.models[reference][m] else math.nan
                            out.ratios[name][m] = (ratio, *interval(a / b))
        for a_name, b_name in pairs:
            if a_name in results and b_name in results:
                out.pair_differences[f"{a_name} - {b_name}"] = {
                    m: (out.models[a_name][m] - out.models[b_name][m],
                        *interval(draws.result_means(results[a_name], m) - draws.result_means(results[b_name], m)))
                    for m in metric_names(ks) if _has_interval(m, n_users, resamples)}
    return out


class _Draws:
    """Seeded resamples of user indices, drawn once and shared by every model (paired differences)."""

    def __init__(self, users: int, resamples: int, seed: int):
        self.users, self.resamples = users, resamples
        self.index = np.random.default_rng(seed).integers(0, users, size=(resamples, users), dtype=np.int64) \
            if resamples * users <= 50_000_000 else None
        self.seed = seed

    def _chunks(self):
        if self.index is not None:
            yield self.index
            return
        rng = np.random.default_rng(self.seed)
        step = max(1, 50_000_000 // self.users)
        for start in range(0, self.resamples, step):
            yield rng.integers(0, self.users, size=(min(step, self.resamples - start), self.users), dtype=np.int64)

    def means(self, values: np.ndarray) -> np.ndarray:
        """[resamples] the mean of the per-user ``values`` on each resample."""
        return np.concatenate([np.nanmean(values[chunk], axis=1) for chunk in self._chunks()])

    def result_means(self, result: PhaseResult, metric: str) -> np.ndarray:
        """[resamples] like :meth:`means`; for a result of several seeds, each resample also draws
        that many seeds with replacement and averages their per-user values first."""
        if result.seeds < 2:
            return self.means(result.per_user[metric])
        per_seed = result.per_seed[metric]                                          # [S, E]
        seeds = np.random.default_rng([self.seed, 1]).integers(0, len(per_seed), size=(self.resamples, len(per_seed)))
        out, r = np.empty(self.resamples), 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for chunk in self._chunks():
                for users in chunk:
                    out[r] = np.nanmean(np.nanmean(per_seed[seeds[r]], axis=0)[users])
                    r += 1
        return out


class TwoWayDraws:
    """Seeded resamples of users and of nights together, for figures that are means over (user, night) pairs.

    Resample ``r`` draws the distinct users with replacement and, independently, the nights; a pair counts
    as often as its user was drawn times as often as its night was (the two-way "pigeonhole" bootstrap). A
    value that is NaN (a user without repeat items, for a repeat figure) is left out of the mean, so each
    resample averages over the pairs the figure covers. Drawn once and shared by every system, so the
    difference of two systems' resampled means is a paired difference.
    """

    CELLS = 20_000_000   # resamples x pairs weighed at once: bounds memory (160 MB of float64)

    def __init__(self, users: np.ndarray, nights: np.ndarray, resamples: int, seed: int):
        users, nights = np.asarray(users), np.asarray(nights)
        if users.shape != nights.shape:
            raise ValueError(f"{len(users)} users but {len(nights)} nights: give one of each per pair")
        _, self._user = np.unique(users, return_inverse=True)
        _, self._night = np.unique(nights, return_inverse=True)
        self.pairs, self.resamples = len(users), resamples
        rng = np.random.default_rng(seed)
        n_users, n_nights = int(self._user.max(initial=-1)) + 1, int(self._night.max(initial=-1)) + 1
        self._user_counts = _counts(rng, resamples, n_users)       # [R, users]
        self._night_counts = _counts(rng, resamples, n_nights)     # [R, nights]

    def means(self, values: np.ndarray) -> np.ndarray:
        """[resamples] the weighted mean of the per-pair ``values`` on each resample (NaN pairs left out)."""
        return self.means_many(np.asarray(values, np.float64)[:, None])[:, 0]

    def means_many(self, values: np.ndarray) -> np.ndarray:
        """[resamples, C] :meth:`means` of each column of ``values`` [pairs, C], the weights built once."""
        values = np.asarray(values, np.float64)
        if values.ndim != 2 or values.shape[0] != self.pairs:
            raise ValueError(f"expected {self.pairs} per-pair values a column, got shape {values.shape}")
        finite = np.isfinite(values)
        x, covered = np.where(finite, values, 0.0), finite.astype(np.float64)
        out = np.empty((self.resamples, values.shape[1]))
        step = max(1, self.CELLS // max(1, self.pairs))
        for start in range(0, self.resamples, step):
            end = min(self.resamples, start + step)
            w = self._user_counts[start:end][:, self._user] * self._night_counts[start:end][:, self._night]  # [r, P]
            with np.errstate(invalid="ignore", divide="ignore"):
                out[start:end] = (w @ x) / (w @ covered)
        return out


def _counts(rng: np.random.Generator, resamples: int, n: int) -> np.ndarray:
    """[resamples, n] how often each of ``n`` units is drawn in ``n`` draws with replacement."""
    if n == 0:
        return np.zeros((resamples, 0))
    draws = rng.integers(0, n, size=(resamples, n))
    offsets = (np.arange(resamples) * n)[:, None]
    return np.bincount((draws + offsets).ravel(), minlength=resamples * n).reshape(resamples, n).astype(np.float64)


def _point(result: PhaseResult, metric: str, candidates: int) -> float:
    name, k = metric.split("@")
    if name == "coverage":
        return coverage(result.top, int(k), candidates)
    values = result.per_user[metric]
    return float(np.nanmean(values)) if np.isfinite(values).any() else math.nan


def _has_interval(metric: str, users: int, resamples: int) -> bool:
    return metric.split("@")[0] in MEAN_METRICS


def interval(samples: np.ndarray) -> tuple[float, float]:
    """The 95% percentile interval of resampled figures (NaN resamples left out; NaN, NaN without any)."""
    finite = samples[np.isfinite(samples)]
    if len(finite) == 0:
        return math.nan, math.nan
    lo, hi = np.percentile(finite, [2.5, 97.5])
    return float(lo), float(hi)


def plain(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), 6)


# --------------------------------------------------------------------------------------------
# Text


def format_table(comparison: Comparison, *, digits: int = 4) -> str:
    """A Markdown table (readable in a terminal, pasteable into the README): models x metrics, each
    ``mean [2.5%, 97.5%]``; then the paired differences to the reference and the NDCG ratios."""
    metrics = metric_names(comparison.ks)
    lines = [f"protocol {comparison.protocol}, {comparison.users:,} test users; [95% bootstrap interval over users] "
             "(coverage has none: it is not a mean over users)",
             "", "| model | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for name, values in comparison.models.items():
        label = name + (" (default)" if name == comparison.default_model else "")
        cells = [cell(values[m], comparison.intervals.get(name, {}).get(m), digits, m) for m in metrics]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if comparison.differences:
        ref = comparison.reference
        lines += ["", f"Paired difference to {ref} (model - {ref}), 95% bootstrap interval over the same users:", "",
                  "| model | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
        for name, diffs in comparison.differences.items():
            cells = [cell(d[0], (d[1], d[2]), digits, m, signed=True) if (d := diffs.get(m)) else "n/a"
                     for m in metrics]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        ratio_lines = []
        for name, ratios in comparison.ratios.items():
            parts = [f"{m} {r:.2f}x [{lo:.2f}, {hi:.2f}]" for m, (r, lo, hi) in ratios.items() if math.isfinite(r)]
            if parts:
                ratio_lines.append(f"- {name} / {ref}: " + ", ".join(parts))
        if ratio_lines:
            lines += ["", f"NDCG ratio to {ref} (95% bootstrap interval):", *ratio_lines]
    if comparison.pair_differences:
        lines += ["", "Paired differences between rows, 95% bootstrap interval over the same users (and seeds):", "",
                  "| rows | " + " | ".join(m for m in metrics if not m.startswith("coverage")) + " |",
                  "|---|" + "---|" * sum(not m.startswith("coverage") for m in metrics)]
        for pair, diffs in comparison.pair_differences.items():
            cells = [cell(d[0], (d[1], d[2]), digits, m, signed=True) for m, d in diffs.items()]
            lines.append(f"| {pair} | " + " | ".join(cells) + " |")
    if comparison.notes:
        lines += ["", *[f"- {name}: {note}" for name, note in comparison.notes.items()]]
    return "\n".join(lines)


def cell(value: float, bounds: tuple[float, float] | None, digits: int, metric: str, signed: bool = False) -> str:
    """``value [lo, hi]`` as the tables print it (``n/a`` for a missing value, no brackets without bounds)."""
    d = 1 if metric.startswith("pop_pct") else digits
    fmt = f"{{:{'+' if signed else ''}.{d}f}}"
    if value is None or not math.isfinite(value):
        return "n/a"
    text = fmt.format(value)
    if bounds is not None and all(math.isfinite(x) for x in bounds):
        text += f" [{bounds[0]:.{d}f}, {bounds[1]:.{d}f}]"
    return text


def write_json(comparison: Comparison, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(comparison.to_json(), indent=2) + "\n")
