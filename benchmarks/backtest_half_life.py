"""Personal frequency's half-life, chosen on nights before the backtest's: how the baseline's figures move with it.

    python benchmarks/backtest_half_life.py --data /tmp/wikipedia --from 2024-01-18 --to 2024-01-24 \
        [--half-lives 1,3,7,14,30,3650] [--json PATH]

For each night the returning users, their targets and history exactly as ``recsys backtest`` builds them
(``recsys.evaluation.backtest.night_inputs``), personal-frequency lists at each half-life (3650 days: plain
counts), measured with the same figures; no training, no job. Run it on nights *before* the ones a backtest
reports, so the baseline's setting is not chosen on the nights it is judged on.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="dataset root (events/, catalog/)")
    parser.add_argument("--from", dest="start", type=dt.date.fromisoformat, required=True)
    parser.add_argument("--to", dest="end", type=dt.date.fromisoformat, required=True)
    parser.add_argument("--half-lives", default="1,3,7,14,30,3650")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    from recsys.config import load_config
    from recsys.data.contracts import date_range
    from recsys.evaluation import backtest, baselines
    from recsys.evaluation.report import Bootstrap
    from recsys.spark.session import build_session

    cfg = load_config(overrides=[f"paths.events={args.data / 'events'}", f"paths.catalog={args.data / 'catalog'}"])
    half_lives = [float(x) for x in args.half_lives.split(",")]
    spark = build_session(cfg.spark, app_name="backtest-half-life")
    rows = []
    try:
        log_events = backtest.read_log(spark, cfg.paths.events, args.end)
        with tempfile.TemporaryDirectory() as tmp:
            for night in date_range(args.start, args.end):
                inputs = backtest.night_inputs(spark, log_events, cfg.paths.catalog, night, cfg.history, 0,
                                               f"{tmp}/users/dt={night}")
                lists = {f"pfreq-{h:g}": baselines.personal_frequency_lists(
                    inputs.past, inputs.users, inputs.available, night, cfg.scoring.top_n, h, cfg.history.tie_break_seed)
                    for h in half_lives}
                backtest.measure(inputs.users, lists, 10, cfg.scoring.top_n).write.parquet(f"{tmp}/figures/dt={night}")
                print(f"measured {night}", flush=True)
            what = backtest.Measurement(tuple(lists), args.start, args.end, k=10, n=cfg.scoring.top_n)
            summary = backtest.summarize(spark, f"{tmp}/figures", what, bootstrap=Bootstrap(0, 0),
                                         settings=cfg.evaluation.backtest)
    finally:
        spark.stop()
    print(f"\n{summary.counts['user_nights']:,} user-nights, {args.start}..{args.end}\n")
    print(f"| half-life (days) | HR@10 | NDCG@10 | HR@10 repeat | NDCG@10 repeat | recall@{cfg.scoring.top_n} |")
    print("|---|---|---|---|---|---|")
    for name, m in summary.means.items():
        rows.append({"half_life_days": float(name.split("-", 1)[1]), **m})
        print(f"| {name.split('-', 1)[1]} | {m['hr@10']:.3f} | {m['ndcg@10']:.3f} | {m['hr@10.repeat']:.3f} | "
              f"{m['ndcg@10.repeat']:.3f} | {m[f'recall@{cfg.scoring.top_n}']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"from": str(args.start), "to": str(args.end), "counts": summary.counts,
                                         "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
