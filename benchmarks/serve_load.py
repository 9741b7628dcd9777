"""Load test of `recsys serve` on loopback: C concurrent clients sending requests of K users, for the
on-demand path and for lookups from the published lists (Redis and the embedded index), in one run.

Bounded and self-stopping: every cell stops after --requests requests or --seconds seconds,
whichever comes first; the backend and the frontends it starts are stopped at the end (also on
Ctrl-C or an error). Nothing listens beyond 127.0.0.1.

For each frontend mode (batching on: serve.max_wait_ms=--wait-ms; off: max_wait_ms=0, one Spark
job per request) it starts a frontend on the same warm backend, measures the cold first answer
(frontend start to first 200: connect, window cache, model load), then every (C, K) cell:
throughput (requests/s, users/s), latency p50/p95/p99 of the answered requests, error rate by
status. An overload cell (--overload-clients clients of the largest K with a short deadline)
checks that the queue stays bounded, that every request gets an answer, 429 or 504, and that the
error counts in /metrics match what the clients saw.

Lookup modes (``redis``, ``embedded``): the published partition of ``--as-of`` must exist (``recsys recommend
--date AS_OF``); the test starts a Redis server of its own on loopback (the project's binary), exports the
partition into it (``recsys export``), and starts a frontend with ``serve.store`` on it (``redis``) or on the
partition (``embedded``), without a backend: every answer comes from the lists. The lookup modes run first,
before the backend is started (a running backend's maintenance jobs would share the cores with them); the
on-demand modes then run with ``serve.store=none``, as before the store existed.

Clients: every cell's clients run in a child process of their own, each on one HTTP/1.1 keep-alive
connection driven by asyncio (``GET /v1/users/{id}/recommendations`` for K = 1, ``POST /v1/recommendations``
otherwise), so the client's own cost (about 50 us a request) stays far below what it measures; latencies
are from writing the request to reading the whole body.

Prepare the data once (docs/on-demand.md), then, from the directory whose .recsys/ holds it:

    python benchmarks/serve_load.py --as-of 2018-09-25 --json serve_load.json
"""
from __future__ import annotations

import argparse
import asyncio
import os
import json
import multiprocessing
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from recsys.config import load_config
from recsys.processes import free_port
from recsys.serve import backend


def metrics(client: httpx.Client) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def start_frontend(args, overrides: list[str], port: int, log: Path) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "recsys.cli", "serve", "--port", str(port)]
    if args.conf:
        cmd += ["--conf", args.conf]
    for item in overrides:
        cmd += ["--set", item]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, started


