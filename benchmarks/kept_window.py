"""A night's scans of a kept window of many small files: the reader's coalesced partitions against Spark's own split.

    python benchmarks/kept_window.py --events .recsys/data/events --date 2018-09-25 [--window-days 10000] \\
        [--rounds 3] [--json PATH]

``--events``: an events root with many small ``dt=`` partitions (``make demo`` writes MovieLens's 4,110 days
under ``.recsys/data/events``). In one local[2] session, each round reads the window as a night keeps it
(``recsys.data.readers.KeptWindow``) and runs the stages that scan it, with the job's code: training's shards
(``recsys.learning.shards.write_training_shards``), the repeat blend's days (``recsys.learning.repeats``) and the
night's histories (``recsys.data.history.build_histories``, counted). Two points, alternating within each round:
``coalesced`` (the reader as it is: ``recsys.data.readers.read_tasks`` partitions) and ``spark-split`` (the same
with ``read_tasks`` patched to a number no read reaches, so the window keeps Spark's split of the files). The first
round pays the JVM's warm-up for whichever point runs first; read the medians. Prints seconds per stage.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

POINTS = ("coalesced", "spark-split")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--date", type=dt.date.fromisoformat, required=True, help="the night: reads the days before")
    parser.add_argument("--window-days", type=int, default=10000, help="history.window_days (default 10000: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from recsys.config import load_config
    from recsys.data import history as hist
    from recsys.data import readers
    from recsys.learning import shards as sh
    from recsys.learning.repeats import write_validation_days
    from recsys.spark.session import build_session

    cfg = load_config(overrides=["spark.master=local[2]", f"paths.events={args.events}",
                                 f"history.window_days={args.window_days}"])
    spark = build_session(cfg.spark, app_name="kept-window")
    rows = []
    try:
        for rnd in range(1, args.rounds + 1):
            for point in POINTS if rnd % 2 else POINTS[::-1]:
                split = (mock.patch.object(readers, "read_tasks", lambda spark, data_bytes: 1 << 30)
                         if point == "spark-split" else contextlib.nullcontext())
                with split, sh.training_window(spark, cfg, args.date) as kept, tempfile.TemporaryDirectory() as work:
                    started = time.perf_counter()
                    events = sh.training_events(spark, cfg, args.date, kept)
                    shards = sh.write_training_shards(spark, cfg, args.date, f"{work}/shards", shards=8, events=events)
                    t_shards = time.perf_counter()
                    write_validation_days(events, cfg, args.date, f"{work}/repeats",
                                          held_out_below=shards.held_out_below)
                    t_days = time.perf_counter()
                    hist.build_histories(events, max_items=cfg.history.max_items,
                                         tie_break_seed=cfg.history.tie_break_seed).count()
                    t_hist = time.perf_counter()
                row = {"round": rnd, "point": point, "shards_s": t_shards - started,
                       "repeat_days_s": t_days - t_shards, "histories_s": t_hist - t_days,
                       "total_s": t_hist - started, "users": shards.users}
                rows.append(row)
                print(f"round {rnd} {point:>11}: shards {row['shards_s']:.2f} s, repeat days "
                      f"{row['repeat_days_s']:.2f} s, histories {row['histories_s']:.2f} s, "
                      f"total {row['total_s']:.2f} s", flush=True)
    finally:
        spark.stop()
    medians = {p: {k: statistics.median(r[k] for r in rows if r["point"] == p)
                   for k in ("shards_s", "repeat_days_s", "histories_s", "total_s")} for p in POINTS}
    print(f"\n| point | shards | repeat days | histories | total, median of {args.rounds} |\n|---|---|---|---|---|")
    for p in POINTS:
        m = medians[p]
        print(f"| {p} | {m['shards_s']:.2f} s | {m['repeat_days_s']:.2f} s | {m['histories_s']:.2f} s | "
              f"{m['total_s']:.2f} s |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
