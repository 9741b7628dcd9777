"""The workload whose JVM writes the tests' class-data archive (tests/jvmkit.py): run as a script, once per machine.

A local session set up as the tests' shared one (Hive catalog on a Derby network server, the Derby client
on the driver's class path) does a little of what the job does: Hive DDL and partitions, Parquet written
and read, aggregation, a window, a join and an Arrow UDF. The classes that loads are what later JVMs read
from the archive instead of loading and verifying them. Exits 0 once the JVM has exited (and written it).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # recsys, when run from elsewhere


def main() -> int:
    import pandas as pd
    from pyspark import SparkContext
    from pyspark.sql import SparkSession, Window
    from pyspark.sql import functions as F

    from recsys.spark import metastore

    with tempfile.TemporaryDirectory(prefix="recsys-jvm-warmup-") as tmp:
        root = Path(tmp)
        info = metastore.start_server(root / "service")
        try:
            store = metastore.Metastore(root / "session", info["url"], (metastore.DERBY_CLIENT_JAR,), None)
            builder = SparkSession.builder
            for key, value in {**metastore.metastore_settings(store), **metastore.launch_settings(store)}.items():
                builder = builder.config(key, value)
            spark = (builder.master("local[2]").appName("recsys-jvm-warmup")
                     .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
                     .config("spark.sql.warehouse.dir", str(root / "warehouse")).getOrCreate())
            proc = SparkContext._gateway.proc
            events = spark.createDataFrame(pd.DataFrame({"user_id": [1, 1, 2, 3], "item_id": [5, 6, 5, 7],
                                                         "ts": pd.to_datetime(["2024-05-01"] * 4, utc=True)}))
            out = str(root / "events")
            events.withColumn("dt", F.to_date("ts")).write.partitionBy("dt").parquet(out)
            read = spark.read.parquet(out)
            ranked = read.withColumn("n", F.row_number().over(Window.partitionBy("user_id").orderBy(F.desc("ts"))))
            joined = ranked.join(read.groupBy("item_id").agg(F.count("*").alias("c")), "item_id")
            joined.groupBy("user_id").agg(F.collect_list(F.struct("item_id", "c")).alias("l")).collect()
            scored = joined.groupBy("user_id").applyInPandas(lambda df: df[["user_id"]].head(1), "user_id long")
            scored.mapInPandas(lambda it: it, "user_id long").toPandas()
            for statement in ("CREATE DATABASE IF NOT EXISTS warmup",
                              "SHOW DATABASES LIKE 'warmup'",
                              f"CREATE EXTERNAL TABLE IF NOT EXISTS warmup.t (user_id BIGINT) PARTITIONED BY (dt DATE) "
                              f"STORED AS PARQUET LOCATION '{root / 't'}'",
                              "SHOW TABLES IN warmup LIKE 't'",
                              f"ALTER TABLE warmup.t ADD PARTITION (dt = DATE'2024-05-01') LOCATION '{out}/dt=2024-05-01'",
                              "SHOW PARTITIONS warmup.t",
                              "DESCRIBE FORMATTED warmup.t PARTITION (dt = DATE'2024-05-01')",
                              "SELECT count(*) FROM warmup.t"):
                spark.sql(statement).collect()
            spark.stop()
            proc.stdin.close()       # the gateway JVM exits on EOF, and writes the archive as it does
            proc.wait(timeout=600)
        finally:
            metastore.stop_server(root / "service")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.exit(main())
