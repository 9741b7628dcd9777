"""New items within a day (issue 20, part 3): what the nightly job can recommend from a catalog that
changes every day, with the model registered as before (held out) and as now (refit).

Why: `recsys train` used to register the model fitted with each user's newest item held out, so an
item whose only interactions were someone's newest one (typically an item launched yesterday) was not
in its vocabulary and could not be recommended the next night. With ``train.refit: true`` (the
default) training fits once more on every interaction before the date, and those items enter the
vocabulary. This script measures the difference on the synthetic shop (``recsys sample-data``: new
items launch on later days with the highest ids, some retire, one catalog snapshot a day):

1. generate the sample data (or reuse a dataset with ``--reuse``) whose last event day is D - 1;
2. train at D twice, ``train.refit=false`` ("before") and ``train.refit=true`` ("after"), each under
   its own model name in one throw-away sqlite MLflow store, with its own output path;
3. run the nightly job for D with each (the project's ``run_training`` and ``run_nightly``);
4. from each published partition ``dt=D/`` and the catalog partitions (pyarrow only), report: the
   items available in the snapshot the job used and the share the model knows; the items that
   entered the catalog in the last ``--new-days`` days (first listed as available in a snapshot on or
   after D - 7) and the share of those it knows; the share of recommendation slots, of distinct
   recommended items and of users whose list holds such new items; users scored; training seconds.

    PYTHONPATH=. .venv/bin/python benchmarks/new_items.py [--users 2000 --items 3000 --days 30]
        [--end-date 2026-11-30] [--set train.epochs=10 ...] [--json out.json] [--work DIR --keep]

On a machine whose cores are busy with something else, prefix ``OMP_NUM_THREADS=1``: torch's CPU
threads wait on each other at every step, and an epoch that takes 2 s on idle cores took up to 200 s
with two threads competing against another process; with one thread it took about 3 s, and the
figures came out identical.

The figures are cross-checked against the job's own: the known available items must equal the
run's ``catalog_candidate_items``, the partition's rows and slots its counts. The training settings are
the project's embedded defaults (at most 40 epochs, early stopping with patience 10, SASRec dim 64:
about 3 minutes for both variants on 2 cores) and any ``--set``; the output states them.
"""
from __future__ import annotations

import argparse
import hashlib
import datetime as dt
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NEW_DAYS = 7
VARIANTS: tuple[tuple[str, bool], ...] = (("before", False), ("after", True))   # (label, train.refit)


# --------------------------------------------------------------------------- the figures (pure)


def first_available(snapshots: Sequence[tuple[dt.date, pa.Table]]) -> pa.Table:
    """``item_id``, ``first_available`` (date): the first snapshot in which each item was listed as available.

    ``snapshots``: (date, table with ``item_id`` and ``available``) in any order; items never available
    are absent. A null ``available`` counts as not available (as the job reads it).
    """
    parts = []
    for date, table in snapshots:
        available = table.filter(pc.fill_null(table.column("available"), False))
        ids = available.column("item_id").cast(pa.int64())
        parts.append(pa.table({"item_id": ids, "first_available": pa.array([date] * len(ids), type=pa.date32())}))
    if not parts:
        return pa.table({"item_id": pa.array([], pa.int64()), "first_available": pa.array([], pa.date32())})
    grouped = pa.concat_tables(parts).group_by("item_id").aggregate([("first_available", "min")])
    return grouped.rename_columns(["item_id", "first_available"]).sort_by("item_id")


