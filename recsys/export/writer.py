"""The export's Spark job: each task reads published data files and writes their users' lists into Redis.

The driver hands Spark only the list of data files (one task per file); the executors read each file
with pyarrow (the same filesystem layer the driver uses, :mod:`recsys.fs`), encode a batch of users at
a time (:func:`recsys.export.encoding.encode_batch`) and write it in one round trip of pipelined MSET
commands, so no list passes through the driver. Each file's user count is recorded in Redis once the
file is written (``P:vN:_files``, idempotent: a retried task rewrites the same keys and field), and each
task returns its figures as a row: the DataFrame API only, so this runs over Spark Connect too.

Why pyarrow and not ``spark.read.parquet``: converting the nested ``array<struct>`` lists from Spark's
rows to Arrow for the Python worker costs many times what pyarrow reading the same files in the task
does (measured: docs/export.md, "What an export does"): the export is bound by that conversion
otherwise. The executors need read access to ``paths.output`` through pyarrow
(local and shared filesystems, HDFS, S3, GCS, ABFS), as the driver has.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa

FIGURES_DDL = ("path STRING, users BIGINT, value_bytes BIGINT, key_bytes BIGINT, seconds DOUBLE, "
               "partition INT, attempt INT, host STRING, pid INT")
COLUMNS = ["user_id", "recommendations", "source"]


@dataclass(frozen=True)
class WriteSpec:
    """What every export task needs, minted on the driver (small and picklable)."""

    redis_url: str
    prefix: str
    version: str
    sources: tuple[str, ...]
    batch_users: int          # users per MSET
    pipeline_users: int       # users per round trip and per Arrow batch read
    timeout_s: float
    hold_first_task_s: float | None = None   # the export_writing pause point (recsys.hooks), None: off


MAX_TASKS = 1000


def write_files(spark, files: list[str], spec: WriteSpec) -> list[dict[str, Any]]:
    """One task per file (up to MAX_TASKS, then a few files each); returns each file's figures (users, value
    and key bytes, seconds, who wrote it). ``spark.range`` with one partition per task puts file ``i`` in
    task ``i`` exactly; a DataFrame of the paths, repartitioned, would not (round-robin from several input
    partitions leaves some tasks two files and others none)."""
    frame = spark.range(0, len(files), 1, numPartitions=max(1, min(len(files), MAX_TASKS)))
    return [row.asDict() for row in frame.mapInArrow(make_task(spec, tuple(files)), FIGURES_DDL).collect()]


def make_task(spec: WriteSpec, files: tuple[str, ...]):
    """The mapInArrow function of the export: file numbers in, one figures row per file out."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import os
        import socket

        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else -1
        attempt = ctx.attemptNumber() if ctx is not None else 0
        hold = spec.hold_first_task_s is not None and partition == 0 and attempt == 0
        client = _client(spec)
        rows = []
        try:
            for batch in batches:
                for path in (files[i] for i in batch.column(0).to_pylist()):
                    figures = write_file(client, spec, path, hold_after_first=spec.hold_first_task_s if hold else None)
                    hold = False
                    rows.append({**figures, "path": path, "partition": partition, "attempt": attempt,
                                 "host": socket.gethostname(), "pid": os.getpid()})
        finally:
            client.close()
        if rows:
            yield pa.RecordBatch.from_pylist(rows, schema=_figures_schema())

    return task


def _figures_schema() -> pa.Schema:
    return pa.schema([("path", pa.string()), ("users", pa.int64()), ("value_bytes", pa.int64()),
                      ("key_bytes", pa.int64()), ("seconds", pa.float64()), ("partition", pa.int32()),
                      ("attempt", pa.int32()), ("host", pa.string()), ("pid", pa.int32())])


def _client(spec: WriteSpec):
    import redis

    return redis.Redis.from_url(spec.redis_url, socket_timeout=spec.timeout_s, socket_connect_timeout=spec.timeout_s)


def write_file(client, spec: WriteSpec, path: str, hold_after_first: float | None = None) -> dict[str, Any]:
    """Every user of one data file into version ``spec.version``; then the file is recorded as written."""
    import pyarrow.parquet as pq

    from recsys import fs as rfs
    from recsys.export.encoding import encode_batch
    from recsys.export.redis_store import Keyspace

    started = time.perf_counter()
    keys = Keyspace(spec.prefix)
    key_prefix = keys.version_prefix(spec.version)
    fs, inner = rfs.resolve(path)
    users = value_bytes = key_bytes = 0
    with fs.open_input_file(inner) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=spec.pipeline_users, columns=COLUMNS):
            encoded = encode_batch(batch, spec.sources)
            names = [key_prefix + b"%d" % u for u in encoded.user_ids.tolist()]
            pipe = client.pipeline(transaction=False)
            for start in range(0, len(names), spec.batch_users):
                stop = start + spec.batch_users
                pipe.mset(dict(zip(names[start:stop], encoded.values[start:stop])))
            pipe.execute()
            users += len(names)
            value_bytes += encoded.value_bytes
            key_bytes += sum(map(len, names))
            if hold_after_first is not None:
                from recsys.hooks import hold

                hold("export_writing", hold_after_first)
                hold_after_first = None
    client.hset(keys.files_key(spec.version), path, users)
    return {"users": users, "value_bytes": value_bytes, "key_bytes": key_bytes,
            "seconds": time.perf_counter() - started}
