"""How many hits on new items can the job's lists hold while keeping their hits overall? The frontier, with the
model's ranking of new items as it is and with EASE's item-to-item scores added to it.

    python benchmarks/new_item_frontier.py --work BACKTEST_WORK [--ease 0 16 64] [--floor 0.79 0.80]
        [--cache DIR] [--json PATH]

Why: issue-style targets ask for two things at once on a log with returning users: HR@10 over every next-day item
at least the best baseline's, and HR@10 over the items new to the user well above masked baselines'. The lists hold
ten places; known items take some. This measures the trade-off the blend can reach, on the rows each backtest night's
lists met (:mod:`blend_choice`'s honest rows: the night's users, their histories before it, what they had on it, new
items ranked by the model trained for that night), with the new items ranked by the model plus the popularity prior
(each weight of the run's ``train.repeats.popularity_weights``) plus ``c`` times EASE's scores (lambda 200, fitted on
every user's distinct items before the night; ``c`` = 0: the job's ranking today;
:mod:`new_page_fusion` measures the rankings alone).

For each ``c``, over the nights after the first: the blend the grid chooses on the nights before (best NDCG@10, as
the job chooses by default; and best HR@10, ties by NDCG@10, ``train.repeats.objective: hr_at_10``), and, for each
``--floor``, the most HR@10 over new items any blend of the grid gives while its
HR@10 over every item stays at or above the floor (the grid: the job's repeat biases, age and rank weights, and
the prior's weights). Figures from the fit's own arithmetic (:func:`recsys.model.repeats.blend_sums`).

Spark reads the events and writes the rows (the job's own code), pyarrow reads the events for EASE (a local
path); numpy inverts an items x items matrix (a measurement for catalogs of a few thousand items). About a minute
a night on 2 cores at 1,000 items; rows kept under ``--cache`` (default ``BACKTEST_WORK/new_item_frontier``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import pickle
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from blend_choice import grid_sums, honest_nights, row_figures, run_config, trained_models  # noqa: E402
from recsys.model.repeats import BlendValidation, blend_grid, choose_blend  # noqa: E402

LAMBDA = 200.0


def ease_weights(events, before: dt.date, vocab) -> np.ndarray:
    """EASE's [N + 1, N + 1] item-to-item weights (model indices, 0 padding) from every user's distinct items
    before ``before``."""
    import pandas as pd

    past = events[events.ts < pd.Timestamp(before)].drop_duplicates(["user_id", "item_id"])
    index = vocab.index_of(past.item_id.to_numpy())
    keep = index > 0
    users = pd.factorize(past.user_id[keep])[0]
    matrix = np.zeros((users.max() + 1, len(vocab) + 1))
    matrix[users, index[keep]] = 1.0
    precision = np.linalg.inv(matrix.T @ matrix + LAMBDA * np.eye(len(vocab) + 1))
    weights = -precision / np.diag(precision)[None, :]
    np.fill_diagonal(weights, 0.0)
    return weights


def rank_new_targets(model, vocab, chunk, prior, ease, combos) -> np.ndarray:
    """[len(combos), rows, T] ranks (0 = best, among the items the user does not know) of each row's new targets
    under the model's scores + p * prior + c * EASE for each (p, c) of ``combos``; inf where padded."""
    import torch

    from recsys.sequences import pad_left

    hist, _ = vocab.map_sequences(chunk.histories)
    targets = vocab.index_of(chunk.targets.items)
    row_of = np.repeat(np.arange(chunk.rows), chunk.targets.lengths)
    with torch.no_grad():
        scores = model.encode(torch.from_numpy(pad_left(hist, model.max_len))).float() @ \
            model.item_embeddings().detach().float().T                                         # [rows, N + 1]
    known = torch.zeros(scores.shape, dtype=torch.bool)
    for r in range(chunk.rows):
        known[r, torch.from_numpy(hist.items[hist.offsets[r]:hist.offsets[r + 1]])] = True
    known[:, 0] = True
    co = known.float() @ ease                                                                  # [rows, N + 1]
    new_t = [[t for t in targets[row_of == r] if t > 0 and not known[r, t]] if hist.lengths[r] else []
             for r in range(chunk.rows)]
    out = np.full((len(combos), chunk.rows, max(1, max(len(t) for t in new_t))), np.inf)
    for k, (p, c) in enumerate(combos):
        ranked = (scores + p * prior[None, :] + c * co).masked_fill(known, float("-inf"))
        for r, ts in enumerate(new_t):
            for j, t in enumerate(ts):
                out[k, r, j] = float((ranked[r] > ranked[r, t]).sum())
    return out


