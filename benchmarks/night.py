"""The whole night as scheduled, against Spark ALS's night on the same events: one run, side by side.

    python benchmarks/night.py --work /tmp/recsys-night --users 10000 [100000 ...] [--nights 7]
        [--items 5000] [--days 28] [--train-every N] [--modes two,one] [--set KEY=VALUE ...] [--json PATH]

For each ``--users`` scale the sample generator writes ``--days`` of events ending the day before the
first night (the log then grows by a day a night: night D reads the events before D, as in production).
Each night runs what the DAG in ``conf/schedulers/`` runs, as a child process of this script:
``recsys night --date D`` (``--modes one``, the default): training on the events before D when
``train.every_nights`` (default 1; ``--train-every`` overrides it) says it is due, then the published top-N
for D, in one process and one Spark session; or, with ``--modes two`` (``two,one`` for both, each on its own
copy of the store, the same ALS nights beside them), the same two steps as two processes, ``recsys train
--date D --if-due`` then ``recsys recommend --date D`` (the DAG's two tasks before it ran ``recsys night``);

and then Spark ALS's night on the same window of events: a fresh ``local[2]`` process that reads the
window with the job's reader, fits implicit ALS (rank 64, 10 iterations, as ``recsys backtest``'s
baseline) and writes ``recommendForAllUsers(top_n)`` as Parquet. Every child is timed from start to
exit (JVM start-up included, as the scheduler pays it) with the peak resident memory of its process
tree sampled (driver Python, JVM, Python workers); the job's own stage seconds come from its log lines.
The table printed at the end: the mean night of each and their ratio, and, where the nights held both a full
training and a warm one (each night trained: ``train.every_nights`` 1), a week as scheduled: one full night and
``train.full_every_nights`` - 1 warm ones (this run's mean night of each kind), against ALS's mean night.

Nothing here is timed inside pytest: the figures and their command belong in docs/performance.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

FIRST_NIGHT = dt.date(2024, 3, 1)
ALS_RANK, ALS_ITERATIONS = 64, 10
TRAIN_STAGE = re.compile(r"\[train \S+\] (.+?) done in ([\d.]+)s")
TRAIN_KIND = re.compile(r"\[train \S+\] (full|warm) training: ")     # recsys.pipelines.train's plan line
RECOMMEND_BREAKDOWN = "seconds by stage: "     # recsys.pipelines.nightly.STAGE_BREAKDOWN


def _timed(cmd: list[str], log: Path) -> tuple[int, float, dict, str]:
    """(exit code, wall seconds, peak MB by kind of process, output) of a child process."""
    from scale_test import run_sampled, sample_tree

    peaks: dict = {}
    code, seconds, out = run_sampled(cmd, lambda pid, stop: sample_tree(pid, peaks, stop), cwd=log.parent)
    log.write_text(f"{cmd}\nexit {code} after {seconds:.1f}s\n{out}")
    return code, seconds, {k: round(v) for k, v in peaks.items()}, out


def _overrides(root: Path, extra: list[str]) -> list[str]:
    data = root / "data"
    sets = [f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}", f"paths.output={root / 'out'}",
            f"paths.work={root / 'work'}", f"paths.driver_scratch={root / 'driver'}",
            f"mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}", f"mlflow.artifact_location={root / 'artifacts'}",
            f"output.metastore.dir={root / 'metastore'}", *extra]
    return [arg for s in sets for arg in ("--set", s)]


def job_night(root: Path, date: dt.date, extra: list[str]) -> dict:
    """``recsys train --if-due`` then ``recsys recommend`` for ``date``; their seconds, stages and peaks."""
    sets = _overrides(root, extra)
    cli = [sys.executable, "-m", "recsys.cli"]
    code, train_s, train_peak, out = _timed([*cli, "train", "--date", str(date), "--if-due", *sets],
                                            root / f"train-{date}.log")
    if code != 0:
        raise SystemExit(f"recsys train failed for {date} (exit {code}); log: {root / f'train-{date}.log'}")
    trained = "not due" not in out
    kind = _kind(out)
    stages = {label: float(s) for label, s in TRAIN_STAGE.findall(out)}
    code, rec_s, rec_peak, out = _timed([*cli, "recommend", "--date", str(date), *sets], root / f"recommend-{date}.log")
    if code != 0:
        raise SystemExit(f"recsys recommend failed for {date} (exit {code}); log: {root / f'recommend-{date}.log'}")
    lines = [line for line in out.splitlines() if RECOMMEND_BREAKDOWN in line]
    breakdown = json.loads(lines[-1].split(RECOMMEND_BREAKDOWN, 1)[1]) if lines else {}
    return {"trained": trained, "kind": kind, "train_s": round(train_s, 1), "train_stages_s": stages,
            "train_peak_mb": train_peak,
            "recommend_s": round(rec_s, 1), "recommend_stages_s": breakdown, "recommend_peak_mb": rec_peak,
            "night_s": round(train_s + rec_s, 1)}


def _kind(out: str) -> str | None:
    """The night's training kind from its log (full | warm), None when it did not train."""
    found = TRAIN_KIND.findall(out)
    return found[-1] if found else None