def cold_first_answer(url: str, proc: subprocess.Popen, started: float, user: int, limit_s: float) -> float:
    """Seconds from the frontend's start to its first 200 (503s while it warms up are retried)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.monotonic() - started < limit_s:
            if proc.poll() is not None:
                raise RuntimeError(f"the frontend exited with {proc.returncode}")
            try:
                if client.post("/v1/recommendations", json={"user_ids": [user]}).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"no answer within {limit_s}s")


def run_cell(url: str, users: np.ndarray, clients: int, k: int, max_requests: int, max_seconds: float,
             timeout_ms: int | None = None, seed: int = 0) -> dict:
    """One cell: ``clients`` connections in a child process, until ``max_requests`` or ``max_seconds``."""
    with httpx.Client(base_url=url, timeout=30) as probe:
        before = metrics(probe)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        out = pool.apply(_client_process, (url, [int(u) for u in users], clients, k, max_requests, max_seconds,
                                           timeout_ms, seed))
    with httpx.Client(base_url=url, timeout=30) as probe:
        after = metrics(probe)
    codes, latencies, wall = out["codes"], out["latencies"], out["wall"]
    ok = codes.get(200, 0)
    total = sum(codes.values())
    lat = np.array(latencies) if latencies else np.array([np.nan])
    jobs = after.get("recsys_serve_spark_jobs_total{outcome=ok}", 0) - before.get("recsys_serve_spark_jobs_total{outcome=ok}", 0)
    server_errors = {code: after.get(f"recsys_serve_requests_total{{code={code}}}", 0)
                     - before.get(f"recsys_serve_requests_total{{code={code}}}", 0) for code in (429, 500, 503, 504)}
    return {
        "clients": clients, "k": k, "requests": total, "ok": ok, "wall_s": round(wall, 2),
        "requests_per_s": round(ok / wall, 2), "users_per_s": round(ok * k / wall, 1),
        "p50_s": round(float(np.percentile(lat, 50)), 4), "p95_s": round(float(np.percentile(lat, 95)), 4),
        "p99_s": round(float(np.percentile(lat, 99)), 4),
        "error_rate": round((total - ok) / total, 4) if total else 0.0,
        "codes": {str(c): n for c, n in sorted(codes.items())},
        "spark_jobs": int(jobs),
        "server_error_counts": {str(c): int(n) for c, n in server_errors.items()},
        "max_queue_users_seen": None,
        "bad_bodies": out["bad_bodies"],
    }


def _client_process(url, pool, clients, k, max_requests, max_seconds, timeout_ms, seed) -> dict:
    return asyncio.run(_clients(url, pool, clients, k, max_requests, max_seconds, timeout_ms, seed))


async def _clients(url, pool, clients, k, max_requests, max_seconds, timeout_ms, seed) -> dict:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname, parts.port
    state = {"sent": 0, "codes": {}, "latencies": [], "bad_bodies": 0}
    unknown_from = max(pool) + 1
    deadline = time.monotonic() + max_seconds

    def request(rng) -> bytes:
        if k == 1:
            return (f"GET /v1/users/{rng.choice(pool)}/recommendations HTTP/1.1\r\nHost: {host}\r\n\r\n").encode()
        ids = rng.sample(pool, k) if k <= len(pool) else pool + list(range(unknown_from, unknown_from + k - len(pool)))
        body = {"user_ids": ids, **({"timeout_ms": timeout_ms} if timeout_ms else {})}
        payload = json.dumps(body).encode()
        return (f"POST /v1/recommendations HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload

    async def one(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.monotonic() < deadline and state["sent"] < max_requests:
                state["sent"] += 1
                data = request(rng)
                t0 = time.perf_counter()
                try:
                    writer.write(data)
                    status = await reader.readline()
                    length = 0
                    while True:
                        line = await reader.readline()
                        if line in (b"\r\n", b""):
                            break
                        if line[:15].lower() == b"content-length:":
                            length = int(line[15:])
                    body = await reader.readexactly(length)
                    code = int(status.split()[1])
                except (OSError, asyncio.IncompleteReadError, IndexError, ValueError):
                    code = -1
                    body = b""
                elapsed = time.perf_counter() - t0
                state["codes"][code] = state["codes"].get(code, 0) + 1
                if code == 200:
                    state["latencies"].append(elapsed)
                    if b'"recommendations"' not in body:
                        state["bad_bodies"] += 1
                elif code == -1:
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
        finally:
            writer.close()

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(clients)))
    return {**state, "wall": time.monotonic() - started}


def run_overload(url: str, users: np.ndarray, clients: int, k: int, max_requests: int, max_seconds: float,
                 timeout_ms: int) -> dict:
    """Many clients with a short deadline: sample the queue while they run."""
    peak = [0.0]
    stop = threading.Event()

    def sampler() -> None:
        with httpx.Client(base_url=url, timeout=30) as probe:
            while not stop.is_set():
                peak[0] = max(peak[0], metrics(probe).get("recsys_serve_queue_users", 0))
                stop.wait(0.2)

    t = threading.Thread(target=sampler)
    t.start()
    try:
        cell = run_cell(url, users, clients, k, max_requests, max_seconds, timeout_ms=timeout_ms, seed=7)
    finally:
        stop.set()
        t.join()
    cell["max_queue_users_seen"] = int(peak[0])
    seen = {c: cell["codes"].get(str(c), 0) for c in (429, 500, 503, 504)}
    cell["errors_match_metrics"] = all(seen[c] == cell["server_error_counts"][str(c)] for c in seen)
    cell["unanswered"] = cell["codes"].get("-1", 0)
    return cell


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conf", help="recsys config (default: the embedded demo profile)")
    p.add_argument("--as-of", required=True, help="serve.as_of: the date whose window is served (demo: 2018-09-25)")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--k", default="1,1000", help="users per request")
    p.add_argument("--requests", type=int, default=300, help="at most this many requests per cell")
    p.add_argument("--seconds", type=float, default=30, help="at most this long per cell")
    p.add_argument("--wait-ms", type=int, default=20, help="serve.max_wait_ms with batching on")
    p.add_argument("--modes", default="redis,embedded,batched,per_request",
                   help="lookups: redis, embedded; on demand: batched, per_request")
    p.add_argument("--lookup-requests", type=int, default=20_000, help="at most this many requests per lookup cell")
    p.add_argument("--lookup-seconds", type=float, default=10, help="at most this long per lookup cell")
    p.add_argument("--overload-clients", type=int, default=64, help="0: no overload cell")
    p.add_argument("--overload-timeout-ms", type=int, default=5000)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    overrides_common = [f"serve.as_of={args.as_of}"]
    work = Path(tempfile.mkdtemp(prefix="recsys-serve-load-"))
    overrides_common.append(f"serve.backend_dir={work / 'backend'}")
    cfg = load_config(args.conf, overrides_common)
    modes = args.modes.split(",")
    results: dict = {"as_of": args.as_of, "cells": [], "cold": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "load_before": os.getloadavg()}
    procs: list[subprocess.Popen] = []
    redis_server = None

    def stop_all(*_):
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if "backend_start_s" in results:
            backend.stop(cfg)
        if redis_server is not None:
            redis_server.stop()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if "redis" in modes:
            from recsys.export.local_redis import LocalRedis

            redis_server = LocalRedis(work / "redis", appendonly=False).start()
            results["export"] = export_to(args, redis_server.url, work)
            print(f"exported {args.as_of} to {redis_server.url}: {results['export']}", flush=True)
        users = None
        # the lookup modes first, with no backend running: their frontends answer from the lists alone (a
        # backend would take CPU from them: its maintenance jobs, every serve.refresh_s); then the backend starts
        # for the on-demand modes
        modes = sorted(modes, key=lambda m: m in ON_DEMAND_MODES)
        for mode in modes:
            wait_ms = args.wait_ms if mode == "batched" else 0
            store = {"redis": redis_server.url if redis_server else "", "embedded": "embedded"}.get(mode, "none")
            extra = []
            if mode in ON_DEMAND_MODES and "backend_start_s" not in results:
                t0 = time.monotonic()
                results["backend_start_s"] = None          # from here on, stop_all() stops it
                state = backend.start(cfg)
                results["backend_start_s"] = round(time.monotonic() - t0, 1)
                print(f"backend {state.remote} up in {results['backend_start_s']}s", flush=True)
            elif mode not in ON_DEMAND_MODES:
                extra = [f"serve.backend_dir={work / 'no-backend'}"]   # none recorded there: lists only
            port = free_port()
            proc, started = start_frontend(args, overrides_common + [f"serve.max_wait_ms={wait_ms}",
                                                                     f"serve.store={store}", *extra], port,
                                           work / f"serve-{mode}.log")
            procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            if users is None:
                import pyarrow.dataset as ds

                table = ds.dataset(cfg.paths.events, format="parquet", partitioning="hive").to_table(columns=["user_id"])
                users = np.unique(table.column("user_id").to_numpy())
            cold = cold_first_answer(url, proc, started, int(users[0]), 600)
            results["cold"][mode] = round(cold, 2)
            print(f"{mode}: first answer {cold:.1f}s after the frontend started", flush=True)
            lookup = mode not in ON_DEMAND_MODES
            for k in [int(x) for x in args.k.split(",")]:
                for c in [int(x) for x in args.clients.split(",")]:
                    cpu0 = process_cpu_s(proc.pid), process_cpu_s(redis_server.process.pid) if redis_server else 0.0
                    cell = run_cell(url, users, c, k, args.lookup_requests if lookup else args.requests,
                                    args.lookup_seconds if lookup else args.seconds)
                    cell["load"] = os.getloadavg()[0]
                    if cell["ok"]:   # CPU per answer: what the frontend (and Redis) cost, whatever the load
                        cell["frontend_cpu_us"] = round((process_cpu_s(proc.pid) - cpu0[0]) / cell["ok"] * 1e6)
                        if mode == "redis":
                            cell["redis_cpu_us"] = round((process_cpu_s(redis_server.process.pid) - cpu0[1])
                                                         / cell["ok"] * 1e6)
                    cell["mode"] = mode
                    results["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
            if mode == "batched" and args.overload_clients:
                k = max(int(x) for x in args.k.split(","))
                cell = run_overload(url, users, args.overload_clients, k, args.requests * 2,
                                    args.seconds, args.overload_timeout_ms)
                cell["mode"] = "overload"
                results["cells"].append(cell)
                print(json.dumps(cell), flush=True)
            proc.terminate()
            proc.wait(120)
    finally:
        stop_all()
    results["load_after"] = os.getloadavg()
    results["ratios"] = ratios(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(format_table(results))
    return 0


ON_DEMAND_MODES = ("batched", "per_request", "overload")


def process_cpu_s(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.NoSuchProcess:
        return 0.0


def export_to(args, redis_url: str, work: Path) -> dict:
    """``recsys export --date AS_OF`` into the test's Redis; its summary line and wall time."""
    cmd = [sys.executable, "-m", "recsys.cli", "export", "--date", args.as_of, "--set", f"export.redis_url={redis_url}",
           "--set", f"paths.work={work / 'work'}"]
    if args.conf:
        cmd += ["--conf", args.conf]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"recsys export exited with {done.returncode}: {done.stderr[-2000:]}")
    return {"summary": done.stdout.strip().splitlines()[-1], "wall_s": round(time.monotonic() - started, 1)}


