"""Streaming at scale (issue 4): the full nightly job at 250k and at 1M users, peak memory compared.

For each user count: generate a synthetic dataset (50k items, 14 days), register a randomly
initialised default-sized model over the catalog's items in a fresh MLflow store, then run
``recsys recommend`` in a child process and sample the resident memory of the process tree:
the driver (the Python process), the JVM, and the Python workers (peak of any one worker).

    python benchmarks/scale_test.py --work /tmp/recsys-scale [--users 250000 1000000] [--json out.json]
    python benchmarks/scale_test.py --work /tmp/recsys-scale --users 1000000 --guard-nights [--repeats 2]

Memory is flat when each peak at 1M users is within 20% of its value at 250k users. The JVM's
heap is bounded by ``spark.driver.memory`` (set here explicitly, the same for both runs).

``--guard-nights`` (issue 22): two consecutive nights, so the second is compared with the first and
measures its realized hit rate; the second night then runs again with ``guard.compare=false`` (no
comparison, no hit rate; ``--repeats`` times each, interleaved), and the script prints what the
comparison and the hit rate add to the job's wall time, stage by stage, as a share of the job's wall
time with them.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
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


def sample_tree(pid: int, peaks: dict, stop: threading.Event, cpu: dict | None = None) -> None:
    """Peak RSS per kind of process; with ``cpu``, each process's last seen CPU seconds (user + system),
    by pid: their sum is the run's CPU time, which a loaded shared machine distorts less than wall time."""
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
                if cpu is not None:
                    t = p.cpu_times()
                    cpu[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            kind = "driver_python" if p.pid == pid else ("jvm" if "java" in name else "python_worker")
            peaks[kind] = max(peaks.get(kind, 0.0), rss)


def run_sampled(cmd: list[str], sample, cwd: Path | None = None) -> tuple[int, float, str]:
    """Run ``cmd`` to its end with ``sample(pid, stop)`` polling its process tree on a thread meanwhile
    (e.g. :func:`sample_tree`); its exit code, wall seconds and output (stdout and stderr together)."""
    stop = threading.Event()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    sampler = threading.Thread(target=sample, args=(proc.pid, stop), daemon=True)
    sampler.start()
    out = proc.communicate()[0]
    stop.set()
    sampler.join()
    return proc.returncode, time.perf_counter() - started, out


def prepare(users: int, items: int, work: Path) -> tuple[Path, float, int]:
    """A fresh dataset and model store for ``users``: (its root, seconds to generate, events)."""
    from recsys.data.sample import SampleSpec, generate_sample

    root = work / f"u{users}"
    data = root / "data"
    started = time.perf_counter()
    summary = generate_sample(data, SampleSpec(users=users, items=items, days=14, seed=11, end_date=END_DATE),
                              overwrite=True)
    gen_s = time.perf_counter() - started
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    if (root / "mlflow.db").exists():
        (root / "mlflow.db").unlink()
    shutil.rmtree(root / "out", ignore_errors=True)
    shutil.rmtree(root / "metastore", ignore_errors=True)   # its table would point at the removed output
    register_random_model(root, tracking_uri, np.arange(1, items + 1, dtype=np.int64))
    return root, gen_s, summary.events


def run_scale(users: int, items: int, work: Path, top_n: int, driver_memory: str) -> dict:
    root, gen_s, events = prepare(users, items, work)
    r = run_night(root, users, items, top_n, driver_memory, RUN_DATE)
    return {"users": users, "items": items, "events": events, "generate_s": gen_s, **r}


def run_night(root: Path, users: int, items: int, top_n: int, driver_memory: str, date: dt.date,
              extra: tuple[str, ...] = (), flags: tuple[str, ...] = ()) -> dict:
    """``recsys recommend --date DATE --force`` in a child process, its memory sampled; its figures."""
    data = root / "data"
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    overrides = [
        f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}", f"paths.output={root / 'out'}",
        f"paths.work={root / 'work'}", f"paths.driver_scratch={root / 'driver'}", f"mlflow.tracking_uri={tracking_uri}",
        f"output.metastore.dir={root / 'metastore'}",   # the default output.table's embedded metastore, not the cwd's
        f"mlflow.artifact_location={root / 'artifacts'}", "history.window_days=30", f"scoring.top_n={top_n}",
        f"spark.conf.spark.driver.memory={driver_memory}", "spark.master=local[2,4]", *extra,
    ]
    cmd = [sys.executable, "-m", "recsys.cli", "recommend", "--date", str(date), "--force", *flags]
    for o in overrides:
        cmd += ["--set", o]
    peaks: dict = {}
    cpu: dict = {}
    code, job_s, log = run_sampled(cmd, lambda pid, stop: sample_tree(pid, peaks, stop, cpu))
    (root / f"recommend-{date}{'-' + '-'.join(extra) if extra else ''}.log").write_text(log)   # the whole log
    if code != 0:
        raise SystemExit(f"recommend failed for {users} users (exit {code}):\n{log[-5000:]}")
    manifest = json.loads((root / "out" / f"dt={date}" / "_manifest.json").read_text())
    marker = "seconds by stage: "   # recsys.pipelines.nightly.STAGE_BREAKDOWN, the run's last figures
    lines = [line for line in log.splitlines() if marker in line]
    breakdown = json.loads(lines[-1].split(marker, 1)[1]) if lines else {}
    if breakdown:
        breakdown["start-up and exit"] = round(job_s - breakdown["total"], 2)   # before the timer: JVM, session
    return {
        "users": users, "items": items, "date": str(date), "job_s": job_s, "cpu_s": sum(cpu.values()),
        "tasks": manifest["metrics"].get("tasks"), "task_s": manifest["metrics"].get("task_s"),
        "rows": manifest["counts"]["rows"], "peak_mb": peaks,
        "worker_peak_mb_reported": manifest["metrics"].get("worker_rss_mb_max"),
        "timings": manifest["timings"], "users_per_s": manifest["metrics"].get("users_per_s"),
        "breakdown_s": breakdown,
        "guard": {k: v for k, v in manifest["metrics"].items()
                  if k.startswith(("realized_", "jaccard_", "compare_s", "score_psi", "users_", "overlap_"))},
        "verdict": ((manifest.get("quality") or {}).get("guard") or {}).get("summary"),
    }


