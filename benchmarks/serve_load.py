"""Load test of `recsys serve` on loopback: C concurrent clients sending requests of K users.

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

Prepare the data once (docs/on-demand.md), then, from the directory whose .recsys/ holds it:

    python benchmarks/serve_load.py --as-of 2018-09-25 --json serve_load.json
"""
from __future__ import annotations

import argparse
import json
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
    lock = threading.Lock()
    latencies: list[float] = []
    codes: dict[int, int] = {}
    sent = [0]
    deadline = time.monotonic() + max_seconds

    pool = [int(u) for u in users]
    unknown_from = max(pool) + 1

    def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=url, timeout=max_seconds + 60) as client:
            while time.monotonic() < deadline:
                with lock:
                    if sent[0] >= max_requests:
                        return
                    sent[0] += 1
                if k <= len(users):
                    ids = [int(u) for u in rng.sample(pool, k)]
                else:   # more ids than users in the window: the rest are unknown users (the fallback)
                    ids = pool + list(range(unknown_from, unknown_from + k - len(pool)))
                body = {"user_ids": ids}
                if timeout_ms:
                    body["timeout_ms"] = timeout_ms
                t0 = time.monotonic()
                try:
                    code = client.post("/v1/recommendations", json=body).status_code
                except httpx.TransportError:
                    code = -1
                elapsed = time.monotonic() - t0
                with lock:
                    codes[code] = codes.get(code, 0) + 1
                    if code == 200:
                        latencies.append(elapsed)

    with httpx.Client(base_url=url, timeout=30) as probe:
        before = metrics(probe)
    started = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    with httpx.Client(base_url=url, timeout=30) as probe:
        after = metrics(probe)
    ok = codes.get(200, 0)
    total = sum(codes.values())
    lat = np.array(latencies) if latencies else np.array([np.nan])
    jobs = after.get("recsys_serve_spark_jobs_total{outcome=ok}", 0) - before.get("recsys_serve_spark_jobs_total{outcome=ok}", 0)
    server_errors = {code: after.get(f"recsys_serve_requests_total{{code={code}}}", 0)
                     - before.get(f"recsys_serve_requests_total{{code={code}}}", 0) for code in (429, 500, 503, 504)}
    return {
        "clients": clients, "k": k, "requests": total, "ok": ok, "wall_s": round(wall, 2),
        "requests_per_s": round(ok / wall, 2), "users_per_s": round(ok * k / wall, 1),
        "p50_s": round(float(np.percentile(lat, 50)), 3), "p95_s": round(float(np.percentile(lat, 95)), 3),
        "p99_s": round(float(np.percentile(lat, 99)), 3),
        "error_rate": round((total - ok) / total, 4) if total else 0.0,
        "codes": {str(c): n for c, n in sorted(codes.items())},
        "spark_jobs": int(jobs),
        "server_error_counts": {str(c): int(n) for c, n in server_errors.items()},
        "max_queue_users_seen": None,
    }


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
    p.add_argument("--modes", default="batched,per_request")
    p.add_argument("--overload-clients", type=int, default=64, help="0: no overload cell")
    p.add_argument("--overload-timeout-ms", type=int, default=5000)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    overrides_common = [f"serve.as_of={args.as_of}"]
    work = Path(tempfile.mkdtemp(prefix="recsys-serve-load-"))
    overrides_common.append(f"serve.backend_dir={work / 'backend'}")
    cfg = load_config(args.conf, overrides_common)
    results: dict = {"as_of": args.as_of, "cells": [], "cold": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    procs: list[subprocess.Popen] = []

    def stop_all(*_):
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        backend.stop(cfg)

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        t0 = time.monotonic()
        state = backend.start(cfg)
        results["backend_start_s"] = round(time.monotonic() - t0, 1)
        print(f"backend {state.remote} up in {results['backend_start_s']}s", flush=True)
        users = None
        for mode in args.modes.split(","):
            wait_ms = args.wait_ms if mode == "batched" else 0
            port = backend.free_port()
            proc, started = start_frontend(args, overrides_common + [f"serve.max_wait_ms={wait_ms}"], port,
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
            for k in [int(x) for x in args.k.split(",")]:
                for c in [int(x) for x in args.clients.split(",")]:
                    cell = run_cell(url, users, c, k, args.requests, args.seconds)
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
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(format_table(results))
    return 0


def format_table(results: dict) -> str:
    lines = ["| mode | C | K | requests | req/s | users/s | p50 s | p95 s | p99 s | errors | Spark jobs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        lines.append(f"| {c['mode']} | {c['clients']} | {c['k']} | {c['requests']} | {c['requests_per_s']} | "
                     f"{c['users_per_s']} | {c['p50_s']} | {c['p95_s']} | {c['p99_s']} | "
                     f"{c['error_rate']:.1%} {c['codes']} | {c['spark_jobs']} |")
    cold = ", ".join(f"{m}: {s}s" for m, s in results["cold"].items())
    lines.append(f"\ncold first answer (frontend start -> first 200, model load included): {cold}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
