"""Reading a window of many small daily partitions: Spark's default listing against the job's session default.

    python benchmarks/many_partitions.py --events .recsys/data/events [--repeats 3] [--json PATH]

``--events``: an events root with many ``dt=`` partitions (``make demo`` writes MovieLens's 4,110 days under
``.recsys/data/events``; ``recsys sample-data --days 1000`` writes a thousand). Reads every partition the way
the job does (``recsys.data.readers.read_events``: the driver lists and checks the footers, then Spark reads the
paths) and counts the rows, in one local[2] session: first with Spark's listing default
(``spark.sql.sources.parallelPartitionDiscovery.parallelism`` 10,000: one listing task per path), then with
``recsys.spark.session.LISTING_SETTINGS``, alternating, ``--repeats`` times each. Prints seconds per read and
each stage's task count (the listing job's, then the scan's).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KEY = "spark.sql.sources.parallelPartitionDiscovery.parallelism"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--open-cost", help="also try spark.sql.files.openCostInBytes at this value (e.g. 256k)")
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    from recsys.data.readers import read_events
    from recsys.spark.session import LISTING_SETTINGS

    spark = (SparkSession.builder.master("local[2]").appName("many-partitions")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(10).count()                                  # the session's first job, out of the timings
    settings = {"spark default": {KEY: "10000"}, "recsys default": dict(LISTING_SETTINGS)}
    if args.open_cost:
        settings[f"recsys default + openCostInBytes {args.open_cost}"] = {
            **LISTING_SETTINGS, "spark.sql.files.openCostInBytes": args.open_cost}
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    tasks: dict[str, list[int]] = {}
    rows = 0
    for n in range(args.repeats):
        for name, conf in settings.items():
            spark.conf.unset("spark.sql.files.openCostInBytes")
            for key, value in conf.items():
                spark.conf.set(key, value)
            group = f"{name}-{n}"
            spark.sparkContext.setJobGroup(group, group)
            started = time.perf_counter()
            rows = read_events(spark, str(args.events)).count()
            seconds[name].append(time.perf_counter() - started)
            tracker = spark.sparkContext.statusTracker()
            stages = [s for j in tracker.getJobIdsForGroup(group) for s in tracker.getJobInfo(j).stageIds]
            tasks[name] = [tracker.getStageInfo(s).numTasks for s in sorted(stages)]
    partitions = sum(1 for p in args.events.iterdir() if p.name.startswith("dt="))
    result = {"partitions": partitions, "rows": rows, "repeats": args.repeats,
              "seconds_median": {k: round(statistics.median(v), 2) for k, v in seconds.items()},
              "seconds": {k: [round(x, 2) for x in v] for k, v in seconds.items()},
              "stage_tasks": tasks}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
