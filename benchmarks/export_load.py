"""Export throughput at scale: N users x top K from a published partition into a local Redis, on C cores.

    python benchmarks/export_load.py --work /tmp/recsys-export [--users 1000000] [--top-n 100] [--cores 2] \
        [--json out.json]

Writes a synthetic partition in the output contract (``user_id``, ``recommendations`` = [{item_id, score}]
best first, ``source``, ``model_version``; 5% of users on the popularity fallback), with ``_SUCCESS`` and a
manifest, so ``recsys export`` takes it for a published one; starts a Redis server on loopback (the
project's binary; no persistence unless ``--appendonly``); runs the export (``recsys.pipelines.export.run_export``,
Spark ``local[C]``) ``--repeats`` times (``--force`` after the first: each run writes a new version and
switches to it; ``export.keep_versions`` = 1, so each later run also removes the one before) and reports, side
by side: users/s of the export (new version registered -> pointer switched), the Spark job alone, the
store's memory per user (``used_memory`` after the first export less before, over the users), and the value
encoding's bytes per user against the JSON a hand-written exporter would store (the same rows,
``json.dumps`` of the list). Everything it starts is stopped at the end.

On a shared machine the wall-clock figures fall with the load (printed beside them), so it also counts the
CPU seconds the export took: this process, the JVM and the Python workers (the process tree) plus the
Redis server, from the version's registration to the switch; ``users / (cpu seconds / cores)`` is what the
export would reach with the cores to itself (``users/s per C cores of CPU``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DATE = dt.date(2024, 6, 15)


def write_partition(root: Path, users: int, top_n: int, items: int, files: int, seed: int = 0):
    """A published partition under ``root/dt=DATE`` (data files, _SUCCESS, _manifest.json); returns the manifest."""
    from recsys.data.contracts import OUTPUT_SCHEMA, RECOMMENDATION_TYPE, SUCCESS_MARKER, partition_name
    from recsys.publish import manifest as manifest_file

    part = root / partition_name(DATE)
    part.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    fallback_ids = np.arange(1, top_n + 1, dtype=np.int64)
    fallback_scores = np.linspace(0.05, 0.001, top_n, dtype=np.float32)
    order = rng.permutation(users) + 1           # users hash-spread over files, as the job's tasks write them
    per = -(-users // files)
    for f in range(files):
        ids = np.sort(order[f * per:(f + 1) * per]).astype(np.int64)
        n = len(ids)
        item_ids = rng.integers(1, items + 1, size=(n, top_n), dtype=np.int64)
        scores = -np.sort(-rng.standard_normal((n, top_n)).astype(np.float32), axis=1)
        fallback = rng.random(n) < 0.05
        item_ids[fallback] = fallback_ids
        scores[fallback] = fallback_scores
        structs = pa.StructArray.from_arrays([pa.array(item_ids.ravel()), pa.array(scores.ravel())],
                                             fields=list(RECOMMENDATION_TYPE.value_type))
        recs = pa.ListArray.from_arrays(pa.array(np.arange(0, n * top_n + 1, top_n, dtype=np.int32)), structs,
                                        type=RECOMMENDATION_TYPE)
        source = pa.array(np.where(fallback, "popularity", "model"))
        table = pa.table([pa.array(ids), recs, source, pa.array(["1"] * n)], schema=OUTPUT_SCHEMA)
        pq.write_table(table, part / f"part-{f:05d}.parquet", compression="snappy")
    content = manifest_file.finish(manifest_file.Manifest(
        date=DATE, run_id=None, job_run=f"bench-{int(time.time())}", publish_method="benchmark",
        model=manifest_file.ModelRef(version="1", name="bench"), catalog_snapshot=DATE, config_digest="bench",
        counts=manifest_file.Counts(rows=users), validation={},
        fallback=manifest_file.FallbackList(name="popularity", item_ids=tuple(fallback_ids.tolist()),
                                            scores=tuple(fallback_scores.tolist()))))
    manifest_file.write(str(part), content)
    (part / SUCCESS_MARKER).write_text("")
    return content


def tree_cpu_s(*extra_pids: int) -> float:
    """CPU seconds (user + system, reaped children included) of this process, its descendants and ``extra_pids``."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True), *(psutil.Process(p) for p in extra_pids)]
    total = 0.0
    for proc in {p.pid: p for p in procs}.values():
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_by_process(redis_pid: int) -> dict[str, float]:
    """CPU seconds so far by kind of process: ``driver`` (this Python process), ``jvm`` (Spark's java),
    ``python_workers`` (the Python daemon and its workers, the export's tasks; reaped workers included) and
    ``redis``: where the export's CPU goes, to tell Spark's cost from the encoding's and the store's."""
    import psutil

    def cpu(proc, children=True) -> float:
        t = proc.cpu_times()
        return t.user + t.system + ((t.children_user + t.children_system) if children else 0.0)

    me = psutil.Process()
    out = {"driver": cpu(me, children=False), "jvm": 0.0, "python_workers": 0.0, "redis": 0.0}
    for proc in me.children(recursive=True):
        try:
            kind = "jvm" if "java" in proc.name() else "python_workers"
            out[kind] += cpu(proc, children=kind == "python_workers" and "java" in proc.parent().name())
        except psutil.NoSuchProcess:
            pass
    try:
        out["redis"] = cpu(psutil.Process(redis_pid), children=False)
    except psutil.NoSuchProcess:
        pass
    return out


