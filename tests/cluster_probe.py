"""A spark-submit job for tests/test_cluster.py: what can an executor's Python worker see?

    ./spark-submit.sh --pack --master spark://... tests/cluster_probe.py PATH [PATH ...]

Runs one task per partition (more partitions than cores, so every executor gets some) and prints one
JSON line per task: its process, its interpreter, where ``recsys`` was imported from, and for every
PATH whether the worker could read it. The test asserts the driver's files are out of reach.
"""
import json
import sys

from pyspark.sql import SparkSession


def main(paths: list[str]) -> int:
    spark = SparkSession.builder.appName("recsys-cluster-probe").getOrCreate()

    def probe(batches):
        import os
        import socket

        import pandas as pd

        import recsys

        for _ in batches:
            pass
        readable = {}
        for path in paths:
            try:
                if os.path.isdir(path):
                    os.listdir(path)
                    readable[path] = os.path.exists(os.path.join(path, "pyproject.toml")) or bool(os.listdir(path))
                else:
                    with open(path, "rb") as f:
                        f.read(1)
                    readable[path] = True
            except OSError:
                readable[path] = False
        yield pd.DataFrame([{"probe": json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                  "python": sys.executable, "prefix": sys.prefix,
                                                  "recsys": recsys.__file__, "readable": readable})}])

    rows = spark.range(0, 8, 1, 8).mapInPandas(probe, "probe string").collect()
    for row in rows:
        print("PROBE " + row.probe)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
