"""The CLI's logging (``recsys.logs.configure_logging``): the job's lines at INFO, libraries' chatter left out;
and what the JVMs the CLI starts print of their own."""
import subprocess
import sys
from ctypes.util import find_library

import pytest

_CHILD = """
import logging
from recsys.logs import configure_logging
configure_logging()
logging.getLogger("recsys").info("the job's line")
for name in ("httpx", "urllib3", "py4j"):
    logging.getLogger(name).info("HTTP Request: GET %s", name)
    logging.getLogger(name).warning("a warning from %s", name)
"""


def test_the_job_s_lines_stay_and_http_clients_say_only_what_goes_wrong():
    """``recsys demo`` asks ``recsys serve`` over httpx, which logs every request at INFO: not in the user's output."""
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "INFO recsys: the job's line" in run.stderr
    assert "HTTP Request" not in run.stderr
    assert all(f"WARNING {name}: a warning from {name}" in run.stderr for name in ("httpx", "urllib3", "py4j"))


_ALS_CHILD = """
import os
from recsys.config import load_config, load_launch_settings
from recsys.spark.session import build_session
cfg = load_config(overrides=["spark.master=local[1]", "spark.conf.spark.ui.enabled=false"])
spark = build_session(cfg.spark, launch=load_launch_settings(os.environ))
from pyspark.ml.recommendation import ALS
ratings = spark.createDataFrame([(0, 1, 1.0), (1, 2, 1.0), (0, 2, 1.0)], ["user", "item", "rating"])
model = ALS(rank=2, maxIter=2, implicitPrefs=True, numUserBlocks=1, numItemBlocks=1).fit(ratings)
print("lists", model.recommendForAllUsers(2).count())
spark.stop()
"""


def test_the_blas_loader_is_told_not_to_look_for_libraries_the_machine_lacks():
    """Without a system BLAS, Spark ML's loader prints a dlopen failure for BLAS and one for LAPACK, then uses its
    Java implementation; the sessions the CLI starts tell it not to try for what is missing, and only that."""
    from recsys.spark.session import native_library_settings

    assert native_library_settings(lambda name: None) == {"spark.driver.extraJavaOptions": (
        "-Ddev.ludovic.netlib.blas.allowNative=false -Ddev.ludovic.netlib.lapack.allowNative=false")}
    only_blas = native_library_settings(lambda name: "libblas.so.3" if name == "blas" else None)
    assert only_blas == {"spark.driver.extraJavaOptions": "-Ddev.ludovic.netlib.lapack.allowNative=false"}
    assert native_library_settings(lambda name: f"lib{name}.so.3") == {}


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.skipif(find_library("blas") is not None and find_library("lapack") is not None,
                    reason="this machine has a system BLAS and LAPACK: the loader finds them and prints nothing")
def test_an_als_fit_in_a_session_the_cli_starts_prints_no_native_library_failure(tmp_path):
    """``recsys backtest`` and ``recsys evaluate`` fit Spark ALS in the session they start: its output holds the
    lists, not ``netlib-blas: JNI_OnLoad: dlopen(libblas.so.3) failed``."""
    import jobkit

    env = jobkit.own_session_env("RECSYS_LOG4J_CONF")    # the checkout's log4j2 file, as a user's shell gets it
    run = subprocess.run([sys.executable, "-c", _ALS_CHILD], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lists 2" in run.stdout
    output = run.stdout + run.stderr
    assert "netlib" not in output and "dlopen" not in output, output[-3000:]
