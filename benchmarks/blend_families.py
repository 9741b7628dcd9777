"""Would new items weigh in better by the model's probability than by their rank? Blend families on honest rows.

    python benchmarks/blend_families.py --work BACKTEST_WORK [--cache DIR] [--resamples 2000] [--json PATH]

The job's blend (:mod:`recsys.model.repeats`) gives a new item at rank r of the model's ranking of the items a user
does not know the score ``-new_rank_weight * log1p(r)``: the same for every user, whatever the model thinks of its
top new item. This measures two families that let the model's confidence in: ``prob``, a new item's score
``beta * log p`` with ``p`` the model's softmax over the items the user does not know (the prior added to the
scores first, as the job adds it); ``rank+top``, the job's rank score plus ``beta * log p`` of the user's best new
item (a per-user shift). Known items score as in the job (``repeat_bias + log(count) - age_weight * log1p(age)``).

The rows are :mod:`blend_choice`'s honest rows (each backtest night's own users and day, its new items ranked by the
model trained for that night), here with the log-probabilities of each user's 20 best new items under each
popularity weight of the run's ``train.repeats.popularity_weights``. Each family's grid is searched on the rows of
every night before the one it is scored on (as :mod:`blend_choice`'s "nights before"), and, as a ceiling, on the
night itself. Differences to the rank family chosen the same way, with 95% intervals from a two-way bootstrap over
rows and nights (each (user, night) row its own user). Lists are built row by row in numpy from the 10 best known
items and the 20 best new ones; a night's job blend, rebuilt the same way, is listed beside for reference.

Spark reads the events once per night (cached under ``--cache``, default ``BACKTEST_WORK/blend_families``); the
search then takes about a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import pickle
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from blend_choice import honest_nights, run_config, trained_models  # noqa: E402
from recsys.evaluation.report import TwoWayDraws, interval  # noqa: E402
from recsys.model.repeats import AGE_WEIGHTS, NEW_RANK_WEIGHTS, REPEAT_BIASES, RepeatBlend  # noqa: E402

K = 10
TOP_NEW = 20                        # a user's best new items kept per row: only the first 10 can be listed
GAIN = 1.0 / np.log2(np.arange(K) + 2.0)
BETAS = (0.5, 1.0, 2.0, 3.0)
PROB_BIASES = tuple(np.arange(-30.0, 10.01, 0.5).round(2).tolist())   # beta * log p reaches far below 0
FAMILIES = ("rank", "prob", "rank+top")


def build_rows(work: Path, models: dict[dt.date, Path], cache: Path) -> dict[str, dict]:
    """{night: packed rows} (see :func:`_pack`), built once per night under ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [n for n in models if not (cache / f"{n}.pkl").is_file()]
    if missing:
        _build(work, models, missing, cache)
    return {str(n): pickle.loads((cache / f"{n}.pkl").read_bytes()) for n in models}


def _build(work: Path, models: dict[dt.date, Path], nights: list[dt.date], cache: Path) -> None:
    import torch

    from recsys.learning.repeats import validation_chunks
    from recsys.model.repeats import SECONDS_PER_DAY
    from recsys.sequences import pad_left

    cfg = run_config(work)
    weights = tuple(cfg.train.repeats.popularity_weights)
    for n in honest_nights(cfg, models, nights, cache):
        night, days, vocab, blend = n.night, n.days, n.vocab, n.blend
        if blend.item_to_item_weight:
            raise SystemExit(f"the job's blend of {night} weighs item-to-item scores, which these families leave out: "
                             "run this on a backtest with --set train.repeats.item_to_item.weights=[0]")
        model = n.model.model.eval()
        items = model.item_embeddings().detach().float()
        prior = torch.as_tensor(n.prior, dtype=torch.float32)
        rows = []
        for chunk in validation_chunks(days.rows):
            hist, _ = vocab.map_sequences(chunk.histories)
            known = vocab.index_of(chunk.histories.items) > 0
            counts, last = chunk.counts[known], chunk.last_us[known]
            usable = np.flatnonzero(hist.lengths > 0)
            part = hist.take(usable)
            with torch.no_grad():
                scores = model.encode(torch.from_numpy(pad_left(part, model.max_len))).float() @ items.T    # [u, N+1]
            scores[:, 0] = float("-inf")                                                                # padding
            for j, r in enumerate(usable):
                lo, hi = hist.offsets[r], hist.offsets[r + 1]
                mine = hist.items[lo:hi]
                targets = vocab.index_of(chunk.targets.items[chunk.targets.offsets[r]:chunk.targets.offsets[r + 1]])
                s = scores[j].clone()
                s[torch.from_numpy(mine)] = float("-inf")
                new = []
                for w in weights:
                    top = torch.topk(torch.log_softmax(s + w * prior, 0), TOP_NEW)
                    new.append((top.values.numpy().astype(np.float64), np.isin(top.indices.numpy(), targets)))
                rows.append({"counts": counts[lo:hi].astype(np.float64), "index": mine,
                             "ages": (chunk.day_start_us[r] - last[lo:hi]) / (SECONDS_PER_DAY * 1e6),
                             "known_target": np.isin(mine, targets),
                             "targets": len(targets), "has_new": bool((~np.isin(targets, mine)).any()), "new": new})
        packed = _pack(rows, weights, blend)
        (cache / f"{night}.pkl").write_bytes(pickle.dumps(packed))
        print(f"{night}: {len(rows):,} rows", flush=True)