def guard_nights(users: int, items: int, work: Path, top_n: int, driver_memory: str, repeats: int) -> dict:
    """Two consecutive nights, then the second again without the comparison, interleaved ``repeats`` times."""
    root, gen_s, events = prepare(users, items, work)
    # a random model: whatever the guard says of it, the nights are published (--accept-guard) and timed the same
    accept = ("--accept-guard",)
    first = run_night(root, users, items, top_n, driver_memory, RUN_DATE - dt.timedelta(days=1), flags=accept)
    print(f"night 1 ({first['date']}): {first['job_s']:.1f} s; {first['verdict']}", flush=True)
    on, off = [], []
    for i in range(repeats):
        for runs, extra in ((on, ()), (off, ("guard.compare=false",))):
            r = run_night(root, users, items, top_n, driver_memory, RUN_DATE, extra, accept)
            runs.append(r)
            print(f"night 2 ({r['date']}) {'without' if extra else 'with'} the comparison, run {i + 1}: "
                  f"{r['job_s']:.1f} s wall, {r['cpu_s']:.0f} s CPU, {r['tasks']} scoring tasks, stages "
                  f"{json.dumps(r['breakdown_s'])} (load {os.getloadavg()[0]:.1f})", flush=True)
    return {"users": users, "items": items, "events": events, "generate_s": gen_s, "first": first, "on": on, "off": off}


def print_guard_share(g: dict) -> None:
    """What comparing with the previous night and measuring its realized hit rate cost, as shares of the
    wall time of the job with them: medians of the interleaved runs, stage by stage."""
    on, off = g["on"], g["off"]
    wall_on, wall_off = np.median([r["job_s"] for r in on]), np.median([r["job_s"] for r in off])
    print(f"\n{g['users']:,} users, night 2 with / without the comparison ({len(on)} runs each, medians):")
    stages = sorted({k for r in on + off for k in r["breakdown_s"] if k != "total"})
    for name in stages:
        a = np.median([r["breakdown_s"].get(name, 0.0) for r in on])
        b = np.median([r["breakdown_s"].get(name, 0.0) for r in off])
        print(f"  {name:20s} {a:8.1f} s  {b:8.1f} s  {a - b:+7.1f} s  {(a - b) / wall_on:+7.2%}")
    compare_s = np.median([r["guard"].get("compare_s", 0.0) for r in on])
    task_s = np.median([r["task_s"] or 0.0 for r in on])
    cpu_on, cpu_off = np.median([r["cpu_s"] for r in on]), np.median([r["cpu_s"] for r in off])
    print(f"  job wall             {wall_on:8.1f} s  {wall_off:8.1f} s  {wall_on - wall_off:+7.1f} s  "
          f"{(wall_on - wall_off) / wall_on:+7.2%}   <- the comparison and the hit rate's share of the job's wall time")
    print(f"  job CPU (all procs)  {cpu_on:8.1f} s  {cpu_off:8.1f} s  {cpu_on - cpu_off:+7.1f} s  "
          f"{(cpu_on - cpu_off) / cpu_on:+7.2%}   <- the same as a share of the CPU time (less distorted by load)")
    print(f"  the scoring tasks' own comparison work: {compare_s:.1f} s of {task_s:.1f} s task time "
          f"({compare_s / task_s if task_s else float('nan'):.2%})")
    last = on[-1]["guard"]
    print(f"  figures: realized users {last.get('realized_users', 0):,.0f}, HR@10 {last.get('realized_hr_at_10', float('nan')):.4f}"
          f" (popularity {last.get('realized_pop_hr_at_10', float('nan')):.4f}), Jaccard@N mean "
          f"{last.get('jaccard_at_n_mean', float('nan')):.4f}; {on[-1]['verdict']}")


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
    parser.add_argument("--guard-nights", action="store_true",
                        help="two consecutive nights, the second with and without the comparison (issue 22)")
    parser.add_argument("--repeats", type=int, default=1, help="--guard-nights: runs of night 2 each way")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if args.guard_nights:
        out = []
        for users in args.users:
            print(f"== {users:,} users x {args.items:,} items, two nights", flush=True)
            g = guard_nights(users, args.items, args.work, args.top_n, args.driver_memory, args.repeats)
            print_guard_share(g)
            out.append(g)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        return 0
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