def week_as_scheduled(rows: list[dict], full_every: int, prefix: str = "") -> float | None:
    """A week of the schedule from this run's nights: one full night and ``full_every - 1`` warm ones, each at this
    run's mean of its kind, over ``full_every`` nights; None without a full and a warm night to take them from, or
    when a night did not train (another cadence than every night: the nights' mix is not one of each)."""
    if any(not r[f"{prefix}trained"] for r in rows):
        return None
    full = [r[f"{prefix}night_s"] for r in rows if r[f"{prefix}kind"] == "full"]
    warm = [r[f"{prefix}night_s"] for r in rows if r[f"{prefix}kind"] == "warm"]
    if not full or not warm:
        return None
    return (statistics.mean(full) + (full_every - 1) * statistics.mean(warm)) / full_every


def one_process_night(root: Path, date: dt.date, extra: list[str]) -> dict:
    """``recsys night`` for ``date``: training when due, then the lists, in one process; seconds, stages, peak."""
    code, night_s, peak, out = _timed([sys.executable, "-m", "recsys.cli", "night", "--date", str(date),
                                       *_overrides(root, extra)], root / f"night-{date}.log")
    if code != 0:
        raise SystemExit(f"recsys night failed for {date} (exit {code}); log: {root / f'night-{date}.log'}")
    lines = [line for line in out.splitlines() if RECOMMEND_BREAKDOWN in line]
    return {"trained": "training not due" not in out and "training failed" not in out, "kind": _kind(out),
            "train_stages_s": {label: float(s) for label, s in TRAIN_STAGE.findall(out)},
            "recommend_stages_s": json.loads(lines[-1].split(RECOMMEND_BREAKDOWN, 1)[1]) if lines else {},
            "night_peak_mb": peak, "night_s": round(night_s, 1)}


def als_night(root: Path, date: dt.date, window_days: int, top_n: int) -> dict:
    """Spark ALS's night in a child process (this script with ``--als-child``)."""
    out_dir = root / "als" / f"dt={date}"
    code, seconds, peak, out = _timed(
        [sys.executable, __file__, "--als-child", str(root / "data" / "events"), str(date), str(window_days),
         str(top_n), str(out_dir)], root / f"als-{date}.log")
    if code != 0:
        raise SystemExit(f"ALS failed for {date} (exit {code}); log: {root / f'als-{date}.log'}")
    figures = json.loads(next(line for line in out.splitlines() if line.startswith("ALS ")).removeprefix("ALS "))
    return {"als_s": round(seconds, 1), **figures, "als_peak_mb": peak}


def _als_child(events: str, date: str, window_days: str, top_n: str, out_dir: str) -> int:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from recsys.data.readers import read_events_window
    from recsys.evaluation.baselines import ALSParams, als_estimator
    from recsys.spark.session import LISTING_SETTINGS

    builder = SparkSession.builder.master("local[2]").appName("als-night").config("spark.ui.enabled", "false")
    for key, value in {**LISTING_SETTINGS, "spark.sql.session.timeZone": "UTC",
                       "spark.driver.memory": "2g"}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    started = time.perf_counter()
    window = read_events_window(spark, events, dt.date.fromisoformat(date), int(window_days))
    ratings = (window.groupBy("user_id", "item_id").count()
               .select(F.col("user_id").cast("int").alias("user"), F.col("item_id").cast("int").alias("item"),
                       F.lit(1.0).alias("rating")).cache())
    rows = ratings.count()
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    model = als_estimator(ALSParams(ALS_RANK, 0.01, 10.0, ALS_ITERATIONS, 42)).fit(ratings)
    model.userFactors.count()
    fit_s = time.perf_counter() - started
    started = time.perf_counter()
    model.recommendForAllUsers(int(top_n)).write.mode("overwrite").parquet(out_dir)
    recommend_s = time.perf_counter() - started
    print("ALS " + json.dumps({"als_read_s": round(read_s, 1), "als_fit_s": round(fit_s, 1),
                               "als_recommend_s": round(recommend_s, 1), "als_pairs": rows}), flush=True)
    spark.stop()
    return 0