def _pack(rows: list[dict], weights: tuple[float, ...], blend: RepeatBlend) -> dict:
    """Arrays: known [S, W] counts / ages / targets / model index (0-padded); new [P, S, TOP_NEW] log-probabilities
    and targets under each popularity weight; the day's item count and whether the row had a new item."""
    width = max(1, max(len(r["counts"]) for r in rows))
    out = {k: np.zeros((len(rows), width), dtype=t) for k, t in
           (("counts", np.float64), ("ages", np.float64), ("known_target", bool), ("index", np.int64))}
    for i, r in enumerate(rows):
        for k in out:
            out[k][i, :len(r[k])] = r[k]
    out["log_p"] = np.stack([np.stack([r["new"][p][0] for r in rows]) for p in range(len(weights))])
    out["new_target"] = np.stack([np.stack([r["new"][p][1] for r in rows]) for p in range(len(weights))])
    out["targets"] = np.array([r["targets"] for r in rows])
    out["has_new"] = np.array([r["has_new"] for r in rows])
    out["weights"], out["blend"] = weights, blend
    return out


def _known_top(d: dict, age_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """The 10 best known items per row in the job's order (ties by model index): ([S, 10] scores, [S, 10] targets)."""
    base = np.where(d["counts"] > 0, np.log(np.maximum(d["counts"], 1)) - age_weight * np.log1p(d["ages"]), -np.inf)
    order = np.lexsort((d["index"], -base), axis=1)[:, :K]
    return np.take_along_axis(base, order, 1), np.take_along_axis(d["known_target"], order, 1)


def _figures(d: dict, known: np.ndarray, known_target: np.ndarray, new: np.ndarray,
             new_target: np.ndarray) -> np.ndarray:
    """[S, 3] NDCG@10, HR@10 and HR@10 over new items (NaN without one) of the merged lists."""
    scores, target = np.concatenate([known, new], 1), np.concatenate([known_target, new_target], 1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    hit = np.take_along_axis(target, order, 1)
    new_hit = hit & (order >= known.shape[1])
    ideal = np.concatenate([[0.0], np.cumsum(GAIN)])[np.minimum(d["targets"], K)]
    ndcg = np.where(ideal > 0, (hit * GAIN).sum(1) / np.where(ideal > 0, ideal, 1), 0.0)
    return np.stack([ndcg, hit.any(1), np.where(d["has_new"], new_hit.any(1), np.nan)], 1)


def _new_scores(family: str, d: dict, p: int, x) -> np.ndarray:
    log_p = d["log_p"][p]
    rank = -np.log1p(np.arange(TOP_NEW))
    if family == "rank":
        return np.broadcast_to(x * rank, log_p.shape)
    if family == "prob":
        return x * log_p
    return x[0] * rank + x[1] * log_p[:, :1]          # rank+top


def grid(family: str, weights: tuple[float, ...]) -> list[tuple]:
    """(popularity weight's index, age weight, the family's new-item weight(s), repeat bias) of each candidate;
    the rank family's biases are the job's (masking, -inf, among them)."""
    xs = {"rank": NEW_RANK_WEIGHTS, "prob": BETAS,
          "rank+top": [(w, b) for w in (0.5, 1.0, 2.0) for b in BETAS]}[family]
    biases = REPEAT_BIASES if family == "rank" else PROB_BIASES
    return [(p, a, x, b) for p in range(len(weights)) for a in AGE_WEIGHTS for x in xs for b in biases]


def candidate_figures(d: dict, family: str, candidate: tuple, tops: dict | None = None) -> np.ndarray:
    """[S, 3] figures of one candidate on one night's rows."""
    p, a, x, b = candidate
    known, known_target = (tops or {}).get(a) or _known_top(d, a)
    return _figures(d, known + b, known_target, _new_scores(family, d, p, x), d["new_target"][p])


def ndcg_sums(rows: dict[str, dict], family: str) -> tuple[np.ndarray, list[tuple]]:
    """([G, nights] each candidate's NDCG@10 sum over each night's rows, the candidates)."""
    cands = grid(family, next(iter(rows.values()))["weights"])
    sums = np.zeros((len(cands), len(rows)))
    for n, d in enumerate(rows.values()):
        tops = {a: _known_top(d, a) for a in AGE_WEIGHTS}
        for g, cand in enumerate(cands):
            sums[g, n] = candidate_figures(d, family, cand, tops)[:, 0].sum()
    return sums, cands


def job_figures(d: dict) -> np.ndarray:
    blend = d["blend"]
    p = d["weights"].index(blend.popularity_weight)
    if blend.masks_known:
        known, target = _known_top(d, 0.0)
        return _figures(d, np.full_like(known, -np.inf), target, _new_scores("rank", d, p, 1.0), d["new_target"][p])
    known, target = _known_top(d, blend.age_weight)
    return _figures(d, known + blend.repeat_bias, target, _new_scores("rank", d, p, blend.new_rank_weight),
                    d["new_target"][p])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="a finished `recsys backtest`'s --work directory")
    parser.add_argument("--cache", type=Path, help="where each night's rows are kept (default WORK/blend_families)")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = build_rows(args.work, trained_models(args.work), args.cache or args.work / "blend_families")
    nights = list(rows)
    per_row: dict[str, np.ndarray] = {"job": np.concatenate([job_figures(rows[n]) for n in nights[1:]])}
    chosen: dict[str, list] = {}
    sizes = np.array([len(rows[n]["targets"]) for n in nights])
    for family in FAMILIES:
        sums, cands = ndcg_sums(rows, family)
        before, ceiling, picks = [], [], []
        for i in range(1, len(nights)):
            pick = int((sums[:, :i].sum(1) / sizes[:i].sum()).argmax())
            before.append(candidate_figures(rows[nights[i]], family, cands[pick]))
            ceiling.append(candidate_figures(rows[nights[i]], family, cands[int(sums[:, i].argmax())]))
            p, a, x, b = cands[pick]
            picks.append(f"{nights[i]}: prior {rows[nights[i]]['weights'][p]:g}, age {a:g}, new {x}, bias {b:g}")
        per_row[f"{family}, nights before"] = np.concatenate(before)
        per_row[f"{family}, the night itself"] = np.concatenate(ceiling)
        chosen[family] = picks
    night_of = np.concatenate([[n] * len(rows[n]["targets"]) for n in nights[1:]])
    draws = TwoWayDraws(np.arange(len(night_of)), night_of, args.resamples, args.seed)
    base = draws.means_many(per_row["rank, nights before"])
    names = ("ndcg_at_10", "hr_at_10", "hr_at_10_new")
    rows_new = int(np.isfinite(per_row["job"][:, 2]).sum())
    result = {"nights": nights[1:], "rows": len(night_of), "rows_with_new": rows_new, "figures": {}, "chosen": chosen}
    print(f"\n{len(nights) - 1} nights ({nights[1]}..{nights[-1]}), {len(night_of):,} (user, night) rows, {rows_new:,} "
          f"with an item new to the user; differences to the rank family chosen on the nights before")
    print(f"{'blend':32s} {'NDCG@10':>8s} {'HR@10':>7s} {'HR new':>7s}   NDCG@10 diff [95%]         HR@10 diff [95%]"
          f"           HR@10 new diff [95%]")
    for name, values in per_row.items():
        diff = draws.means_many(values) - base
        means = np.nanmean(values, 0)
        deltas = [(float(means[c] - np.nanmean(per_row["rank, nights before"][:, c])), *interval(diff[:, c]))
                  for c in range(3)]
        result["figures"][name] = {**{n: float(means[c]) for c, n in enumerate(names)},
                                   **{f"{n}_diff": deltas[c] for c, n in enumerate(names)}}
        print(f"{name:32s} {means[0]:8.4f} {means[1]:7.4f} {means[2]:7.4f}   "
              + "   ".join(f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]" for d in deltas))
    for family, picks in chosen.items():
        print(f"  {family}, chosen on the nights before: " + "; ".join(picks))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
