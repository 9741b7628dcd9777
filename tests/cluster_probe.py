"""A spark-submit job for tests/test_cluster.py: what can an executor's Python worker see?

    ./spark-submit.sh --pack --master spark://... tests/cluster_probe.py PATH [PATH ...]

Runs one barrier stage of as many tasks as the cluster has cores (one per executor here): Spark launches
a barrier stage's tasks all at once, each on a slot of its own, so every executor's Python worker answers
whatever order the executors unpacked their environments in (with plain tasks, the executor that was
ready first could run them all). Prints one JSON line per task: its process, its interpreter, where
``recsys`` was imported from, and for every PATH whether the worker could read it. The test asserts the
driver's files are out of reach.
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

    tasks = int(spark.conf.get("spark.cores.max", "2"))
    rows = spark.range(0, tasks, 1, tasks).mapInPandas(probe, "probe string", barrier=True).collect()
    for row in rows:
        print("PROBE " + row.probe)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