def new_item_figures(snapshot: pa.Table, first_seen: pa.Table, known_items: np.ndarray, recommendations: pa.Table,
                     since: dt.date, interacted_items: np.ndarray | None = None) -> dict[str, Any]:
    """How much of one catalog snapshot a model knows, and how much of a night's lists is new items.

    ``snapshot``: the catalog snapshot the night used (``item_id``, ``available``); ``first_seen``: the
    output of :func:`first_available` over the snapshots up to it; ``known_items``: the model's item
    vocabulary (external ids); ``recommendations``: the published partition (``user_id``,
    ``recommendations`` = list of {``item_id``, ``score``}); ``since``: an item is *new* when it was
    first available on or after this date (and is available in ``snapshot``). ``interacted_items``: the
    items with an event in the training window, if given: the most a model trained on it can know (an
    item nobody touched is in no vocabulary). Shares are None when there is nothing to divide by.
    """
    available = np.unique(snapshot.filter(pc.fill_null(snapshot.column("available"), False))
                          .column("item_id").to_numpy().astype(np.int64))
    known = np.unique(np.asarray(known_items, dtype=np.int64))
    firsts = first_seen.column("first_available").cast(pa.date32())
    new_ids = first_seen.column("item_id").to_numpy().astype(np.int64)[
        np.asarray(pc.greater_equal(firsts, pa.scalar(since, pa.date32())).to_numpy(zero_copy_only=False), dtype=bool)]
    new = np.intersect1d(available, new_ids)

    lists = recommendations.column("recommendations")
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy().astype(np.int64)
    slots = pc.struct_field(pc.list_flatten(lists), "item_id").to_numpy().astype(np.int64)
    is_new = np.isin(slots, new)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    users_with_new = len(np.unique(owner[is_new]))
    distinct = np.unique(slots)
    distinct_new = np.intersect1d(distinct, new)
    known_available, known_new = np.intersect1d(available, known), np.intersect1d(new, known)
    ceiling = {}
    if interacted_items is not None:
        touched = np.unique(np.asarray(interacted_items, dtype=np.int64))
        ceiling = {"interacted_available_items": len(np.intersect1d(available, touched)),
                   "interacted_new_items": len(np.intersect1d(new, touched))}
    return {
        **ceiling,
        "available_items": len(available),
        "known_available_items": len(known_available),
        "known_available_share": _share(len(known_available), len(available)),
        "new_items": len(new),
        "known_new_items": len(known_new),
        "known_new_share": _share(len(known_new), len(new)),
        "users": recommendations.num_rows,
        "slots": len(slots),
        "new_slots": int(is_new.sum()),
        "new_slot_share": _share(int(is_new.sum()), len(slots)),
        "distinct_recommended": len(distinct),
        "distinct_new_recommended": len(distinct_new),
        "distinct_new_share": _share(len(distinct_new), len(distinct)),
        "users_with_new": users_with_new,
        "users_with_new_share": _share(users_with_new, recommendations.num_rows),
    }


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


# --------------------------------------------------------------------------- one variant, end to end


@dataclass
class VariantResult:
    label: str
    refit: bool
    model_name: str
    model_version: str
    vocabulary_items: int
    best_epoch: int
    train_s: float                    # wall seconds of run_training (reading included)
    fit_s: float                      # its stages, from the training run's MLflow metrics
    refit_s: float
    nightly_s: float
    catalog_snapshot: str
    model_users: int
    fallback_users: int
    figures: dict[str, Any] = field(default_factory=dict)          # new: first available since D - new_days
    newest_figures: dict[str, Any] = field(default_factory=dict)   # new: first available in the newest snapshot


@dataclass
class Report:
    date: str
    since: str
    new_days: int
    data: dict[str, Any]
    overrides: list[str]
    variants: list[VariantResult]
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_catalog_snapshots(catalog_root: str | Path, until: dt.date) -> list[tuple[dt.date, pa.Table]]:
    """Every catalog partition on or before ``until``: (date, ``item_id``/``available`` table), oldest first."""
    import pyarrow.dataset as ds

    from recsys.data.partitions import list_partitions

    _, parts = list_partitions(str(catalog_root), "catalog")
    return [(p.date, ds.dataset(p.path, format="parquet", partitioning=None).to_table(columns=["item_id", "available"]))
            for p in parts if p.date <= until]


def interacted_items(spark, cfg, date: dt.date) -> np.ndarray:
    """The items with an event in the training window before ``date``, read as training reads them
    (``history.window_days``, ``history.event_types``, null ids dropped): the most any vocabulary holds."""
    from recsys.data import history as hist
    from recsys.data.readers import read_events_window

    events = hist.drop_null_ids(read_events_window(spark, cfg.paths.events, date, cfg.history.window_days,
                                                   cfg.history.event_types))
    return events.select("item_id").distinct().toArrow().column("item_id").to_numpy().astype(np.int64)


