"""The guard's false alarms (issue 22): consecutive nights with the default model and default thresholds.

    python benchmarks/guard_nights.py --work /tmp/recsys-guard-nights [--data synthetic|movielens] [--nights 30]

``synthetic``: the sample generator (``recsys sample-data``: 2,000 users, 1,000 items by default) writes
``--train-days`` days and then ``--nights`` more; ``movielens``: ml-latest-small (``--movielens DIR``),
whose last rating is on 2018-09-24, so the nights are the ``--nights`` days up to 2018-09-25. Either way
``recsys train`` trains the default model (every setting at its default) on the events before the first
night, and ``recsys recommend --start-date F --end-date L`` runs the nights as one backfill with the
default guard. Then every night's verdict, what crossed a threshold, and the figures the guard judged,
read back from the published manifests (a refused night has none: its line comes from the log).

Prints one line per night and a summary (fails, warns by figure); ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIGURES = ("realized_users", "realized_hr_at_10", "realized_pop_hr_at_10", "realized_hr_ratio_at_n",
           "jaccard_at_n_mean", "jaccard_at_n_p10", "first_item_changed_share", "catalog_coverage",
           "catalog_coverage_ratio", "head_slot_share", "top1pct_slot_share", "exposure_gini", "fallback_share",
           "users_lost_share", "score_psi")
MOVIELENS_LAST_NIGHT = dt.date(2018, 9, 25)


def _run(cmd: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> tuple[int, float]:
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable,
                                   **(env or {})}).returncode
    return code, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--data", choices=("synthetic", "movielens"), default="synthetic")
    parser.add_argument("--nights", type=int, default=30)
    parser.add_argument("--train-days", type=int, default=28, help="synthetic: days before the first night")
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--movielens", type=Path, default=REPO.parent / "shared" / "data" / "ml-latest-small")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config overrides for training and the nights (default: none)")
    parser.add_argument("--train-threads", type=int, default=0,
                        help="OMP_NUM_THREADS of the training process (0: torch's default); on a shared machine 1 "
                             "avoids oversubscribed threads, which made epochs 40x slower here")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    work = args.work.resolve()
    data = work / "data"
    work.mkdir(parents=True, exist_ok=True)
    if args.data == "synthetic":
        from recsys.data.sample import SampleSpec, generate_sample

        last = dt.date(2024, 6, 30)
        first = last - dt.timedelta(days=args.nights - 1)
        summary = generate_sample(data, SampleSpec(users=args.users, items=args.items, days=args.train_days + args.nights,
                                                   seed=args.seed, end_date=last), overwrite=True)
        print(summary, flush=True)
    else:
        from recsys.data.movielens import import_movielens

        last = MOVIELENS_LAST_NIGHT
        first = last - dt.timedelta(days=args.nights - 1)
        ratings = args.movielens / "ratings.csv"
        if not ratings.is_file():
            ratings = REPO / "data" / "ml-latest-small" / "ratings.csv"
        print(import_movielens(ratings, data, movies=ratings.parent / "movies.csv", overwrite=True), flush=True)
    paths = [f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}", f"paths.output={work / 'out'}",
             f"paths.work={work / 'scratch'}", f"paths.driver_scratch={work / 'driver'}",
             f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}", f"mlflow.artifact_location={work / 'artifacts'}",
             f"output.metastore.dir={work / 'metastore'}",   # the default output.table's embedded metastore
             *args.overrides]
    sets = [x for item in paths for x in ("--set", item)]
    cli = [sys.executable, "-m", "recsys.cli"]
    if not (work / "mlflow.db").exists():
        threads = {"OMP_NUM_THREADS": str(args.train_threads)} if args.train_threads else None
        code, train_s = _run([*cli, "train", "--date", str(first), *sets], work, work / "train.log", threads)
        if code != 0:
            raise SystemExit(f"training failed (exit {code}); see {work / 'train.log'}")
        print(f"trained the default model on the events before {first} in {train_s:.0f} s", flush=True)
    # One backfill (one Spark session); a refused night stops a backfill (exit 3), so the nights after it
    # run as the next backfill, compared with the last night published.
    start, nights_s, code, logs = first, 0.0, 0, []
    while start <= last:
        log = work / f"nights-{start}.log"
        code, seconds = _run([*cli, "recommend", "--start-date", str(start), "--end-date", str(last), "--force", *sets],
                             work, log)
        nights_s += seconds
        logs.append(log.read_text())
        print(f"nights {start}..{last}: exit {code} in {seconds:.0f} s (log: {log})", flush=True)
        if code != 3:
            break
        refused = [d for d in (start + dt.timedelta(days=i) for i in range((last - start).days + 1))
                   if f"refused the night of {d}" in logs[-1]]
        if not refused:
            break
        start = refused[0] + dt.timedelta(days=1)

    rows = []
    log_text = "\n".join(logs)
    for i in range(args.nights):
        date = first + dt.timedelta(days=i)
        path = work / "out" / f"dt={date}" / "_manifest.json"
        if not path.is_file():
            refused = [line for line in log_text.splitlines() if f"refused the night of {date}" in line]
            rows.append({"date": str(date), "verdict": "fail" if refused else "not run", "crossed": refused[:1]})
            continue
        m = json.loads(path.read_text())
        guard = (m.get("quality") or {}).get("guard") or {}
        crossed = [c for c in guard.get("checks", []) if c["level"] in ("warn", "fail")]
        rows.append({"date": str(date), "verdict": guard.get("verdict"),
                     "crossed": [f"{c['level']}: {c['why']}" for c in crossed],
                     "crossed_figures": [f"{c['level']}:{c['figure']}" for c in crossed],
                     **{f: (m.get("metrics") or {}).get(f) for f in FIGURES}})

    def fmt(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    print(f"\n{'date':10} {'verdict':8} {'HRusers':>7} {'HR@10':>6} {'popHR':>6} {'ratio':>6} {'jacc':>6} "
          f"{'p10':>5} {'first':>5} {'cover':>6} {'cratio':>6} {'head':>6} {'top1%':>6} {'gini':>6} {'fallb':>6} "
          f"{'lost':>6} {'psi':>6}")
    for r in rows:
        print(f"{r['date']:10} {r['verdict'] or '?':8} {fmt(r.get('realized_users'), '.0f'):>7} "
              f"{fmt(r.get('realized_hr_at_10')):>6} {fmt(r.get('realized_pop_hr_at_10')):>6} "
              f"{fmt(r.get('realized_hr_ratio_at_n'), '.2f'):>6} {fmt(r.get('jaccard_at_n_mean')):>6} "
              f"{fmt(r.get('jaccard_at_n_p10'), '.2f'):>5} {fmt(r.get('first_item_changed_share'), '.2f'):>5} "
              f"{fmt(r.get('catalog_coverage')):>6} {fmt(r.get('catalog_coverage_ratio'), '.2f'):>6} "
              f"{fmt(r.get('head_slot_share')):>6} {fmt(r.get('top1pct_slot_share')):>6} "
              f"{fmt(r.get('exposure_gini')):>6} {fmt(r.get('fallback_share')):>6} "
              f"{fmt(r.get('users_lost_share')):>6} {fmt(r.get('score_psi')):>6}")
    verdicts = Counter(r["verdict"] for r in rows)
    crossed = Counter(f for r in rows for f in r.get("crossed_figures", []))
    print(f"\nverdicts: {dict(verdicts)}; crossed: {dict(crossed) or 'nothing'}")
    for r in rows:
        for line in r["crossed"]:
            print(f"  {r['date']} {line}")
    if args.json:
        args.json.write_text(json.dumps({"data": args.data, "first": str(first), "last": str(last),
                                         "exit_code": code, "nights_s": nights_s, "nights": rows}, indent=2) + "\n")
    return 0 if verdicts.get("fail", 0) == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
