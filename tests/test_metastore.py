"""The metastore of output.table: the Derby network server `recsys metastore` runs, and a metastore that
cannot be opened failing the job in one line (exit 1) before any work."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recsys.config import load_config
from recsys.spark import metastore

REPO = Path(__file__).resolve().parent.parent


def test_recsys_metastore_start_runs_a_server_that_every_process_on_the_directory_then_uses(tmp_path, monkeypatch,
                                                                                            capsys):
    from recsys.cli.main import main

    cfg = load_config(overrides=[f"output.metastore.dir={tmp_path}"]).output.metastore
    assert metastore.resolve(cfg).embedded
    args = ["metastore", "{}", "--set", f"output.metastore.dir={tmp_path}"]
    assert main([a if a != "{}" else "start" for a in args]) == 0
    try:
        running = metastore.running_server(tmp_path)
        assert running and running["url"].startswith("jdbc:derby://127.0.0.1:")
        found = metastore.resolve(cfg)
        assert (found.url, found.jars, found.embedded) == (running["url"], (metastore.DERBY_CLIENT_JAR,), False)
        assert "jdbc:derby://127.0.0.1:" in capsys.readouterr().out
        assert main([a if a != "{}" else "status" for a in args]) == 0
    finally:
        assert main([a if a != "{}" else "stop" for a in args]) == 0
    assert metastore.running_server(tmp_path) is None and metastore.resolve(cfg).embedded
    assert main([a if a != "{}" else "status" for a in args]) == 1


_HOLDER = """
import sys
from pyspark.sql import SparkSession
from recsys.spark import metastore
store = metastore.Metastore(__import__("pathlib").Path(sys.argv[1]), None, (), None)
builder = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
for k, v in {**metastore.metastore_settings(store), **metastore.launch_settings(store)}.items():
    builder = builder.config(k, v)
spark = builder.getOrCreate()
spark.sql("show databases").collect()          # embedded Derby is open in this JVM from here on
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
@pytest.mark.spark
def test_embedded_derby_held_by_another_process_fails_the_job_in_one_line_before_any_work(tmp_path):
    import jobkit

    directory = tmp_path / "metastore"
    directory.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], cwd=tmp_path, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        store = jobkit.make_store(tmp_path / "store")
        jobkit.write_dataset(tmp_path)
        sets = [a for item in jobkit.overrides(tmp_path, store, "spark.master=local[1]",
                                               "spark.conf.spark.ui.enabled=false")
                if not item.startswith("output.metastore.")
                for a in ("--set", item)] + ["--set", f"output.metastore.dir={directory}"]
        job = subprocess.run([sys.executable, "-m", "recsys.cli", "recommend", "--date", str(jobkit.RUN_DATE), *sets],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # Spark's own log (DataNucleus, Derby) says it at length; the job's log says it once, in one line
    errors = [line for line in job.stderr.splitlines() if " ERROR recsys" in line]
    assert job.returncode == 1, job.stderr[-3000:]
    assert len(errors) == 1, [line for line in job.stderr.splitlines() if "recsys" in line][-10:]
    assert "cannot be reached or opened" in errors[0] and "recsys metastore start" in errors[0]
    assert "this is a bug or an infrastructure failure" not in job.stderr     # handled: no traceback of ours
    assert not (tmp_path / "recommendations" / f"dt={jobkit.RUN_DATE}").exists()     # nothing published
    # and at once: Hive's retries of its database (10, 2 s apart, by default: 11 tries here) are not spent on a
    # Derby file another process holds
    assert job.stderr.count("Retrying creating default database") <= 2, job.stderr.count("Retrying creating")
