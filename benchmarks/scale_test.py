"""Streaming at scale (issue 4): the full nightly job at 250k and at 1M users, peak memory compared.

For each user count: generate a synthetic dataset (50k items, 14 days), register a randomly
initialised default-sized model over the catalog's items in a fresh MLflow store, then run
``recsys recommend`` in a child process and sample the resident memory of the process tree:
the driver (the Python process), the JVM, and the Python workers (peak of any one worker).

    python benchmarks/scale_test.py --work /tmp/recsys-scale [--users 250000 1000000] [--json out.json]

Memory is flat when each peak at 1M users is within 20% of its value at 250k users. The JVM's
heap is bounded by ``spark.driver.memory`` (set here explicitly, the same for both runs).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

END_DATE = dt.date(2024, 6, 14)
RUN_DATE = END_DATE + dt.timedelta(days=1)


def register_random_model(root: Path, tracking_uri: str, items: np.ndarray) -> None:
    """A default-shaped SASRec over ``items``, registered as recsys-default@champion."""
    import mlflow

    from recsys.config import load_config
    from recsys.model.io import save_model
    from recsys.model.sasrec import SASRec, SASRecConfig
    from recsys.tracking import store as tracking

    import torch

    torch.manual_seed(0)
    model = SASRec(SASRecConfig(num_items=len(items), dim=64, layers=2, heads=2, max_len=50, dropout=0.0)).eval()
    cfg = load_config(overrides=[f"mlflow.tracking_uri={tracking_uri}", f"mlflow.artifact_location={root / 'artifacts'}"])
    experiment = tracking.setup(cfg.mlflow, "scale-test")
    model_dir = save_model(model, items, root / "model")
    with mlflow.start_run(experiment_id=experiment) as run:
        mlflow.log_artifacts(str(model_dir), "model")
        uri = mlflow.get_artifact_uri("model")
    version = tracking.register_version(cfg.mlflow.model_name, run.info.run_id, uri)
    tracking.set_alias(cfg.mlflow.model_name, cfg.mlflow.alias, version)


def sample_tree(pid: int, peaks: dict, stop: threading.Event) -> None:
    root = psutil.Process(pid)
    while not stop.wait(0.25):
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                name = " ".join(p.cmdline()[:3])
                rss = p.memory_info().rss / 2**20
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            kind = "driver_python" if p.pid == pid else ("jvm" if "java" in name else "python_worker")
            peaks[kind] = max(peaks.get(kind, 0.0), rss)


def run_scale(users: int, items: int, work: Path, top_n: int, driver_memory: str) -> dict:
    from recsys.data.sample import generate_sample

    root = work / f"u{users}"
    data = root / "data"
    started = time.perf_counter()
    summary = generate_sample(data, users=users, items=items, days=14, seed=11, end_date=END_DATE, overwrite=True)
    gen_s = time.perf_counter() - started
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    if (root / "mlflow.db").exists():
        (root / "mlflow.db").unlink()
    register_random_model(root, tracking_uri, np.arange(1, items + 1, dtype=np.int64))
    overrides = [
        f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}", f"paths.output={root / 'out'}",
        f"paths.work={root / 'work'}", f"paths.driver_scratch={root / 'driver'}", f"mlflow.tracking_uri={tracking_uri}",
        f"mlflow.artifact_location={root / 'artifacts'}", "history.window_days=30", f"scoring.top_n={top_n}",
        f"spark.conf.spark.driver.memory={driver_memory}", "spark.master=local[2,4]",
    ]
    cmd = [sys.executable, "-m", "recsys.cli", "recommend", "--date", str(RUN_DATE), "--force"]
    for o in overrides:
        cmd += ["--set", o]
    peaks: dict = {}
    stop = threading.Event()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = threading.Thread(target=sample_tree, args=(proc.pid, peaks, stop), daemon=True)
    sampler.start()
    log = proc.communicate()[0]
    stop.set()
    sampler.join()
    job_s = time.perf_counter() - started
    (root / "recommend.log").write_text(log)   # the job's whole log (progress lines included)
    if proc.returncode != 0:
        raise SystemExit(f"recommend failed for {users} users (exit {proc.returncode}):\n{log[-5000:]}")
    manifest = json.loads((root / "out" / f"dt={RUN_DATE}" / "_manifest.json").read_text())
    marker = "seconds by stage: "   # recsys.pipelines.nightly.STAGE_BREAKDOWN, the run's last figures
    lines = [line for line in log.splitlines() if marker in line]
    breakdown = json.loads(lines[-1].split(marker, 1)[1]) if lines else {}
    if breakdown:
        breakdown["start-up and exit"] = round(job_s - breakdown["total"], 2)   # before the timer: JVM, session
    return {
        "users": users, "items": items, "events": summary.events, "generate_s": gen_s, "job_s": job_s,
        "rows": manifest["counts"]["rows"], "peak_mb": peaks,
        "worker_peak_mb_reported": manifest["metrics"].get("worker_rss_mb_max"),
        "timings": manifest["timings"], "users_per_s": manifest["metrics"].get("users_per_s"),
        "breakdown_s": breakdown,
    }


def print_breakdown(r: dict) -> None:
    """Where the job's wall time went: each stage's seconds and share, and the job over its scoring stage."""
    b = r["breakdown_s"]
    if not b:
        return
    print(f"\n{r['users']:,} users: job wall {r['job_s']:.1f} s")
    for name, seconds in b.items():
        if name != "total":
            print(f"  {name:20s} {seconds:8.1f} s  {seconds / r['job_s']:6.1%}")
    if b.get("score"):
        print(f"  job wall / scoring stage: {r['job_s'] / b['score']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--users", type=int, nargs="+", default=[250_000, 1_000_000])
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--top-n", type=int, default=100)
    parser.add_argument("--driver-memory", default="2g", help="spark.driver.memory, the JVM heap cap (the same for every run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    results = []
    for users in args.users:
        print(f"== {users:,} users x {args.items:,} items", flush=True)
        r = run_scale(users, args.items, args.work, args.top_n, args.driver_memory)
        print(json.dumps(r, indent=2), flush=True)
        print_breakdown(r)
        results.append(r)
    if len(results) >= 2:
        base, big = results[0], results[-1]
        print(f"\npeak memory, {big['users']:,} vs {base['users']:,} users:")
        for kind in ("driver_python", "jvm", "python_worker"):
            a, b = base["peak_mb"].get(kind, float("nan")), big["peak_mb"].get(kind, float("nan"))
            print(f"  {kind:14s} {a:8,.0f} MB -> {b:8,.0f} MB  ({b / a - 1:+.1%})")
        print(f"  job time: {base['job_s']:.0f} s -> {big['job_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
