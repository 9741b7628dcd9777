"""Spark ALS's fit and ``recommendForUserSubset`` at Spark's 10 blocks against fewer (``evaluation.als.blocks``).

    python benchmarks/als_blocks.py [--users 30 --items 30 --events 600] [--partitions 8] [--blocks N] [--rounds 3]

In one local[2] session with ``spark.sql.shuffle.partitions=--partitions``, each round fits the backtest's ALS
(``recsys.evaluation.baselines.als_estimator``: implicit, rank 4, 3 iterations unless given) on random (user, item)
events and asks it for every user's top 20, once in Spark's default 10 blocks and once in ``--blocks`` (default:
the session's shuffle partitions), alternating which goes first. Prints each point's
median seconds and the ratio. The first round pays the JVM's warm-up; read the medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=30)
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--events", type=int, default=600)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=8, help="spark.sql.shuffle.partitions (the job's: 8)")
    parser.add_argument("--blocks", type=int, help="the fewer blocks (default: --partitions)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import numpy as np
    import pandas as pd
    from pyspark.sql import SparkSession

    from recsys.evaluation.baselines import ALSParams, als_estimator

    spark = (SparkSession.builder.master("local[2]").appName("als-blocks").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", str(args.partitions)).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    rng = np.random.default_rng(0)
    frame = spark.createDataFrame(pd.DataFrame({
        "user": rng.integers(0, args.users, args.events).astype("int32"),
        "item": rng.integers(0, args.items, args.events).astype("int32"),
        "rating": np.ones(args.events, dtype="float32")})).cache()
    frame.count()
    users = frame.select("user").distinct().cache()
    users.count()
    points = {"spark-default": 10, "fewer": args.blocks or args.partitions}
    seconds: dict[str, list[float]] = {name: [] for name in points}
    for round_ in range(args.rounds):
        order = list(points) if round_ % 2 == 0 else list(reversed(points))
        for name in order:
            start = time.perf_counter()
            model = als_estimator(ALSParams(args.rank, 0.01, 10.0, args.iterations, 42, points[name])).fit(frame)
            model.recommendForUserSubset(users, 20).count()
            seconds[name].append(time.perf_counter() - start)
            print(f"round {round_ + 1} {name} ({points[name]} blocks): {seconds[name][-1]:.2f} s", flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"{args.users} users, {args.items} items, {args.events} events, {args.partitions} shuffle partitions: "
          + ", ".join(f"{name} ({points[name]} blocks) {value:.2f} s" for name, value in medians.items())
          + f"; ratio {medians['spark-default'] / medians['fewer']:.2f}x")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
