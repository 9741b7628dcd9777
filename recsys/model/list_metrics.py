"""Figures of published lists (pure numpy): what users did with last night's lists, and how tonight's differ.

The nightly guard (:mod:`recsys.pipelines.guard`) judges a night by these; the scoring tasks compute the
per-user parts on the rows they emit (:mod:`recsys.scoring.compare`) and only sums and histograms travel
back to the driver, so nothing here is called with more than one chunk of users at a time, and the
driver-side figures (concentration, score shift) take per-item or per-bin counts.

- **Realized hits** (:func:`realized`): a list against the items its user went on to touch (an offline
  proxy: the lists shaped what users did). Per user, HR@k is 1 when any of the first k items was touched,
  NDCG@k the DCG of the touched positions over the ideal DCG of min(k, touched items).
- **The popularity baseline** (:func:`popularity_lists`): one global ranking, each user's seen items
  removed, cut to k, so the model's lists are compared with what the fallback would have shown.
- **Overlap** (:func:`jaccard`): per user, |A & B| / |A | B| of two nights' lists; the distribution
  travels as a :data:`JACCARD_BINS`-bin histogram (:func:`jaccard_histogram`, :func:`histogram_quantile`).
- **Concentration of exposure**: the Gini coefficient over every candidate's times recommended (zeros
  included) and the share of all slots taken by the most recommended items (:func:`top_share`).
- **Score shift** (:func:`psi`): the population stability index of tonight's scores in the previous
  night's score bins (deciles of a sample, :func:`decile_edges`).
- **The next day, repeats and new items apart** (:func:`next_day_figures`): what ``recsys backtest``
  measures of every system's lists, per user and night: HR, NDCG and recall over all the items the user
  touched the next day, over those they had touched before (repeats) and over those new to them, and
  the share of the list that repeats the user's own history.

Lists are :class:`Lists`: ragged rows of item ids as offsets and flat values, as Arrow holds them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from recsys.sequences import Sequences

SHORT_K = 10                      # the short cut-off beside top_n: HR@10, NDCG@10, Jaccard@10
JACCARD_BINS = 101                # bins 0..99: [b/100, (b+1)/100); bin 100: exactly 1 (identical sets)
TABLE_CELLS = 2 * 2**20           # largest dense (rows x columns) membership table, in bytes (2 MiB: cache-sized,
                                  # the fastest size measured: docs/performance.md, "Figures that lived in the code")


@dataclass(frozen=True)
class Lists:
    """Ragged rows of item ids (or of dense item positions): row ``r`` is ``ids[offsets[r]:offsets[r + 1]]``."""

    offsets: np.ndarray   # [R + 1] int64, starts at 0
    ids: np.ndarray       # [T] int64

    @classmethod
    def from_arrow(cls, array) -> "Lists":
        """A ``list<int64>`` Arrow array (or chunked array); null rows become empty rows."""
        seqs = Sequences.from_arrow(array)
        return cls(seqs.offsets, seqs.items)

    @classmethod
    def of(cls, rows: list[list[int]]) -> "Lists":
        """From Python lists (tests, small inputs)."""
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.array([i for r in rows for i in r], dtype=np.int64)
        return cls(offsets, flat)

    @property
    def n_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def rows(self) -> np.ndarray:
        """[T] the row of each flat value."""
        return np.repeat(np.arange(self.n_rows, dtype=np.int64), self.lengths)

    def positions(self) -> np.ndarray:
        """[T] each flat value's position within its row (0 = first)."""
        return np.arange(len(self.ids), dtype=np.int64) - np.repeat(self.offsets[:-1], self.lengths)

    def take(self, rows: np.ndarray) -> "Lists":
        """The given rows, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.lengths[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        starts = np.repeat(self.offsets[:-1][rows], lengths)
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        return Lists(offsets, self.ids[starts + within])

    def where(self, keep: np.ndarray) -> "Lists":
        """The same rows holding only the values where ``keep`` ([T] bool, aligned with ``ids``) is true."""
        keep = np.asarray(keep, dtype=bool)
        lengths = np.bincount(self.rows()[keep], minlength=self.n_rows)
        offsets = np.zeros(self.n_rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Lists(offsets, self.ids[keep])

    def head(self, k: int) -> "Lists":
        """The first ``k`` values of each row."""
        keep = self.positions() < k
        lengths = np.minimum(self.lengths, k)
        offsets = np.zeros(self.n_rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Lists(offsets, self.ids[keep])


def member_dense(a_rows: np.ndarray, a_pos: np.ndarray, b_rows: np.ndarray, b_pos: np.ndarray,
                 n_rows: int, n_cols: int) -> np.ndarray:
    """[len(a)] bool: whether each (row, position) pair of ``a`` is among the pairs of ``b``.

    Positions are dense column numbers in ``[0, n_cols)``; a negative position is never a member (an
    item outside the column space). Both sides must be sorted by row (as :meth:`Lists.rows` gives them).
    Rows are handled in blocks whose ``rows x n_cols`` table stays under :data:`TABLE_CELLS` bytes: a
    scatter, a gather and a reset per block, several times faster than sorting the pairs (measured:
    docs/performance.md, "Figures that lived in the code"). Past that, the pairs are matched through one sort.
    """
    a_rows, a_pos = np.asarray(a_rows, np.int64), np.asarray(a_pos, np.int64)
    b_rows, b_pos = np.asarray(b_rows, np.int64), np.asarray(b_pos, np.int64)
    out = np.zeros(len(a_pos), dtype=bool)
    if not len(a_pos) or not len(b_pos) or n_cols <= 0:
        return out
    keep_b = b_pos >= 0
    b_rows, b_pos = b_rows[keep_b], b_pos[keep_b]
    block = max(1, min(n_rows, TABLE_CELLS // n_cols))
    if block < 8:   # a huge column space: one sort of the pairs' keys instead of a table per few rows
        b_keys = np.sort(b_rows * n_cols + b_pos)
        valid = a_pos >= 0
        a_keys = a_rows[valid] * n_cols + a_pos[valid]
        at = np.searchsorted(b_keys, a_keys).clip(max=max(len(b_keys) - 1, 0))
        out[valid] = b_keys[at] == a_keys if len(b_keys) else False
        return out
    table = np.zeros((block, n_cols), dtype=bool)
    bounds = np.arange(0, n_rows + block, block)
    a_cut = np.searchsorted(a_rows, bounds)
    b_cut = np.searchsorted(b_rows, bounds)
    for i in range(len(bounds) - 1):
        a0, a1, b0, b1 = a_cut[i], a_cut[i + 1], b_cut[i], b_cut[i + 1]
        if a0 == a1 or b0 == b1:
            continue
        br, bp = b_rows[b0:b1] - bounds[i], b_pos[b0:b1]
        table[br, bp] = True
        ar, ap = a_rows[a0:a1] - bounds[i], a_pos[a0:a1]
        valid = ap >= 0
        out[a0:a1][valid] = table[ar[valid], ap[valid]]
        table[br, bp] = False
    return out


def member(a_rows: np.ndarray, a_ids: np.ndarray, b_rows: np.ndarray, b_ids: np.ndarray, n_rows: int) -> np.ndarray:
    """[len(a)] bool: whether each (row, item id) pair of ``a`` is among the pairs of ``b``; ids are any int64.

    ``b``'s ids are numbered densely first (cheap when ``b`` is the small side: the items users touched).
    Both sides sorted by row.
    """
    b_ids = np.asarray(b_ids, np.int64)
    uniq, b_pos = np.unique(b_ids, return_inverse=True)
    a_ids = np.asarray(a_ids, np.int64)
    at = np.searchsorted(uniq, a_ids).clip(max=max(len(uniq) - 1, 0))
    found = (uniq[at] == a_ids) if len(uniq) else np.zeros(len(a_ids), dtype=bool)
    a_pos = np.where(found, at, -1)
    return member_dense(a_rows, a_pos, b_rows, b_pos.reshape(-1), n_rows, len(uniq))


def _ideal_dcg(counts: np.ndarray, k: int) -> np.ndarray:
    discounts = np.concatenate([[0.0], np.cumsum(1.0 / np.log2(np.arange(k) + 2.0))])   # [k + 1]
    return discounts[np.minimum(counts, k)]


@dataclass(frozen=True)
class Realized:
    """Per user, for one cut-off: whether any of the first k items was touched, and NDCG@k."""

    hit: np.ndarray     # [R] bool
    ndcg: np.ndarray    # [R] float64
    hits: np.ndarray | None = None   # [R] int64: how many of the first k items were touched (recall's numerator)


def realized(lists: Lists, touched: Lists, ks: tuple[int, ...]) -> dict[int, Realized]:
    """Each list against the items its user touched afterwards (row ``r`` of both is one user).

    ``touched`` rows hold distinct items; a user who touched nothing has HR 0 and NDCG 0 (callers pass
    only users who touched something). NDCG@k: the DCG of the touched items among the first k (gain
    1 / log2(position + 2)) over the ideal DCG of min(k, items touched).
    """
    if lists.n_rows != touched.n_rows:
        raise ValueError(f"realized: {lists.n_rows} lists but {touched.n_rows} rows of touched items")
    rows, pos = lists.rows(), lists.positions()
    hit = member(rows, lists.ids, touched.rows(), touched.ids, lists.n_rows)
    out = {}
    for k in ks:
        in_k = hit & (pos < k)
        hits = np.bincount(rows[in_k], minlength=lists.n_rows)
        dcg = np.bincount(rows[in_k], weights=1.0 / np.log2(pos[in_k] + 2.0), minlength=lists.n_rows)
        ideal = _ideal_dcg(touched.lengths, k)
        out[k] = Realized(hits > 0, np.divide(dcg, ideal, out=np.zeros(lists.n_rows), where=ideal > 0), hits)
    return out


NEXT_DAY_PARTS = ("", ".repeat", ".new")   # all next-day items; those the user had before; those new to them


def next_day_names(k: int, n: int) -> list[str]:
    """The figures :func:`next_day_figures` returns, in table order."""
    return [f"{m}{part}" for part in NEXT_DAY_PARTS for m in (f"hr@{k}", f"ndcg@{k}", f"recall@{n}")] + \
        [f"repeat_share@{k}", "listed"]


def next_day_figures(lists: Lists, targets: Lists, seen: Lists, k: int, n: int) -> dict[str, np.ndarray]:
    """Per row (one user on one night), how the user's list did on what the user did the next day.

    ``lists``: the list published for the night, best first; ``targets``: the distinct items the user
    touched that day; ``seen``: the distinct items the user touched before it. Row ``r`` of all three is one
    user. Returns [R] arrays named by :func:`next_day_names`:

    - ``hr@k``, ``ndcg@k`` (:func:`realized`), ``recall@n`` (touched items among the first ``n`` over all
      touched items) against every target;
    - the same against the **repeat** targets (``.repeat``: in ``seen``) and the **new** ones (``.new``:
      not in ``seen``), NaN for a row without targets of that kind, so a mean over the finite values is a
      mean over the users who had such items;
    - ``repeat_share@k``: the share of the first k list items that are in ``seen`` (NaN for an empty list),
      ``listed``: 1 when the user had a list at all.

    A list that holds only items new to its user scores 0 on every repeat figure; one that holds only the
    user's history scores 0 on every new one.
    """
    if not lists.n_rows == targets.n_rows == seen.n_rows:
        raise ValueError(f"next_day_figures: {lists.n_rows} lists, {targets.n_rows} target rows and "
                         f"{seen.n_rows} history rows: give one row per user to all three")
    rows = lists.n_rows
    repeat = member(targets.rows(), targets.ids, seen.rows(), seen.ids, rows)
    out: dict[str, np.ndarray] = {}
    for part, keep in zip(NEXT_DAY_PARTS, (np.ones(len(repeat), dtype=bool), repeat, ~repeat)):
        touched = targets.where(keep)
        has = touched.lengths > 0
        found = realized(lists, touched, tuple(sorted({k, n})))
        recall = np.divide(found[n].hits, touched.lengths, out=np.zeros(rows), where=has)
        out[f"hr@{k}{part}"] = np.where(has, found[k].hit.astype(np.float64), np.nan)
        out[f"ndcg@{k}{part}"] = np.where(has, found[k].ndcg, np.nan)
        out[f"recall@{n}{part}"] = np.where(has, recall, np.nan)
    head = lists.head(k)
    in_history = member(head.rows(), head.ids, seen.rows(), seen.ids, rows)
    repeats = np.bincount(head.rows()[in_history], minlength=rows)
    out[f"repeat_share@{k}"] = np.divide(repeats, head.lengths, out=np.full(rows, np.nan), where=head.lengths > 0)
    out["listed"] = (lists.lengths > 0).astype(np.float64)
    return {name: out[name] for name in next_day_names(k, n)}


def popularity_lists(ranking: np.ndarray, exclude: Lists, k: int) -> Lists:
    """Per row, the first ``k`` items of the global ``ranking`` (best first, distinct) not in that row of
    ``exclude`` (the user's seen items): what the popularity fallback would show a user with that history."""
    ranking = np.asarray(ranking, np.int64)
    m, n = len(ranking), exclude.n_rows
    if m == 0 or n == 0:
        return Lists(np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    order = np.argsort(ranking, kind="stable")
    sorted_ids = ranking[order]
    at = np.searchsorted(sorted_ids, exclude.ids).clip(max=m - 1)
    found = sorted_ids[at] == exclude.ids
    masked = np.zeros((n, m), dtype=bool)                                   # [R, M]
    masked[exclude.rows()[found], order[at[found]]] = True
    kept = ~masked
    rank_among_kept = np.cumsum(kept, axis=1) - 1                           # [R, M]
    chosen = kept & (rank_among_kept < k)
    lengths = chosen.sum(axis=1)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Lists(offsets, np.broadcast_to(ranking, (n, m))[chosen])


def jaccard(new: Lists, old: Lists, n_cols: int) -> np.ndarray:
    """[R] |new & old| / |new | old| per row; items as dense positions in ``[0, n_cols)`` (a negative
    position is an item outside that space, matching nothing); two empty rows count as identical (1)."""
    if new.n_rows != old.n_rows:
        raise ValueError(f"jaccard: {new.n_rows} rows against {old.n_rows}")
    rows = new.rows()
    both = member_dense(rows, new.ids, old.rows(), old.ids, new.n_rows, n_cols)
    inter = np.bincount(rows[both], minlength=new.n_rows)
    union = new.lengths + old.lengths - inter
    return np.divide(inter, union, out=np.ones(new.n_rows), where=union > 0)


def jaccard_histogram(values: np.ndarray) -> np.ndarray:
    """[JACCARD_BINS] counts: bin b < 100 holds values in [b/100, (b+1)/100), bin 100 exactly 1."""
    values = np.asarray(values, np.float64)
    bins = np.where(values >= 1.0, 100, np.clip(np.floor(values * 100), 0, 99)).astype(np.int64)
    return np.bincount(bins, minlength=JACCARD_BINS)


def histogram_quantile(hist: np.ndarray, q: float) -> float:
    """The value at quantile ``q`` of a :func:`jaccard_histogram` (its bin's lower edge; NaN if empty)."""
    hist = np.asarray(hist, np.int64)
    total = int(hist.sum())
    if total == 0:
        return math.nan
    b = int(np.searchsorted(np.cumsum(hist), q * total, side="left"))
    return min(b, 100) / 100


def gini(counts: np.ndarray) -> float:
    """Gini coefficient of exposure over items, zeros included: 0 every item recommended equally often,
    towards 1 a few items take every slot. NaN without any item or any slot."""
    x = np.sort(np.asarray(counts, np.float64))
    n, total = len(x), x.sum()
    if n == 0 or total <= 0:
        return math.nan
    return float((2.0 * np.dot(np.arange(1, n + 1), x)) / (n * total) - (n + 1) / n)


def top_share(counts: np.ndarray, items: int) -> float:
    """Share of all slots taken by the ``items`` most recommended items (NaN without slots)."""
    x = np.asarray(counts, np.float64)
    total = x.sum()
    if total <= 0:
        return math.nan
    items = max(1, min(int(items), len(x)))
    return float(np.partition(x, len(x) - items)[len(x) - items:].sum() / total)


def top_percent_items(n_items: int, percent: float = 1.0) -> int:
    """How many items are the top ``percent`` % of ``n_items`` (at least one)."""
    return max(1, math.ceil(n_items * percent / 100))


def decile_edges(sample: np.ndarray) -> np.ndarray:
    """The 9 inner decile edges of a score sample (empty when the sample is): tonight's bins for tomorrow's PSI."""
    sample = np.asarray(sample, np.float64)
    sample = sample[np.isfinite(sample)]
    if len(sample) == 0:
        return np.zeros(0)
    return np.quantile(sample, np.linspace(0.1, 0.9, 9))


def bin_counts(scores: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """[len(edges) + 1] counts of ``scores`` in the bins the edges cut (right edges exclusive)."""
    return np.bincount(np.searchsorted(np.asarray(edges, np.float64), np.asarray(scores, np.float64), side="right"),
                       minlength=len(edges) + 1)


PSI_FLOOR = 1e-4   # a share never counts as less than this: an empty bin would make the index infinite


def psi(expected_shares: np.ndarray, actual_counts: np.ndarray) -> float:
    """Population stability index of ``actual_counts`` against ``expected_shares`` over the same bins:
    sum (a - e) ln(a / e) with both shares floored at :data:`PSI_FLOOR`. Rules of thumb: under 0.1
    stable, 0.1-0.25 a moderate shift, above 0.25 a large one. NaN without counts."""
    e = np.asarray(expected_shares, np.float64)
    a = np.asarray(actual_counts, np.float64)
    if len(e) != len(a):
        raise ValueError(f"psi: {len(e)} expected bins against {len(a)} counted")
    if a.sum() <= 0 or len(e) == 0:
        return math.nan
    e = np.maximum(e / max(e.sum(), 1e-12), PSI_FLOOR)
    a = np.maximum(a / a.sum(), PSI_FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


# ------------------------------------------------------------------------------------------------
# The same figures over padded [rows, width] matrices, as the scoring tasks hold them: no ragged
# bookkeeping per call, several times faster than the ragged forms above and a small share of scoring
# the chunk (measured: docs/performance.md, "Figures that lived in the code").
# The ragged forms stay the definition; tests hold the two equal.

PAD = -1   # padding of position matrices (and of id matrices, where it must never equal a real id: see pad_ids)


def padded(lists: Lists, width: int | None = None, pad: int = PAD) -> np.ndarray:
    """[rows, width] of each row's values, left-aligned, padded with ``pad`` (width: the longest row)."""
    lengths = lists.lengths
    width = int(lengths.max(initial=0)) if width is None else width
    if len(lists.ids) == lists.n_rows * width and (lengths == width).all():
        return lists.ids.reshape(lists.n_rows, width)
    out = np.full((lists.n_rows, width), pad, dtype=np.int64)
    keep = lists.positions() < width
    out[lists.rows()[keep], lists.positions()[keep]] = lists.ids[keep]
    return out


def overlap_counts(new_pos: np.ndarray, old_pos: np.ndarray, n_cols: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, how many items of ``new_pos`` are in ``old_pos`` (all of them, and among the first ``k`` of
    both): ``[rows, N]`` and ``[rows, M]`` matrices of dense positions in ``[0, n_cols)``, ``PAD`` (any
    negative) for no item. Through a table of (row, position) -> 1 + the item's place in the old row, in
    row blocks of at most :data:`TABLE_CELLS` bytes of int16; past that (a huge column space) by sorting."""
    rows, width = new_pos.shape
    inter_all = np.zeros(rows, dtype=np.int64)
    inter_k = np.zeros(rows, dtype=np.int64)
    if rows == 0 or old_pos.shape[1] == 0 or width == 0:
        return inter_all, inter_k
    if old_pos.shape[1] > 32000:
        raise ValueError(f"overlap_counts: lists of {old_pos.shape[1]} items are longer than the table holds")
    block = min(rows, TABLE_CELLS // (2 * (n_cols + 1)))
    new_padded = bool(new_pos.min() < 0)
    new_in = np.where(new_pos >= 0, new_pos, n_cols) if new_padded else new_pos   # padding reads the spare column
    old_in = np.where(old_pos >= 0, old_pos, n_cols) if old_pos.min() < 0 else old_pos
    place = np.broadcast_to(np.arange(1, old_pos.shape[1] + 1, dtype=np.int16), old_pos.shape)
    if block < 4:   # a huge column space: match (row, position) keys through one sort
        r = np.arange(rows, dtype=np.int64)[:, None] * (n_cols + 1)
        keys = (old_in + r).ravel()
        order = np.argsort(keys, kind="stable")
        at = np.searchsorted(keys[order], (new_in + r).ravel()).clip(max=len(keys) - 1)
        found = (keys[order][at] == (new_in + r).ravel()).reshape(rows, width)
        got = np.where(found, place.ravel()[order][at].reshape(rows, width), 0)
    else:
        table = np.zeros((block, n_cols + 1), dtype=np.int16)
        got = np.empty((rows, width), dtype=np.int16)
        for start in range(0, rows, block):
            end = min(rows, start + block)
            r = np.arange(end - start)[:, None]
            table[r, old_in[start:end]] = place[start:end]
            got[start:end] = table[r, new_in[start:end]]
            table[r, old_in[start:end]] = 0
    if new_padded:
        got = np.where(new_pos >= 0, got, 0)                               # padding matched the spare column
    inter_all = np.count_nonzero(got, axis=1)
    head = got[:, :k]
    inter_k = np.count_nonzero((head > 0) & (head <= k), axis=1)
    return inter_all, inter_k


def hits_in_lists(lists: np.ndarray, touched_rows: np.ndarray, touched_ids: np.ndarray, n_touched: np.ndarray,
                  ks: tuple[int, ...]) -> dict[int, Realized]:
    """:func:`realized` for lists as a ``[rows, N]`` id matrix (padded with a value no item has) and the
    touched items as (row, id) pairs, ``n_touched`` per row. Each touched item is compared with its user's
    list at once: cheap because users touch few items."""
    n_rows, width = lists.shape
    if width == 0:   # every list empty (users new to a personal-frequency list): nothing can be hit
        return _realized_at(np.zeros(0, np.int64), np.zeros(0, np.int64), n_touched, n_rows, ks)
    eq = lists[touched_rows] == touched_ids[:, None]                            # [T, N]
    found = eq.any(axis=1)
    where = eq.argmax(axis=1)
    rows, pos = touched_rows[found], where[found]
    return _realized_at(rows, pos, n_touched, n_rows, ks)


def popularity_hits(ranking: np.ndarray, seen_rows: np.ndarray, seen_ids: np.ndarray, touched: Lists,
                    ks: tuple[int, ...]) -> dict[int, Realized]:
    """:func:`realized` of :func:`popularity_lists` (``ranking`` without each row's seen items, cut to k)
    without building the lists: each touched item's place among the ranking's items its user had not seen.
    ``seen_rows``/``seen_ids``: the (row, item) pairs each user had seen; ``touched``: one row per user."""
    touched_rows, touched_ids, n_touched, n_rows = touched.rows(), touched.ids, touched.lengths, touched.n_rows
    ranking = np.asarray(ranking, np.int64)
    m = len(ranking)
    if m == 0 or n_rows == 0:
        return {k: Realized(np.zeros(n_rows, dtype=bool), np.zeros(n_rows), np.zeros(n_rows, np.int64)) for k in ks}
    order = np.argsort(ranking, kind="stable")
    sorted_ids = ranking[order]

    def rank_of(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.searchsorted(sorted_ids, ids).clip(max=m - 1)
        found = sorted_ids[at] == ids
        return found, order[at]

    found, rank = rank_of(seen_ids)
    seen_keys = np.sort(seen_rows[found] * m + rank[found])                        # (row, rank) of seen items
    found, rank = rank_of(touched_ids)
    rows, rank = touched_rows[found], rank[found]
    keys = rows * m + rank
    before = np.searchsorted(seen_keys, keys)                                       # seen items ranked higher ...
    row_start = np.searchsorted(seen_keys, rows * m)                                # ... in the same row
    seen = (before < len(seen_keys)) & (seen_keys[np.minimum(before, max(len(seen_keys) - 1, 0))] == keys) \
        if len(seen_keys) else np.zeros(len(keys), dtype=bool)
    rows, pos = rows[~seen], (rank - (before - row_start))[~seen]                  # place among the unseen
    return _realized_at(rows, pos, n_touched, n_rows, ks)


def _realized_at(rows: np.ndarray, pos: np.ndarray, n_touched: np.ndarray, n_rows: int,
                 ks: tuple[int, ...]) -> dict[int, Realized]:
    """Hits given as (row, 0-based place in that row's list) -> :class:`Realized` at each k: the one
    reduction both the published lists and the popularity baseline end in."""
    out = {}
    for k in ks:
        in_k = pos < k
        hits = np.bincount(rows[in_k], minlength=n_rows)
        dcg = np.bincount(rows[in_k], weights=1.0 / np.log2(pos[in_k] + 2.0), minlength=n_rows)
        ideal = _ideal_dcg(n_touched, k)
        out[k] = Realized(hits > 0, np.divide(dcg, ideal, out=np.zeros(n_rows), where=ideal > 0), hits)
    return out


def bin_counts_sorted_edges(scores: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """:func:`bin_counts` through one comparison per edge (faster than a search for a few edges)."""
    scores = np.asarray(scores)
    above = np.array([np.count_nonzero(scores >= e) for e in np.asarray(edges, np.float64)], dtype=np.int64)
    cum = np.concatenate([[len(scores)], above, [0]])
    return cum[:-1] - cum[1:]