def ratios(results: dict) -> dict:
    """Answered requests/s of each lookup mode over the batched on-demand mode's, per (C, K), same run."""
    cells = {(c["mode"], c["clients"], c["k"]): c for c in results["cells"]}
    out = {}
    for (mode, clients, k), cell in cells.items():
        base = cells.get(("batched", clients, k))
        if mode in ("redis", "embedded") and base and base["requests_per_s"]:
            out[f"{mode}/batched C={clients} K={k}"] = round(cell["requests_per_s"] / base["requests_per_s"], 1)
    return out


def format_table(results: dict) -> str:
    lines = ["| mode | C | K | requests | req/s | users/s | p50 ms | p95 ms | p99 ms | errors | Spark jobs | "
             "frontend CPU us/answer | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        cpu = str(c.get("frontend_cpu_us", "")) + (f" (+ Redis {c['redis_cpu_us']})" if "redis_cpu_us" in c else "")
        lines.append(f"| {c['mode']} | {c['clients']} | {c['k']} | {c['requests']} | {c['requests_per_s']} | "
                     f"{c['users_per_s']} | {c['p50_s'] * 1000:.1f} | {c['p95_s'] * 1000:.1f} | {c['p99_s'] * 1000:.1f} | "
                     f"{c['error_rate']:.1%} {c['codes']} | {c['spark_jobs']} | {cpu} | {c.get('load', 0):.1f} |")
    cold = ", ".join(f"{m}: {s}s" for m, s in results["cold"].items())
    lines.append(f"\ncold first answer (frontend start -> first 200, model load included): {cold}")
    if results.get("ratios"):
        lines.append("answered requests/s against batched on demand, same run: "
                     + ", ".join(f"{k} {v}x" for k, v in results["ratios"].items()))
    lines.append(f"load average before {results['load_before'][0]:.1f}, after {results.get('load_after', [0])[0]:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