def run_variant(spark, base: Sequence[str], work: Path, label: str, refit: bool, date: dt.date,
                new_days: int = NEW_DAYS, interacted: np.ndarray | None = None) -> VariantResult:
    """Train with ``train.refit=<refit>`` under its own model name and output, run the night ``date``,
    and compute the figures from what was published."""
    import pyarrow.dataset as ds
    from mlflow import MlflowClient

    from recsys.config import load_config
    from recsys.pipelines import nightly_stages
    from recsys.pipelines.nightly import run_nightly
    from recsys.pipelines.train import run_training
    from recsys.tracking import store as tracking

    root = work / label
    # a table of its own per variant and work directory (a table belongs to one output root: two variants, or a
    # session whose metastore already holds the default table elsewhere, would be refused), and the embedded
    # metastore under the work directory rather than the current directory
    table = f"recsys.new_items_{label}_{hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:10]}"
    cfg = load_config(overrides=[
        *base, f"output.table={table}", f"output.metastore.dir={work / 'metastore'}",
        f"paths.output={root / 'recommendations'}", f"paths.work={root / 'work'}",
        f"paths.driver_scratch={root / 'driver'}", f"mlflow.model_name=new-items-{label}",
        f"train.refit={str(refit).lower()}",
    ])
    started = time.perf_counter()
    trained = run_training(spark, cfg, date)
    train_s = time.perf_counter() - started
    if not trained.promoted:
        raise RuntimeError(f"{label}: the trained version {trained.version} did not take the alias: {trained.decision}")
    started = time.perf_counter()
    night = run_nightly(spark, cfg, date, force=True)
    nightly_s = time.perf_counter() - started

    stage_s = MlflowClient(cfg.mlflow.tracking_uri).get_run(trained.run_id).data.metrics
    model = tracking.resolve_model(cfg.mlflow, cfg.paths.driver_dir)     # what the night scored with
    vocab = nightly_stages.load_vocabulary(model)
    manifest = night.manifest.as_dict()
    if str(manifest["model"]["version"]) != model.version or model.version != trained.version:
        raise RuntimeError(f"{label}: the night scored version {manifest['model']['version']}, "
                           f"trained {trained.version}, the alias holds {model.version}")
    snapshot_date = dt.date.fromisoformat(manifest["catalog_snapshot"])
    snapshots = read_catalog_snapshots(cfg.paths.catalog, snapshot_date)
    partition = ds.dataset(night.output_dir, format="parquet", partitioning=None).to_table(
        columns=["user_id", "recommendations", "source"])
    firsts = first_available(snapshots)
    figures = new_item_figures(snapshots[-1][1], firsts, vocab.item_ids, partition,
                               since=date - dt.timedelta(days=new_days), interacted_items=interacted)
    newest = new_item_figures(snapshots[-1][1], firsts, vocab.item_ids, partition, since=snapshot_date,
                              interacted_items=interacted)
    check_against_the_run(label, figures, manifest)
    counts = manifest["counts"]
    return VariantResult(label=label, refit=refit, model_name=cfg.mlflow.model_name, model_version=model.version,
                         vocabulary_items=len(vocab), best_epoch=int(trained.metrics.get("best_epoch", 0)),
                         train_s=round(train_s, 1), fit_s=round(stage_s.get("stage_fit_s", 0.0), 1),
                         refit_s=round(stage_s.get("stage_refit_s", 0.0), 1), nightly_s=round(nightly_s, 1),
                         catalog_snapshot=str(snapshot_date), model_users=int(counts["model_users"]),
                         fallback_users=int(counts["fallback_users"]), figures=figures, newest_figures=newest)


def check_against_the_run(label: str, figures: Mapping[str, Any], manifest: Mapping[str, Any]) -> None:
    """The figures read from the files must agree with the job's own counts, or the table means nothing."""
    metrics, counts = manifest["metrics"], manifest["counts"]
    pairs = {"available items": (figures["available_items"], metrics["catalog_available_items"]),
             "known available items": (figures["known_available_items"], counts["candidate_items"]),
             "users": (figures["users"], counts["rows"]),
             "recommendation slots": (figures["slots"], metrics["recommended_items"]),
             "distinct recommended items": (figures["distinct_recommended"], metrics["distinct_items_recommended"])}
    wrong = {k: v for k, v in pairs.items() if int(v[0]) != int(v[1])}
    if wrong:
        raise RuntimeError(f"{label}: figures from the files disagree with the run's manifest: {wrong}")


