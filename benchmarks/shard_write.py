"""Training's shard write (``recsys.learning.shards.write_training_shards``) as it is, against one of its levers off.

    python benchmarks/shard_write.py --data DIR --date D --lever sort [--max-users N] [--rounds 4] [--json PATH]

``--data``: a dataset root with ``events/`` (``benchmarks/night.py`` writes one per scale under its ``--work``).
In one local[2] session, the window is read and kept (as a night keeps it) before the clock starts; each round
writes the shards twice, alternating which point goes first:

- ``--lever sort``: each shard file sorted by a seeded hash of the user (the code) against the rows in the order
  Spark's shuffle delivers them (``sortWithinPartitions`` patched to a no-op).

``--max-users``: ``train.max_users``, a sample's write. (A ``keep`` lever measured the sample's every-user
histories kept against built three times, until only the sample's histories were built: docs/performance.md.)

The first round pays the JVM's warm-up for whichever point runs first; read the medians. Prints seconds per write.
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

METHOD = {"sort": "sortWithinPartitions"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--date", type=dt.date.fromisoformat, required=True, help="the night: reads the days before")
    parser.add_argument("--lever", choices=sorted(METHOD), required=True)
    parser.add_argument("--max-users", type=int, help="train.max_users: a sample's write")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    # the class a classic session's DataFrames are: it defines the methods itself, so patching
    # pyspark.sql.DataFrame would change nothing
    from pyspark.sql.classic.dataframe import DataFrame

    from recsys.config import load_config
    from recsys.learning import shards as sh
    from recsys.spark.session import build_session

    overrides = ["spark.master=local[2]", f"paths.events={args.data / 'events'}"]
    if args.max_users is not None:
        overrides.append(f"train.max_users={args.max_users}")
    cfg = load_config(overrides=overrides)
    spark = build_session(cfg.spark, app_name="shard-write")
    points = ("as it is", f"{args.lever} off")
    seconds: dict[str, list[float]] = {p: [] for p in points}
    try:
        with sh.training_window(spark, cfg, args.date) as kept, tempfile.TemporaryDirectory() as work:
            events = sh.training_events(spark, cfg, args.date, kept)
            events.count()                        # the window read and kept before any clock starts
            for rnd in range(1, args.rounds + 1):
                for point in points if rnd % 2 else points[::-1]:
                    off = (mock.patch.object(DataFrame, METHOD[args.lever], lambda self, *a, **k: self)
                           if point != points[0] else contextlib.nullcontext())
                    with off:
                        started = time.perf_counter()
                        written = sh.write_training_shards(spark, cfg, args.date, f"{work}/{point}-{rnd}",
                                                           shards=cfg.train.shard_files, events=events)
                        took = time.perf_counter() - started
                    seconds[point].append(round(took, 2))
                    print(f"round {rnd}: {point}: {took:.2f} s ({written.users:,} users written)", flush=True)
    finally:
        spark.stop()
    medians = {p: statistics.median(v) for p, v in seconds.items()}
    print(" | ".join(f"{p}: median {m:.2f} s" for p, m in medians.items()))
    if args.json:
        args.json.write_text(json.dumps({"lever": args.lever, "max_users": args.max_users, "seconds": seconds,
                                         "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