def json_bytes_per_user(root: Path, sample: int = 20_000) -> float:
    """What a hand-written exporter storing JSON would store: ``json.dumps`` of each row's list and source."""
    from recsys.data.contracts import partition_name

    first = sorted((root / partition_name(DATE)).glob("part-*.parquet"))[0]
    rows = pq.read_table(first).slice(0, sample).to_pylist()
    return float(np.mean([len(json.dumps({"recommendations": r["recommendations"], "source": r["source"]}))
                          for r in rows]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=None, help="where the partition, Redis's data and Spark's files go")
    p.add_argument("--users", type=int, default=1_000_000)
    p.add_argument("--top-n", type=int, default=100)
    p.add_argument("--items", type=int, default=50_000)
    p.add_argument("--files", type=int, default=20, help="data files of the partition (the job writes one per task)")
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--appendonly", action="store_true", help="Redis with an append-only file (appendfsync everysec)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recsys config overrides, e.g. export.batch_users=500")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import redis

    from recsys.config import load_config
    from recsys.export.local_redis import LocalRedis
    from recsys.pipelines.export import run_export
    from recsys.spark.session import build_session

    work = args.work or Path(tempfile.mkdtemp(prefix="recsys-export-"))
    work.mkdir(parents=True, exist_ok=True)
    output = work / "recommendations"
    started = time.perf_counter()
    if not (output / f"dt={DATE}" / "_SUCCESS").is_file():
        write_partition(output, args.users, args.top_n, args.items, args.files)
    print(f"partition ready in {time.perf_counter() - started:.1f}s under {output}", flush=True)
    server = LocalRedis(work / "redis", appendonly=args.appendonly, appendfsync="everysec").start()
    results: dict = {"users": args.users, "top_n": args.top_n, "cores": args.cores, "files": args.files,
                     "appendonly": args.appendonly, "load_before": os.getloadavg(), "runs": []}
    spark = None
    try:
        cfg = load_config(overrides=[f"paths.output={output}", f"paths.work={work / 'work'}",
                                     f"paths.driver_scratch={work / 'driver'}", f"paths.events={work / 'events'}",
                                     f"paths.catalog={work / 'catalog'}", f"spark.master=local[{args.cores}]",
                                     f"export.redis_url={server.url}", "export.keep_versions=1",
                                     # the synthetic partition is a path-layout one (dt=DATE/, _SUCCESS): no table
                                     "output.table=null",
                                     f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}", *args.overrides])
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = build_session(cfg.spark, app_name="recsys-export-bench")
        client = redis.Redis.from_url(server.url)
        before = int(client.info("memory")["used_memory"])
        for i in range(args.repeats):
            cpu0 = tree_cpu_s(server.process.pid)
            by0 = cpu_by_process(server.process.pid)
            t0 = time.perf_counter()
            result = run_export(spark, cfg, DATE, force=i > 0)
            wall = time.perf_counter() - t0
            cpu = tree_cpu_s(server.process.pid) - cpu0
            by = {k: round(v - by0.get(k, 0.0), 1) for k, v in cpu_by_process(server.process.pid).items()}
            memory = int(client.info("memory")["used_memory"])
            run = {**result.figures, "version": result.version, "wall_s": round(wall, 2), "cpu_s": round(cpu, 1),
                   "users_per_s_of_cpu": round(result.figures["users"] / (cpu / args.cores)), "cpu_s_by_process": by,
                   "used_memory": memory, "keys": int(client.dbsize()), "removed": list(result.removed),
                   "load": os.getloadavg()}
            if i == 0:
                run["memory_per_user"] = round((memory - before) / result.figures["users"], 1)
                results["memory_per_user"] = run["memory_per_user"]
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
        results["json_bytes_per_user"] = round(json_bytes_per_user(output), 1)
        results["value_bytes_per_user"] = round(results["runs"][0]["value_bytes"] / args.users, 1)
    finally:
        if spark is not None:
            spark.stop()
        server.stop()
    results["load_after"] = os.getloadavg()
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def format_table(r: dict) -> str:
    lines = [f"export of {r['users']:,} users x top {r['top_n']} into a local Redis, Spark local[{r['cores']}], "
             f"{r['files']} files (load before {r['load_before'][0]:.1f}, after {r['load_after'][0]:.1f})",
             f"| run | version | users/s (export) | users/s per {r['cores']} cores of CPU | CPU s | export s | wall s "
             "(with removal) | removed | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, run in enumerate(r["runs"], 1):
        lines.append(f"| {i} | {run['version']} | {run['users_per_s']:,.0f} | {run['users_per_s_of_cpu']:,.0f} | "
                     f"{run['cpu_s']:.1f} | {run['seconds']:.1f} | {run['wall_s']:.1f} | "
                     f"{', '.join(run['removed']) or '-'} | {run['load'][0]:.1f} |")
    for i, run in enumerate(r["runs"], 1):
        if run.get("cpu_s_by_process"):
            lines.append(f"run {i} CPU s by process (removal included): "
                         + ", ".join(f"{k} {v:.1f}" for k, v in run["cpu_s_by_process"].items()))
    lines.append(f"\nRedis memory per user: {r['memory_per_user']:,.0f} bytes (used_memory after the first export "
                 f"less before); value: {r['value_bytes_per_user']:,.0f} bytes (this format) against "
                 f"{r['json_bytes_per_user']:,.0f} as JSON ({r['json_bytes_per_user'] / r['value_bytes_per_user']:.1f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