def run_benchmark(spark, data: Path, work: Path, date: dt.date, overrides: Sequence[str] = (),
                  new_days: int = NEW_DAYS, data_summary: Mapping[str, Any] | None = None) -> Report:
    """Both variants on the dataset under ``data`` (``events/``, ``catalog/``), everything else under ``work``."""
    from recsys.config import load_config

    started = time.perf_counter()
    base = [f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}",
            f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}", f"mlflow.artifact_location={work / 'mlartifacts'}",
            *overrides]
    interacted = interacted_items(spark, load_config(overrides=base), date)
    variants = [run_variant(spark, base, work, label, refit, date, new_days, interacted) for label, refit in VARIANTS]
    return Report(date=str(date), since=str(date - dt.timedelta(days=new_days)), new_days=new_days,
                  data=dict(data_summary or {"path": str(data)}), overrides=list(overrides), variants=variants,
                  seconds=round(time.perf_counter() - started, 1))


# --------------------------------------------------------------------------- output


def _percent(share: float | None) -> str:
    if share is None:
        return "n/a"
    return f"{100 * share:.2f}%" if 0 < share < 0.01 else f"{100 * share:.1f}%"


def _count_share(count: int, share: float | None, of: int | None = None) -> str:
    pct = _percent(share)
    return f"{count:,} of {of:,} ({pct})" if of is not None else f"{count:,} ({pct})"


def markdown_table(report: Report) -> str:
    """The before/after table, one row per figure."""
    b, a = report.variants
    rows: list[tuple[str, str, str]] = []

    def row(name: str, fn) -> None:
        rows.append((name, fn(b), fn(a)))

    def known(figs: Mapping[str, Any], what: str) -> str:
        text = _count_share(figs[f"known_{what}_items"], figs[f"known_{what}_share"])
        ceiling = figs.get(f"interacted_{what}_items")
        return text if ceiling is None else f"{text}; {ceiling:,} have an event"

    f = lambda v, k: v.figures[k]   # noqa: E731
    n = lambda v, k: v.newest_figures[k]   # noqa: E731
    row("model vocabulary (items)", lambda v: f"{v.vocabulary_items:,}")
    row(f"items available in the catalog snapshot (dt={b.catalog_snapshot})", lambda v: f"{f(v, 'available_items'):,}")
    row("... known to the model", lambda v: known(v.figures, "available"))
    row(f"new items: available, first available on or after {report.since}", lambda v: f"{f(v, 'new_items'):,}")
    row("... known to the model", lambda v: known(v.figures, "new"))
    row(f"new items first available on {b.catalog_snapshot} (the newest snapshot)", lambda v: f"{n(v, 'new_items'):,}")
    row("... known to the model", lambda v: known(v.newest_figures, "new"))
    row("users scored (model + popularity fallback)",
        lambda v: f"{f(v, 'users'):,} ({v.model_users:,} + {v.fallback_users:,})")
    row("recommendation slots that are new items",
        lambda v: _count_share(f(v, "new_slots"), f(v, "new_slot_share"), f(v, "slots")))
    row(f"... of them items first available on {b.catalog_snapshot}",
        lambda v: _count_share(n(v, "new_slots"), n(v, "new_slot_share"), n(v, "slots")))
    row("distinct recommended items that are new",
        lambda v: _count_share(f(v, "distinct_new_recommended"), f(v, "distinct_new_share"), f(v, "distinct_recommended")))
    row("users with a new item in their list",
        lambda v: _count_share(f(v, "users_with_new"), f(v, "users_with_new_share"), f(v, "users")))
    row("epochs (chosen on held-out items)", lambda v: str(v.best_epoch))
    row("training seconds: fit with newest held out + refit on everything",
        lambda v: f"{v.fit_s + v.refit_s:.0f} ({v.fit_s:.0f} + {v.refit_s:.0f})")
    lines = [f"| recommend {report.date} | before: `train.refit=false` | after: `train.refit=true` |",
             "|---|---|---|", *(f"| {name} | {x} | {y} |" for name, x, y in rows)]
    return "\n".join(lines)