def build_rows(work: Path, models: dict[dt.date, Path], cs: tuple[float, ...], cache: Path) -> dict:
    """{night: [BlendValidation]} whose ``popularity_weights`` slots are the (p, c) combos' indices."""
    key = "-".join(f"{c:g}" for c in cs)
    cache.mkdir(parents=True, exist_ok=True)
    missing = [n for n in models if not (cache / f"{n}-c{key}.pkl").is_file()]
    if missing:
        import pyarrow.dataset as ds
        import torch

        from recsys.learning.repeats import validation_chunks
        from recsys.model.repeats import rank_validation_days

        cfg = run_config(work)
        events = ds.dataset(cfg.paths.events, format="parquet", partitioning="hive").to_table(
            columns=["user_id", "item_id", "ts"]).to_pandas()
        if events.ts.dt.tz is not None:
            events["ts"] = events.ts.dt.tz_convert("UTC").dt.tz_localize(None)
        combos = [(float(p), float(c)) for c in cs for p in cfg.train.repeats.popularity_weights]
        for n in honest_nights(cfg, models, missing, cache):
            night, days, vocab, loaded = n.night, n.days, n.vocab, n.model
            model = loaded.model.eval()
            prior = torch.as_tensor(n.prior, dtype=torch.float32)
            ease = torch.as_tensor(ease_weights(events, night, vocab), dtype=torch.float32)
            chunks = []
            for chunk in validation_chunks(days.rows):
                known_side = rank_validation_days(model, loaded.item_ids, chunk)      # its new ranks replaced below
                ranks = rank_new_targets(model, vocab, chunk, prior, ease, combos)
                chunks.append(replace(known_side, new_target_ranks=ranks,
                                      popularity_weights=tuple(float(k) for k in range(len(combos)))))
            (cache / f"{night}-c{key}.pkl").write_bytes(pickle.dumps({"chunks": chunks, "combos": combos}))
            print(f"{night}: {sum(c.samples for c in chunks):,} rows", flush=True)
    return {n: pickle.loads((cache / f"{n}-c{key}.pkl").read_bytes()) for n in models}


def new_only(v: BlendValidation) -> BlendValidation:
    """The rows with an item new to the user, their known targets taken out: hits are hits on new items."""
    keep = v.known_target.sum(1) < v.targets
    return replace(v, known_counts=v.known_counts[keep], known_ages=v.known_ages[keep],
                   known_target=np.zeros_like(v.known_target[keep]), new_target_ranks=v.new_target_ranks[:, keep],
                   targets=v.targets[keep], known_index=None if v.known_index is None else v.known_index[keep])


def frontier(rows: dict, c: float, floors: tuple[float, ...]) -> dict:
    nights = list(rows)
    combos = rows[nights[0]]["combos"]
    slots = tuple(float(k) for k, (_, cc) in enumerate(combos) if cc == c)
    grid = blend_grid(popularity_weights=slots)
    sums = {n: grid_sums(rows[n]["chunks"], grid) for n in nights}
    chosen: dict[str, list] = {"ndcg_at_10": [], "hr_at_10": []}
    for i in range(1, len(nights)):
        before = sums[nights[0]]
        for n in nights[1:i]:
            before = before.add(sums[n])
        for objective, figures in chosen.items():
            figures.append(row_figures(rows[nights[i]]["chunks"], choose_blend(before, objective)))
    hits = sum(sums[n].hits for n in nights[1:])
    n_rows = sum(sums[n].rows for n in nights[1:])
    new_hits = np.zeros(len(grid))
    new_rows = 0
    for n in nights[1:]:
        s = grid_sums([new_only(v) for v in rows[n]["chunks"]], grid)
        new_hits, new_rows = new_hits + s.hits, new_rows + s.rows
    hr, hr_new = hits / n_rows, new_hits / new_rows
    best = {}
    for floor in floors:
        ok = np.flatnonzero(hr >= floor)
        g = int(ok[np.argmax(hr_new[ok])]) if len(ok) else None
        best[floor] = None if g is None else {"hr_at_10": float(hr[g]), "hr_at_10_new": float(hr_new[g]),
                                              "blend": repr(replace(grid[g], figures={}, popularity_weight=combos[
                                                  int(grid[g].popularity_weight)][0]))}
    chosen = {objective: np.concatenate(figures) for objective, figures in chosen.items()}
    return {"chosen_for": {objective: {"ndcg_at_10": float(f[:, 0].mean()), "hr_at_10": float(f[:, 1].mean()),
                                       "hr_at_10_new": float(np.nanmean(f[:, 2]))} for objective, f in chosen.items()},
            "most_new_at_floor": best, "rows": int(n_rows), "rows_with_new": int(new_rows)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="a finished `recsys backtest`'s --work directory")
    parser.add_argument("--ease", type=float, nargs="+", default=[0.0, 16.0, 64.0],
                        help="EASE's weights c to rank new items with (0: the model and the prior alone)")
    parser.add_argument("--floor", type=float, nargs="+", default=[0.79, 0.80],
                        help="HR@10 over every item the lists must keep (e.g. the best baseline's, less 0.01)")
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cs = tuple(sorted(set(args.ease)))
    rows = build_rows(args.work, trained_models(args.work), cs, args.cache or args.work / "new_item_frontier")
    result = {}
    for c in cs:
        r = result[c] = frontier(rows, c, tuple(args.floor))
        line = f"c {c:g}: chosen on the nights before"
        for objective, f in r["chosen_for"].items():
            line += (f" for {objective}: NDCG@10 {f['ndcg_at_10']:.4f}, HR@10 {f['hr_at_10']:.4f}, HR@10 new "
                     f"{f['hr_at_10_new']:.4f};")
        for floor, best in r["most_new_at_floor"].items():
            line += (f" most new at HR@10 >= {floor:g}: " + ("none" if best is None else
                     f"{best['hr_at_10_new']:.4f} (HR@10 {best['hr_at_10']:.4f})") + ";")
        print(line.rstrip(";"), flush=True)
    nights = list(rows)
    print(f"nights {nights[1]}..{nights[-1]}: {result[cs[0]]['rows']:,} (user, night) rows, "
          f"{result[cs[0]]['rows_with_new']:,} with an item new to the user")
    if args.json:
        args.json.write_text(json.dumps({f"{c:g}": r for c, r in result.items()}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
