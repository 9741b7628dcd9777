"""Screenshots of a nightly run and a training run in the MLflow UI, in headless Chromium (not run in CI).

    .venv/bin/python benchmarks/mlflow_ui_screenshots.py --out /tmp/recsys-ui [--workdir DIR] [--epochs 2] [--nights 7]

Runs ``recsys demo`` (MovieLens sample: import, train, recommend) in ``--workdir`` unless it already
holds a demo's store, then the ``--nights`` nights up to the demo's date again in order (so the last
one has earlier nights to be compared with and a trend to plot), starts ``mlflow ui`` on 127.0.0.1 on a
free port over the demo's sqlite store, and saves what a user opening the UI would look at: the nightly
run (note, parameters, metrics, tags, datasets), its plots (the guard's trend of the last nights among
them), the guard's report, the training run and its learning curve, the experiment's run list and the
registered model version (with the links back to the runs that used it).

Needs Debian's Chromium (``apt-get install -y chromium``); the flags below are the ones a headless
Chromium needs on a machine without network access (no background connections, no sandbox as root).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from recsys.processes import free_port

REPO = Path(__file__).resolve().parent.parent
ML_VIEW = "workflowType=machine_learning"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--force-device-scale-factor=1"]


DEMO_DATE = dt.date(2018, 9, 25)   # the demo's night: the day after ml-latest-small's last rating


def _demo(workdir: Path, epochs: int, nights: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if not (workdir / ".recsys" / "mlflow.db").is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "recsys.cli", "demo", "--set", f"train.epochs={epochs}"], cwd=workdir,
                       check=True, env=env)
    if nights > 1:
        start = DEMO_DATE - dt.timedelta(days=nights - 1)
        subprocess.run([sys.executable, "-m", "recsys.cli", "recommend", "--start-date", str(start), "--end-date",
                        str(DEMO_DATE), "--force"], cwd=workdir, check=True, env=env)


def _runs(uri: str) -> dict[str, str]:
    from mlflow import MlflowClient

    client = MlflowClient(uri, uri)
    out = {}
    for experiment, key in (("recsys", "nightly"), ("recsys-training", "training")):
        exp = client.get_experiment_by_name(experiment)
        run = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
        out[key] = f"{exp.experiment_id}/runs/{run.info.run_id}"
        out[f"{key}_experiment"] = exp.experiment_id
    mv = client.get_model_version_by_alias("recsys-default", "champion")
    out["model"] = f"recsys-default/versions/{mv.version}"
    return out


def _screenshot(chromium: str, url: str, path: Path, profile: Path, height: int = 1600) -> None:
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size=1600,{height}",
                    "--virtual-time-budget=15000", f"--screenshot={path}", url],
                   check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"{path}  <- {url}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the PNGs go")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/recsys-ui-demo"),
                        help="the demo's working directory (reused if it holds a store)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--nights", type=int, default=7, help="nights up to the demo's date, run again in order")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium on PATH: apt-get install -y chromium", file=sys.stderr)
        return 2
    _demo(args.workdir, args.epochs, args.nights)
    store = args.workdir / ".recsys" / "mlflow.db"
    uri = f"sqlite:///{store}"
    runs = _runs(uri)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1"], cwd=args.workdir,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("mlflow ui did not start")
                time.sleep(0.3)
        args.out.mkdir(parents=True, exist_ok=True)
        profile = args.out / ".chromium-profile"
        pages = {
            "nightly_run_overview": f"#/experiments/{runs['nightly']}",
            "nightly_run_plots": f"#/experiments/{runs['nightly']}/artifacts/plots/score_distribution.png",
            "nightly_run_guard_trend": f"#/experiments/{runs['nightly']}/artifacts/plots/guard_trend.png",
            "nightly_run_guard_report": f"#/experiments/{runs['nightly']}/artifacts/guard_report.json",
            "nightly_run_metrics": f"#/experiments/{runs['nightly']}/model-metrics",
            "nightly_run_sample": f"#/experiments/{runs['nightly']}/artifacts/recommendations_sample.csv",
            "nightly_runs_list": f"#/experiments/{runs['nightly_experiment']}/runs",
            "training_run_overview": f"#/experiments/{runs['training']}",
            "training_run_metrics": f"#/experiments/{runs['training']}/model-metrics",
            "model_version": f"#/models/{runs['model']}",
        }
        for name, page in pages.items():   # MLflow 3's UI opens in its GenAI view unless asked for the ML one
            _screenshot(chromium, f"{base}/{page}?{ML_VIEW}", args.out / f"{name}.png", profile)
        shutil.rmtree(profile, ignore_errors=True)
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