def describe(report: Report) -> str:
    data = ", ".join(f"{k}={v}" for k, v in report.data.items())
    return (f"data: {data}\n"
            f"settings: the embedded default configuration, overridden: {' '.join(report.overrides) or 'nothing'} "
            f"(besides paths, the MLflow store and model names, train.refit)\n"
            f"new items: available in the snapshot and first available in one on or after {report.since} "
            f"(the last {report.new_days} days before {report.date})\n"
            f"training seconds are the fit stages (torch); `recsys train` wall, reading included: "
            f"{', '.join(f'{v.label} {v.train_s:.0f} s' for v in report.variants)}; the nightly job: "
            f"{', '.join(f'{v.label} {v.nightly_s:.0f} s' for v in report.variants)} (the first pays Spark's warm-up)\n"
            f"total {report.seconds:.0f} s for both variants")


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--users", type=int, default=2000, help="sample users (default 2000)")
    p.add_argument("--items", type=int, default=3000, help="sample items (default 3000)")
    p.add_argument("--days", type=int, default=30, help="days of events and catalog snapshots (default 30)")
    p.add_argument("--seed", type=int, default=0, help="sample data seed (default 0)")
    p.add_argument("--end-date", type=dt.date.fromisoformat, default=dt.date(2026, 11, 30),
                   help="last event day; the night measured is the day after (default 2026-11-30)")
    p.add_argument("--new-days", type=int, default=NEW_DAYS,
                   help=f"an item is new if first available within this many days before the night (default {NEW_DAYS})")
    p.add_argument("--data", type=Path, help="where the sample data goes (default: under --work)")
    p.add_argument("--reuse", action="store_true",
                   help="use the dataset already in --data (its last events partition is the last event day)")
    p.add_argument("--work", type=Path, help="MLflow store, models and outputs (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="a configuration override for both variants (e.g. train.epochs=10), repeatable; "
                        "default: none, the project's embedded defaults")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--verbose", action="store_true", help="the project's INFO log lines too")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from recsys.config import load_config, load_launch_settings
    from recsys.logs import configure_logging
    from recsys.spark.session import build_session

    configure_logging()
    if not args.verbose:
        logging.getLogger("recsys").setLevel(logging.WARNING)
    temporary = args.work is None
    if not temporary and (args.work / "mlflow.db").exists():
        raise SystemExit(f"{args.work} holds an earlier run (mlflow.db): its model versions would face this run's "
                         f"gate; pass a new or empty --work")
    work = Path(tempfile.mkdtemp(prefix="recsys-new-items-")) if temporary else args.work
    work.mkdir(parents=True, exist_ok=True)
    data = args.data or work / "data"
    try:
        summary, end_date = _prepare_data(args, data)
        date = end_date + dt.timedelta(days=1)
        overrides = list(args.overrides or [])
        cfg = load_config(overrides=overrides)
        spark = build_session(cfg.spark, cfg.scoring.arrow_batch_size, app_name="recsys-new-items",
                              launch=load_launch_settings())
        try:
            report = run_benchmark(spark, data, work, date, overrides, args.new_days, summary)
        finally:
            spark.stop()
    finally:
        if temporary and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(describe(report))
    print()
    print(markdown_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
        print(f"\nfigures written to {args.json}")
    return 0


def _prepare_data(args: argparse.Namespace, data: Path) -> tuple[dict[str, Any], dt.date]:
    from recsys.data.partitions import list_partitions
    from recsys.data.sample import SampleSpec, generate_sample

    if args.reuse:
        if args.data is None:
            raise SystemExit("--reuse needs --data DIR")
        _, parts = list_partitions(str(data / "events"), "events")
        if not parts:
            raise SystemExit(f"no events partitions under {data / 'events'}")
        return {"path": str(data), "reused": True}, parts[-1].date
    summary = generate_sample(data, SampleSpec(users=args.users, items=args.items, days=args.days, seed=args.seed,
                                               end_date=args.end_date))
    print(summary, flush=True)
    return ({"users": args.users, "items": args.items, "days": args.days, "seed": args.seed,
             "events": summary.events, "first_date": str(summary.first_date), "last_date": str(summary.last_date)},
            summary.last_date)


if __name__ == "__main__":
    sys.exit(main())
