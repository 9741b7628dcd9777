"""The log a scheduler keeps: a demo-sized run under spark-submit.sh, counted line by line.

Before conf/log4j2.properties, the same run printed about 34,000 lines, nearly all Spark INFO. Now
Spark logs at WARN, the job's own lines at INFO, and the last line says what happened. The data is
the bundled MovieLens sample (the demo's: 611 users, 100k ratings, 9.7k items) scored by an
untrained model (what is measured is the log, not the recommendations).
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jobkit

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
DATE = "2018-09-25"
MAX_LINES = 60


@pytest.fixture(scope="module")
def demo_sized(tmp_path_factory):
    """MovieLens in the input layout and a registered random model over its items."""
    import pyarrow.parquet as pq
    import torch
    from mlflow import MlflowClient

    from recsys.tracking import store as tracking
    from recsys.config import load_config
    from recsys.data.movielens import import_movielens
    from recsys.model.io import save_model
    from recsys.model.sasrec import SASRec, SASRecConfig

    root = tmp_path_factory.mktemp("demo-sized")
    ml = REPO / "data" / "ml-latest-small"
    import_movielens(ml / "ratings.csv", root / "data", movies=ml / "movies.csv")
    items = np.unique(pq.read_table(root / "data" / "catalog", columns=["item_id"]).column("item_id").to_numpy())
    torch.manual_seed(0)
    model_dir = save_model(SASRec(SASRecConfig(num_items=len(items), dim=16, layers=1, heads=1, max_len=50,
                                               dropout=0.0)), items, root / "model")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    tracking.point_at(load_config(overrides=[f"mlflow.tracking_uri={uri}"]).mlflow)
    MlflowClient().create_registered_model("recsys-default")
    jobkit.register_version(uri, "recsys-default", model_dir)
    return root, uri


def _submit(root: Path, uri: str, *submit_options: str) -> tuple[int, list[str]]:
    env = jobkit.own_session_env("RECSYS_LOG4J_CONF", PYSPARK_PYTHON=sys.executable, SPARK_MASTER="local[2]")
    # every path the job writes, in this test's directory: with the default paths.driver_scratch this run
    # once remembered its own registry's "version 1" in the checkout's .recsys/, where a later
    # unreachable-MLflow night of the demo took it for the demo's model (tests/checkout_guard.py)
    sets = [f"paths.events={root / 'data' / 'events'}", f"paths.catalog={root / 'data' / 'catalog'}",
            f"paths.output={root / 'recommendations'}", f"paths.work={root / 'work'}",
            f"paths.driver_scratch={root / 'driver'}", f"mlflow.tracking_uri={uri}",
            f"mlflow.artifact_location={root / 'artifacts'}", "history.max_items=50",
            # the default metastore (embedded Derby in a directory that does not exist yet), as a first night meets it
            f"output.table={jobkit.table_name(root)}", f"output.metastore.dir={root / 'metastore'}"]
    argv = [str(REPO / "spark-submit.sh"), *submit_options, str(REPO / "jobs" / "nightly_recommendations.py"),
            "--date", DATE]
    for item in sets:
        argv += ["--set", item]
    # one stream, as a scheduler's log keeps it: lines in the order they were written; run from the test's
    # directory, so that whatever still defaults to the working directory lands there too
    run = subprocess.run(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", timeout=600)
    return run.returncode, run.stdout.splitlines()


def test_a_demo_sized_run_under_spark_submit_logs_a_few_dozen_lines_ending_with_the_outcome(demo_sized, tmp_path):
    root, uri = demo_sized
    code, lines = _submit(root, uri)
    text = "\n".join(lines)
    assert code == 0, text[-5000:]
    assert json.loads((root / "recommendations" / f"dt={DATE}" / "_manifest.json").read_text())["counts"]["rows"] == 611
    print(f"{len(lines)} lines:\n{text}")
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{text}"
    assert not [line for line in lines if " INFO " in line and "INFO recsys" not in line], "Spark INFO lines leaked"
    assert not [line for line in lines if "Derby" in line or "Exception" in line], "Derby's boot banner leaked"
    stage_lines = [line for line in lines if "INFO recsys: [recommend" in line]
    assert len(stage_lines) >= 12                       # every stage's start and end
    assert lines[-1].split(" ", 1)[1].startswith(
        f"INFO recsys: recsys recommend finished with exit code 0 (success): published {DATE} (611 users) to ")

    # the user's own log4j configuration wins over the shipped one (here: Spark at INFO, their layout);
    # the date is already published, so this run is skipped, and says so
    mine = tmp_path / "log4j2.properties"
    mine.write_text("rootLogger.level = info\nrootLogger.appenderRef.stderr.ref = console\n"
                    "appender.console.type = Console\nappender.console.name = console\n"
                    "appender.console.target = SYSTEM_ERR\nappender.console.layout.type = PatternLayout\n"
                    "appender.console.layout.pattern = MINE %p %c{1}: %m%n\n")
    code, lines = _submit(root, uri, "--driver-java-options", f"-Dlog4j2.configurationFile=file:{mine}")
    assert code == 0
    assert sum(1 for line in lines if line.startswith("MINE INFO")) > 20
    assert any(f"finished with exit code 0 (success): skipped {DATE}, already published at" in line for line in lines)
