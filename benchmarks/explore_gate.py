"""Would a per-user explore gate help the repeat blend? Measured on a finished backtest's honest rows.

    python benchmarks/explore_gate.py --work BACKTEST_WORK [--weights 0 0.25 0.5 1 1.5 2] [--objective ndcg_at_10]

The job's blend weighs a user's known items against new ones with the same weights for every user
(:mod:`recsys.model.repeats`). A gate as RepeatNet learns it would give users who often take new items more new
places, and users who come back to what they know fewer. The simplest such gate from what a history holds: each
user's share of new items, ``p = (distinct items + 1) / (events + 2)`` over the history's known items (an item's
first event in the window was new to the user then), and ``- e * logit(p)`` added to the user's known items'
scores: an explorer's known items sink below their new ones, a returning user's rise. ``e = 0`` is the job's blend.

The rows are ``benchmarks/blend_choice.py``'s (each night's own users, their new items ranked by the model that
served the night: honest), built and cached the same way under ``BACKTEST_WORK/blend_choice``. For each night from
the second on, the blend is chosen on every night before it (the grid, for each ``e``; with ``--weights 0`` alone,
the job's form) and scored on the night: NDCG@10, HR@10, HR@10 over items new to the user, as
:func:`recsys.model.repeats.blend_sums` computes them. Also: how many known items the rows with a new item have,
which bounds what a gate can move (a user with two known items has eight places for new ones whatever the gate).

The shift is folded into the rows rather than into the fit: each row's counts times ``exp(-e * logit(p) + C)`` and
the grid's repeat biases minus ``C`` (``C`` keeps every count at 1 or more, where the fit clips) score exactly as
the shifted blend would.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from blend_choice import _rows, grid_sums, honest_rows, trained_models  # noqa: E402
from recsys.model.repeats import (OBJECTIVES, REPEAT_BIASES, BlendSums, BlendValidation, blend_grid,  # noqa: E402
                                  choose_blend)


def explore_logit(v: BlendValidation) -> np.ndarray:
    """[S] ``logit(p)``, ``p`` each row's share of new items among its known items' events (see the docstring)."""
    present = v.known_counts > 0
    p = (present.sum(1) + 1.0) / (v.known_counts.sum(1) + 2.0)
    return np.log(p) - np.log1p(-p)


def shifted(v: BlendValidation, e: float, offset: float) -> BlendValidation:
    """``v`` with each row's known counts times ``exp(-e * logit(p) + offset)``: its log counts shifted."""
    scale = np.exp(-e * explore_logit(v) + offset)[:, None]
    return replace(v, known_counts=np.where(v.known_counts > 0, v.known_counts * scale, 0.0))


def new_rows_only(v: BlendValidation) -> BlendValidation:
    """The rows with an item new to the user, their known targets taken out: hits there are hits on new items."""
    rows = _rows(v, v.known_target.sum(1) < v.targets)
    return replace(rows, known_target=np.zeros_like(rows.known_target))


def total(chunks: list[BlendValidation], grid, e: float, offset: float) -> BlendSums:
    return grid_sums([shifted(v, e, offset) for v in chunks], grid)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="a finished `recsys backtest`'s --work directory")
    parser.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--objective", choices=OBJECTIVES, default="ndcg_at_10")
    args = parser.parse_args(argv)
    rows = honest_rows(args.work, trained_models(args.work), args.work / "blend_choice")
    nights = list(rows)
    chunks = {n: rows[n]["chunks"] for n in nights}
    rankings = set.intersection(*(set(chunks[n][0].rankings) for n in nights))
    # the largest shift any row takes, so that every shifted count stays at 1 or more
    offset = max(float(np.abs(explore_logit(v)).max(initial=0.0)) for n in nights for v in chunks[n]) * max(
        abs(e) for e in args.weights)
    grid = blend_grid(biases=tuple(b - offset for b in REPEAT_BIASES),
                      popularity_weights=sorted({p for p, _ in rankings}),
                      item_to_item_weights=sorted({c for _, c in rankings}))
    sums = {n: {e: total(chunks[n], grid, e, offset) for e in args.weights} for n in nights}

    def key(blend):
        f = blend.figures
        return (f["hr_at_10"], f["ndcg_at_10"]) if args.objective == "hr_at_10" else (f["ndcg_at_10"],)

    print(f"{len(nights) - 1} nights ({nights[1]}..{nights[-1]}), each chosen on the nights before, for "
          f"{args.objective}")
    print(f"{'gate weights':24s} {'NDCG@10':>8s} {'HR@10':>8s} {'HR@10 new':>10s}   chosen e by night")
    for label, weights in (("e = 0 (the job's form)", [0.0]), (f"e in {args.weights}", args.weights)):
        figures, picks = np.zeros(5), []
        for i, night in enumerate(nights[1:], 1):
            best = None
            for e in weights:
                before = sums[nights[0]][e]
                for n in nights[1:i]:
                    before = before.add(sums[n][e])
                blend = choose_blend(before, args.objective)
                if best is None or key(blend) > key(best[1]):
                    best = (e, blend)
            e, blend = best[0], replace(best[1], figures={})
            every = total(chunks[night], (blend,), e, offset)
            new = grid_sums([new_rows_only(shifted(v, e, offset)) for v in chunks[night]], (blend,))
            figures += [every.ndcg[0], every.hits[0], every.rows, new.hits[0], new.rows]
            picks.append(e)
        print(f"{label:24s} {figures[0] / figures[2]:8.4f} {figures[1] / figures[2]:8.4f} "
              f"{figures[3] / figures[4]:10.4f}   {picks}")
    known = np.concatenate([(new_rows_only(v).known_counts > 0).sum(1) for n in nights[1:] for v in chunks[n]])
    print(f"rows with a new item: {len(known):,}; their known items (model-known, up to the history's) "
          f"median {np.median(known):.0f}, 75th percentile {np.percentile(known, 75):.0f}, "
          f"{(known >= 10).mean():.0%} with 10 or more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
