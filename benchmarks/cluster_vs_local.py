"""Wall time of the nightly job on a standalone cluster beside local mode: same inputs, model and cores.

    .venv/bin/python benchmarks/cluster_vs_local.py [--users 3000] [--items 500] [--repeats 2] [--json out.json]

Starts a Master and two Workers with one core each (tests/clusterkit.py: the Workers cannot see the
checkout, the virtualenv or the driver's scratch), generates a synthetic dataset, trains one model
(local mode), then runs ``./spark-submit.sh jobs/nightly_recommendations.py`` for the same date,
alternating ``--master local[2]`` and ``--pack --master spark://...`` (two cores each way), each run
into its own output root. Reports per run: the submit's wall time (JVM start, executors, for the
cluster the archive fetch and unpack on each executor, the job) and the job's own figures from the
manifest (total and scoring stage seconds, users/s). The packed archive must already be cached
(``./spark-submit.sh --pack`` builds it once); its build time is not part of either figure.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "tests"))

import clusterkit  # noqa: E402

END = dt.date(2024, 3, 10)
DATE = END + dt.timedelta(days=1)


def submit(args: list[str]) -> tuple[int, float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_", "RECSYS_"))}
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    started = time.monotonic()
    done = subprocess.run([str(HERE / "spark-submit.sh"), *args], cwd=HERE, env=env, capture_output=True, text=True)
    return done.returncode, time.monotonic() - started, done.stderr


def sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="recsys-cluster-bench-"))
    shared, private = root / "shared", root / "driver-private"
    shared.mkdir()
    private.mkdir()
    data = shared / "data"
    subprocess.run([sys.executable, "-m", "recsys.cli", "sample-data", "--out", str(data), "--users", str(opts.users),
                    "--items", str(opts.items), "--days", "14", "--end-date", str(END)], check=True, cwd=root,
                   capture_output=True)
    base = [f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}",
            f"paths.driver_scratch={private / 'scratch'}", f"mlflow.tracking_uri=sqlite:///{private / 'mlflow.db'}",
            f"mlflow.artifact_location={private / 'artifacts'}", "history.window_days=60", "scoring.top_n=20",
            "scoring.partitions=4", "train.epochs=2", "train.model.sasrec.dim=32", "train.model.sasrec.layers=1",
            "train.model.sasrec.heads=1", "train.model.sasrec.max_len=20"]
    code, seconds, err = submit(["--master", "local[2]", "jobs/train.py", "--date", str(DATE),
                                 *sets(base + [f"paths.work={shared / 'work-train'}"])])
    if code != 0:
        print(err[-3000:], file=sys.stderr)
        return 1
    print(f"trained in {seconds:.0f}s (local[2]); data: {opts.users} users x {opts.items} items, 14 days", flush=True)
    spark_conf = ["--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.memory=1g",
                  "--conf", "spark.executor.memory=1g"]
    runs: list[dict] = []
    with clusterkit.start(root / "cluster", hidden=[HERE, Path(sys.prefix), private]) as cluster:
        for i in range(opts.repeats):
            for mode in ("local", "cluster"):
                master = (["--master", "local[2]", "--conf", "spark.driver.memory=1g"] if mode == "local"
                          else ["--pack", "--master", cluster.url, *spark_conf])
                out = shared / f"out-{mode}-{i}"
                code, seconds, err = submit([*master, "jobs/nightly_recommendations.py", "--date", str(DATE),
                                             *sets(base + [f"paths.output={out}", f"paths.work={shared / 'work'}"])])
                if code != 0:
                    print(err[-3000:], file=sys.stderr)
                    return 1
                manifest = json.loads((out / f"dt={DATE}" / "_manifest.json").read_text())
                m, t = manifest["metrics"], manifest["timings"]
                # the manifest is written at publish: its stages' seconds over their share is the job's
                # own time up to publishing (start-up and the MLflow record after it are not in it)
                job_s = t["stage_score_s"] / t["stage_score_share"] if t.get("stage_score_share") else float("nan")
                run = {"mode": mode, "repeat": i, "wall_s": round(seconds, 1), "job_total_s": round(job_s, 1),
                       "score_stage_s": round(t["stage_score_s"], 1), "users": manifest["counts"]["rows"],
                       "users_per_s": round(m["users_per_s"]), "workers": m["workers"],
                       "model_loads_per_worker_max": m["model_loads_per_worker_max"]}
                runs.append(run)
                print(json.dumps(run), flush=True)
    print("\nmedians over repeats (2 cores each way):")
    print(f"{'mode':8} {'wall s':>8} {'job s':>8} {'score s':>8} {'users/s':>8}")
    summary = {}
    for mode in ("local", "cluster"):
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {k: statistics.median(r[k] for r in mine) for k in ("wall_s", "job_total_s", "score_stage_s",
                                                                             "users_per_s")}
        s = summary[mode]
        print(f"{mode:8} {s['wall_s']:8.1f} {s['job_total_s']:8.1f} {s['score_stage_s']:8.1f} {s['users_per_s']:8.0f}")
    if opts.json:
        opts.json.write_text(json.dumps({"runs": runs, "medians": summary, "users": opts.users, "items": opts.items},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