def run_scale(work: Path, users: int, items: int, days: int, nights: int, extra: list[str], window_days: int,
              top_n: int, modes: tuple[str, ...], full_every: int) -> dict:
    """Each mode's nights (``two``: train then recommend, two processes; ``one``: ``recsys night``) on its own
    copy of the generated data and store, beside Spark ALS's night on the same events."""
    from recsys.data.sample import SampleSpec, generate_sample

    roots = {mode: work / (f"u{users}" if mode == "two" else f"u{users}-{mode}") for mode in modes}
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    end = FIRST_NIGHT + dt.timedelta(days=nights - 2)          # the last night's events: the day before it
    first = roots[modes[0]]
    summary = generate_sample(first / "data", SampleSpec(users=users, items=items, days=days + nights - 1, seed=7,
                                                         end_date=end), overwrite=True)
    for root in list(roots.values())[1:]:
        shutil.copytree(first / "data", root / "data")
    # the log as it stands on each night: the generator wrote every day up front, so each night's reads are
    # bounded by its date (events before D, as the job reads them); the last night's day is the end
    rows = []
    for n in range(nights):
        date = FIRST_NIGHT + dt.timedelta(days=n)
        row = {"date": str(date)}
        for mode, root in roots.items():
            night = job_night(root, date, extra) if mode == "two" else one_process_night(root, date, extra)
            row.update(night if mode == modes[0] else {f"{mode}_{key}": value for key, value in night.items()})
        row.update(als_night(first, date, window_days, top_n))
        for mode in modes:
            prefix = "" if mode == modes[0] else f"{mode}_"
            row[f"{prefix}ratio"] = round(row[f"{prefix}night_s"] / row["als_s"], 2)
            detail = (f" (train {row[prefix + 'train_s']} s{'' if row[prefix + 'trained'] else ', not due'}, "
                      f"recommend {row[prefix + 'recommend_s']} s)" if mode == "two" else
                      f" (one process{'' if row[f'{prefix}trained'] else ', not trained'})")
            print(f"[{users} users] {date}: job {row[f'{prefix}night_s']} s{detail} vs ALS {row['als_s']} s "
                  f"(fit {row['als_fit_s']} s, recommend {row['als_recommend_s']} s): {row[f'{prefix}ratio']}x",
                  flush=True)
        rows.append(row)
    als_mean = statistics.mean(r["als_s"] for r in rows)
    result = {"users": users, "items": items, "events": summary.events, "modes": list(modes), "nights": rows,
              "mean_als_night_s": round(als_mean, 1)}
    for mode in modes:
        prefix = "" if mode == modes[0] else f"{mode}_"
        job_mean = statistics.mean(r[f"{prefix}night_s"] for r in rows)
        result[f"{prefix}mean_night_s"] = round(job_mean, 1)
        result[f"{prefix}ratio"] = round(job_mean / als_mean, 2)
        week = week_as_scheduled(rows, full_every, prefix)
        result[f"{prefix}week_night_s"] = None if week is None else round(week, 1)
        result[f"{prefix}week_ratio"] = None if week is None else round(week / als_mean, 2)
    return result


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--als-child":
        return _als_child(*sys.argv[2:7])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch root (one folder per scale, replaced)")
    parser.add_argument("--users", type=int, nargs="+", default=[10_000])
    parser.add_argument("--items", type=int, default=5_000)
    parser.add_argument("--days", type=int, default=28, help="days of events before the first night")
    parser.add_argument("--nights", type=int, default=7)
    parser.add_argument("--train-every", type=int, help="train.every_nights (default: the configuration's)")
    parser.add_argument("--top-n", type=int, default=100)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a configuration override for the job's runs (repeatable)")
    parser.add_argument("--modes", default="one",
                        help="comma-separated: one (recsys night: one process, as the DAG runs it), two (recsys "
                             "train, then recsys recommend: two processes); several run side by side (default: one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - {"two", "one"} or len(set(modes)) != len(modes):
        parser.error(f"--modes {args.modes!r}: give two, one, or both (two,one)")
    if args.nights < 1 or args.days < 1:
        parser.error("--nights and --days must be at least 1")
    extra = [f"scoring.top_n={args.top_n}", *args.set]
    if args.train_every:
        extra.append(f"train.every_nights={args.train_every}")
    from recsys.config import load_config

    # the configuration the nights run with: ALS reads the window the job reads, and the week follows its cadence
    cfg = load_config(None, extra)
    window_days, full_every = cfg.history.window_days, cfg.train.full_every_nights
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for users in args.users:
        results.append(run_scale(args.work, users, args.items, args.days, args.nights, extra, window_days, args.top_n,
                                 modes, full_every))
        if args.json:
            args.json.write_text(json.dumps({"settings": extra, "scales": results}, indent=2))
    names = {"two": "recsys, train + recommend", "one": "recsys night, one process"}
    print("\n| users | events | " + " | ".join(f"mean night: {names[m]}" for m in modes)
          + " | Spark ALS (fit + recommendForAllUsers) | " + " | ".join(f"ratio ({m})" for m in modes)
          + " | " + " | ".join(f"a week as scheduled ({m}: 1 full + {full_every - 1} warm) / ALS" for m in modes)
          + " |")
    print("|---|---|" + "---|" * (3 * len(modes) + 1))
    for r in results:
        prefixes = ["" if m == modes[0] else f"{m}_" for m in modes]
        weeks = [f"{r[p + 'week_night_s']} s = {r[p + 'week_ratio']}x" if r[p + "week_ratio"] is not None else
                 "(needs a full and a warm night, each night trained)" for p in prefixes]
        print(f"| {r['users']:,} | {r['events']:,} | " + " | ".join(f"{r[p + 'mean_night_s']} s" for p in prefixes)
              + f" | {r['mean_als_night_s']} s | " + " | ".join(f"{r[p + 'ratio']}x" for p in prefixes)
              + " | " + " | ".join(weeks) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
