"""Is the repeat blend chosen well? Its choice at training against choices made on honest rows, scored the day after.

    python benchmarks/blend_choice.py --work BACKTEST_WORK [--cache DIR] [--resamples 2000] [--json PATH]

``BACKTEST_WORK`` is the ``--work`` directory of a finished ``recsys backtest`` (it keeps each night's trained model
and the run's configuration). Why: training chooses the blend's weights (:mod:`recsys.model.repeats`) on validation
rows whose new items are ranked by the selection model, which trained on those very days (each user's newest item
aside), so new items may look better there than they are the night after, and the weights chosen there may not be
the next day's best.

For each night D of the backtest: the rows of day D (the users active on D with a history before it, their history,
what they had on D), the new items ranked by the model trained for night D (events before D, the model whose lists
met day D), the popularity prior from the day before: honest rows, what night D's lists met. Each night from the
second on, four blends are scored on them:

- ``job``: the blend night D's training chose (saved with its model);
- ``previous night``: the grid's best on night D-1's honest rows;
- ``nights before``: the grid's best on the honest rows of every night before D;
- ``the night itself``: the grid's best on night D's own rows (a ceiling, not a policy: chosen on what it is
  scored on).

Figures per (user, night) row: NDCG@10 and HR@10 over the day's items, and HR@10 over the items new to the user
(rows with one), computed from the ranks as the fit computes them (:func:`recsys.model.repeats.blend_sums`: the
model's ranks among every item the user does not know, not only the catalog's available ones, so close to, not
exactly, the backtest's lists). Differences to ``job`` with 95% intervals from a two-way bootstrap over rows and
nights (each (user, night) row counts as its own user: the rows carry no user id).

Spark reads the events (the job's own code writes the rows); the rows of each night are kept under ``--cache``
(default ``BACKTEST_WORK/blend_choice``), so a rerun only scores. Minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import pickle
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recsys.evaluation.report import TwoWayDraws, interval  # noqa: E402
from recsys.learning.repeats import describe  # noqa: E402  (the training log's words for a blend)
from recsys.model.repeats import BlendValidation, RepeatBlend, blend_grid, blend_sums, choose_blend  # noqa: E402

POLICIES = ("job", "previous night", "nights before", "the night itself")


def trained_models(work: Path) -> dict[dt.date, Path]:
    """Each night's model directory, from the backtest's MLflow store (the training runs' ``date`` param)."""
    store = work / "mlflow.db"
    if not store.is_file():
        raise SystemExit(f"{work} holds no MLflow store ({store}): give the --work of a finished `recsys backtest`")
    with sqlite3.connect(store) as db:
        runs = db.execute("select p.value, r.run_uuid from runs r join params p on p.run_uuid = r.run_uuid "
                          "where p.key = 'date' and r.name like 'train %'").fetchall()
    models = {dt.date.fromisoformat(day): work / f"mlartifacts/{run}/artifacts/model" for day, run in runs}
    models = {day: path for day, path in models.items() if (path / "repeats.json").is_file()}
    if len(models) < 2:
        raise SystemExit(f"{work} holds {len(models)} trained model(s) with a repeat blend; this needs two nights "
                         "or more")
    return dict(sorted(models.items()))


def honest_rows(work: Path, models: dict[dt.date, Path], cache: Path) -> dict[dt.date, dict]:
    """{night: {"chunks": [BlendValidation], "blend": the job's RepeatBlend}}, built once per night under ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [night for night in models if not (cache / f"{night}.pkl").is_file()]
    if missing:
        _build(work, models, missing, cache)
    return {night: pickle.loads((cache / f"{night}.pkl").read_bytes()) for night in models}


@dataclass(frozen=True)
class HonestNight:
    """One backtest night as its lists met it: the night's own (user, day) rows written by the job's
    ``write_validation_days`` (with the days' user counts), the model trained for the night and its blend, and the
    night's popularity prior per model index (column 0 padding)."""

    night: dt.date
    days: Any            # recsys.learning.repeats.BlendDays
    model: Any           # recsys.model.io.LoadedModel
    vocab: Any           # recsys.sequences.Vocabulary of the model
    blend: RepeatBlend
    prior: np.ndarray    # [N + 1] popularity_prior of the users of the day before the night


def run_config(work: Path):
    """The backtest run's configuration, its blend days narrowed to the one day before the date and every user of it
    (the night's own rows)."""
    from recsys.config import load_config

    conf = next(iter(sorted(work.glob("mlartifacts/*/artifacts/config.yaml"))), None)
    if conf is None:
        raise SystemExit(f"{work} holds no run configuration (mlartifacts/*/artifacts/config.yaml)")
    return load_config(conf, ["train.repeats.validation_days=1", "train.repeats.max_rows=10000000"])


def honest_nights(cfg, models: dict[dt.date, Path], nights: list[dt.date], cache: Path) -> Iterator[HonestNight]:
    """Each of ``nights`` as :class:`HonestNight`, its rows written under ``cache/rows-NIGHT`` by Spark."""
    from recsys.learning.repeats import write_validation_days
    from recsys.learning.shards import training_events, training_window
    from recsys.model.io import load_model
    from recsys.sequences import Vocabulary
    from recsys.spark.session import build_session

    spark = build_session(cfg.spark)
    for night in nights:
        after = night + dt.timedelta(days=1)
        with training_window(spark, cfg, after) as kept:
            days = write_validation_days(training_events(spark, cfg, after, kept), cfg, after,
                                         str(cache / f"rows-{night}"))
        loaded = load_model(models[night])
        vocab = Vocabulary(loaded.item_ids)
        start_us = int(dt.datetime.combine(night, dt.time(), dt.timezone.utc).timestamp() * 1e6)
        yield HonestNight(night, days, loaded, vocab,
                          RepeatBlend.from_json((models[night] / "repeats.json").read_text()),
                          days.recent.prior_by_day(np.array([start_us]), vocab)[0])


def _build(work: Path, models: dict[dt.date, Path], nights: list[dt.date], cache: Path) -> None:
    from recsys.learning.repeats import validation_chunks
    from recsys.model.repeats import rank_validation_days

    cfg = run_config(work)
    weights = cfg.train.repeats.popularity_weights
    for n in honest_nights(cfg, models, nights, cache):
        # the night's item-to-item weights (fitted on the events before it: honest), saved where its blend weighs them
        i2i = n.model.item_to_item
        i2i_weights = cfg.train.repeats.item_to_item.weights if i2i is not None else (0.0,)
        chunks = [rank_validation_days(n.model.model, n.model.item_ids, chunk, recent=n.days.recent,
                                       popularity_weights=weights, item_to_item=i2i, item_to_item_weights=i2i_weights)
                  for chunk in validation_chunks(n.days.rows)]
        (cache / f"{n.night}.pkl").write_bytes(pickle.dumps({"chunks": chunks, "blend": n.blend}))
        print(f"{n.night}: {sum(c.samples for c in chunks):,} rows, the job's blend {n.blend}", flush=True)


def _rows(v: BlendValidation, keep) -> BlendValidation:
    return replace(v, known_counts=v.known_counts[keep], known_ages=v.known_ages[keep],
                   known_target=v.known_target[keep], new_target_ranks=v.new_target_ranks[:, keep],
                   targets=v.targets[keep], known_index=None if v.known_index is None else v.known_index[keep])


def row_figures(chunks: list[BlendValidation], blend: RepeatBlend) -> np.ndarray:
    """[rows, 3]: NDCG@10, HR@10, and HR@10 over the new items (NaN on a row without one) of ``blend``'s list."""
    blend = replace(blend, figures={})
    out = []
    for v in chunks:
        has_new = v.known_target.sum(1) < v.targets
        for r in range(v.samples):
            row = _rows(v, slice(r, r + 1))
            every = blend_sums(row, (blend,))
            new = np.nan
            if has_new[r]:   # hits on new items only: the known targets taken out
                new = blend_sums(replace(row, known_target=np.zeros_like(row.known_target)), (blend,)).hits[0]
            out.append((every.ndcg[0], every.hits[0], new))
    return np.array(out)


def grid_sums(chunks: list[BlendValidation], candidates):
    total = blend_sums(BlendValidation.empty(), candidates)
    for v in chunks:
        total = total.add(blend_sums(v, candidates))
    return total


def compare(rows: dict[dt.date, dict], resamples: int, seed: int) -> dict:
    nights = list(rows)
    # the rankings every night's rows were ranked under: item-to-item weights only where every night's model has them
    common = set.intersection(*(set(rows[n]["chunks"][0].rankings) for n in nights))
    grid = blend_grid(popularity_weights=sorted({p for p, _ in common}),
                      item_to_item_weights=sorted({c for _, c in common}))
    sums = {night: grid_sums(rows[night]["chunks"], grid) for night in nights}
    figures = {p: [] for p in POLICIES}
    chosen = {p: {} for p in POLICIES}
    night_of = []
    for i, night in enumerate(nights[1:], 1):
        before = sums[nights[0]]
        for n in nights[1:i]:
            before = before.add(sums[n])
        blends = {"job": rows[night]["blend"], "previous night": choose_blend(sums[nights[i - 1]]),
                  "nights before": choose_blend(before), "the night itself": choose_blend(sums[night])}
        for policy, blend in blends.items():
            figures[policy].append(row_figures(rows[night]["chunks"], blend))
            chosen[policy][str(night)] = describe(blend)
        night_of += [str(night)] * len(figures["job"][-1])
    per_row = {p: np.concatenate(f) for p, f in figures.items()}
    draws = TwoWayDraws(np.arange(len(night_of)), np.array(night_of), resamples, seed)
    names = ("ndcg_at_10", "hr_at_10", "hr_at_10_new")
    job = draws.means_many(per_row["job"])
    result = {"nights": nights[1:], "rows": len(night_of),
              "rows_with_new": int(np.isfinite(per_row["job"][:, 2]).sum()), "policies": {}}
    for policy in POLICIES:
        values = per_row[policy]
        diff = draws.means_many(values) - job
        result["policies"][policy] = {
            "chosen": chosen[policy],
            **{name: float(np.nanmean(values[:, c])) for c, name in enumerate(names)},
            **{f"{name}_minus_job": (float(np.nanmean(values[:, c]) - np.nanmean(per_row["job"][:, c])),
                                     *interval(diff[:, c])) for c, name in enumerate(names)}}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="a finished `recsys backtest`'s --work directory")
    parser.add_argument("--cache", type=Path,
                        help="where each night's honest rows are kept (default WORK/blend_choice)")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    models = trained_models(args.work)
    rows = honest_rows(args.work, models, args.cache or args.work / "blend_choice")
    result = compare(rows, args.resamples, args.seed)
    print(f"\n{len(result['nights'])} nights ({result['nights'][0]}..{result['nights'][-1]}), {result['rows']:,} "
          f"(user, night) rows, {result['rows_with_new']:,} with an item new to the user")
    print(f"{'blend chosen on':18s} {'NDCG@10':>8s} {'HR@10':>8s} {'HR@10 new':>10s}   HR@10 - job [95%]"
          f"          HR@10 new - job [95%]")
    for policy, r in result["policies"].items():
        hr, new = r["hr_at_10_minus_job"], r["hr_at_10_new_minus_job"]
        print(f"{policy:18s} {r['ndcg_at_10']:8.4f} {r['hr_at_10']:8.4f} {r['hr_at_10_new']:10.4f}   "
              f"{hr[0]:+.4f} [{hr[1]:+.4f}, {hr[2]:+.4f}]   {new[0]:+.4f} [{new[1]:+.4f}, {new[2]:+.4f}]")
    for policy, r in result["policies"].items():
        print(f"  {policy}: " + "; ".join(f"{night} {what}" for night, what in r["chosen"].items()))
    if args.json:
        args.json.write_text(json.dumps({**result, "nights": [str(n) for n in result["nights"]]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
