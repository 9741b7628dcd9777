"""Training at scale (issue 21): ``recsys train`` at 250k and at 1M users, peak memory of each process compared.

The training twin of ``benchmarks/scale_test.py``. For each user count: generate a synthetic dataset
(14 days, ``--items`` items), then run ``recsys train`` in a child process and sample the resident
memory of its process tree every 0.25 s: the driver (the Python process: it is also the training
process with ``train.processes=1``), the JVM, Spark's Python workers (peak of any one), and with
``--processes 2`` the data-parallel training processes TorchDistributor starts (peak of any one).

    python benchmarks/train_scale.py --work /tmp/recsys-train-scale [--users 250000 1000000] \\
        [--processes 1] [--json out.json]

The model is small and trains one epoch with large batches (the point is the data path: histories
written by the executors as shards and streamed by the training process, never collected), but it
is a real training: every window of every user goes through the model once, every held-out user
is ranked for validation, and the version is registered. Memory is flat when each peak at 1M users
is within 20% of its value at 250k.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

END_DATE = dt.date(2024, 6, 14)
RUN_DATE = END_DATE + dt.timedelta(days=1)
MODEL = ["train.model.sasrec.dim=16", "train.model.sasrec.layers=1", "train.model.sasrec.heads=1",
         "train.model.sasrec.max_len=20", "train.epochs=1", "train.refit=false", "train.batch_size=256",
         "train.learning_rate=0.004", "train.device=cpu"]


def kind_of(proc: psutil.Process, root_pid: int) -> str:
    if proc.pid == root_pid:
        return "driver_python"
    cmd = " ".join(proc.cmdline())
    if "java" in cmd.split(" ", 1)[0]:
        return "jvm"
    if "torch_run_process_wrapper" in cmd or "torch.distributed.run" in cmd:
        return "torchrun_agent"
    if cmd.endswith("train.py") or "/train.py" in cmd:
        return "training_process"
    return "spark_python_worker"


def sample_tree(pid: int, peaks: dict, stop: threading.Event) -> None:
    root = psutil.Process(pid)
    while not stop.wait(0.25):
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                kind, rss = kind_of(p, pid), p.memory_info().rss / 2**20
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            peaks[kind] = max(peaks.get(kind, 0.0), rss)


def run_scale(users: int, items: int, work: Path, processes: int, driver_memory: str) -> dict:
    from recsys.data.sample import SampleSpec, generate_sample

    root = work / f"u{users}"
    data = root / "data"
    started = time.perf_counter()
    if not (data / "events").exists():
        generate_sample(data, SampleSpec(users=users, items=items, days=14, seed=11, end_date=END_DATE), overwrite=True)
    gen_s = time.perf_counter() - started
    if (root / "mlflow.db").exists():
        (root / "mlflow.db").unlink()
    overrides = [
        f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}", f"paths.work={root / 'work'}",
        f"paths.driver_scratch={root / 'driver'}", f"mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}",
        f"mlflow.artifact_location={root / 'artifacts'}", "history.window_days=30",
        f"spark.conf.spark.driver.memory={driver_memory}", "spark.master=local[2,4]",
        f"train.processes={processes}", *MODEL,
    ]
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--date", str(RUN_DATE), "--force"]
    for o in overrides:
        cmd += ["--set", o]
    from scale_test import run_sampled

    peaks: dict = {}
    code, job_s, log = run_sampled(cmd, lambda pid, stop: sample_tree(pid, peaks, stop))
    (root / f"train-{processes}.log").write_text(log)
    if code != 0:
        raise SystemExit(f"train failed for {users} users (exit {code}):\n{log[-5000:]}")
    stages = {}
    for line in log.splitlines():   # "[train D] <stage label> done in 12.3s: ..."
        if "] " in line and " done in " in line:
            label = line.split("] ", 1)[1].split(" done in ")[0]
            stages[label] = float(line.split(" done in ")[1].split("s", 1)[0])
    figures = {k: v for line in log.splitlines() if "write the training histories as shards done" in line
               for k, v in [kv.split("=") for kv in line.split(": ", 2)[-1].split(", ") if "=" in kv]}
    return {"users": users, "items": items, "processes": processes, "generate_s": round(gen_s, 1),
            "job_s": round(job_s, 1), "peak_mb": {k: round(v) for k, v in peaks.items()}, "stages_s": stages,
            "shards": figures, "summary": next((ln for ln in log.splitlines() if ln.startswith("trained model")), "")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--users", type=int, nargs="+", default=[250_000, 1_000_000])
    parser.add_argument("--items", type=int, default=5_000)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--driver-memory", default="2g", help="spark.driver.memory, the JVM heap cap (the same for every run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    results = []
    for users in args.users:
        print(f"== {users:,} users x {args.items:,} items, {args.processes} training process(es)", flush=True)
        r = run_scale(users, args.items, args.work, args.processes, args.driver_memory)
        print(json.dumps(r, indent=2), flush=True)
        results.append(r)
    if len(results) >= 2:
        base, big = results[0], results[-1]
        print(f"\npeak memory, {big['users']:,} vs {base['users']:,} users:")
        for kind in sorted(set(base["peak_mb"]) | set(big["peak_mb"])):
            a, b = base["peak_mb"].get(kind, float("nan")), big["peak_mb"].get(kind, float("nan"))
            print(f"  {kind:20s} {a:8,.0f} MB -> {b:8,.0f} MB  ({b / a - 1:+.1%})")
        print(f"  job time: {base['job_s']:.0f} s -> {big['job_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
