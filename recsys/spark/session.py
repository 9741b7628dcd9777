"""Building (or joining) the Spark session, the one place that knows how a job was launched.

- under ``spark-submit`` (``spark-submit.sh``): the session spark-submit configured, untouched
  apart from the job's runtime SQL settings;
- with ``spark.remote`` set (or ``SPARK_REMOTE``, passed in as ``LaunchSettings``): a Spark Connect
  client session;
- otherwise (``recsys ...`` on a laptop or in CI): a local session on ``spark.master``.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator
from urllib.parse import urlsplit

from recsys.config import LaunchSettings, OutputConfig, SparkConfig, StorageConfig
from recsys.errors import SparkUnavailable
from recsys.redaction import redact_uri

log = logging.getLogger(__name__)


# Defaults for reading many small partitions, applied unless the user's ``spark.conf`` (or ``--conf``) sets
# them. A read of more than 32 paths is listed by a Spark job with one task per path (up to 10,000): a
# window of a thousand daily partitions costs a thousand tiny tasks before a byte is read. Capped, each
# listing task takes a slice of the paths, still spread over the executors on a cluster; the reader then
# coalesces the small files' read tasks to what their bytes need (``recsys.data.readers.read_tasks``).
# Figures: docs/performance.md, "Reading many small partitions".
LISTING_SETTINGS: dict[str, str] = {"spark.sql.sources.parallelPartitionDiscovery.parallelism": "64"}


def runtime_settings(arrow_batch_size: int | None = None) -> dict[str, str]:
    """SQL settings the job's semantics depend on; runtime-settable, so they hold under spark-submit
    and over Spark Connect too. ``arrow_batch_size``: ``scoring.arrow_batch_size``, for sessions that score."""
    settings = {"spark.sql.session.timeZone": "UTC"}   # dt partitions and ts filters are UTC days
    if arrow_batch_size is not None:
        settings["spark.sql.execution.arrow.maxRecordsPerBatch"] = str(arrow_batch_size)
    return settings


# no progress bars: a job's log is read by schedulers and people, not watched on a terminal
QUIET_CONSOLE = {"spark.ui.showConsoleProgress": "false"}


def session_settings(spark_cfg: SparkConfig, arrow_batch_size: int | None = None,
                     launch: LaunchSettings | None = None) -> dict[str, str]:
    """Every setting of a Spark application recsys starts itself: a local session (:func:`build_session`),
    the on-demand backend (``recsys backend start``, as ``--conf``) and the benchmark's session. The
    user's ``spark.conf`` comes last and wins; the runtime settings are set again on the session.

    Local workers must run the interpreter that has torch, not whatever python3 is on PATH: pyspark
    takes the workers' interpreter from PYSPARK_PYTHON when the context starts (set by the caller).
    """
    launch = launch or LaunchSettings()
    return {
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"] if "PYSPARK_PYTHON" in os.environ else sys.executable,
        **QUIET_CONSOLE,
        "spark.sql.shuffle.partitions": str(launch.shuffle_partitions),
        **LISTING_SETTINGS,
        **runtime_settings(arrow_batch_size),
        **spark_cfg.conf,
    }


def store_settings(output: OutputConfig | None = None, storage: StorageConfig | None = None, *,
                   launching: bool = True) -> dict[str, str]:
    """The settings that reach the stores: S3A from ``storage.s3`` (:mod:`recsys.storage`) and, when
    ``output.table`` is set, the Hive metastore (:mod:`recsys.spark.metastore`). ``launching``: the driver's
    JVM starts with this session (a local session, the backend), so its class path and java options count."""
    from recsys import storage as object_store
    from recsys.spark import metastore

    settings: dict[str, str] = {}
    if storage is not None:
        settings.update(object_store.spark_settings(object_store.ObjectStore.of(storage.s3)))
    if output is not None and output.table is not None:
        store = metastore.resolve(output.metastore)
        if launching:
            store.dir.mkdir(parents=True, exist_ok=True)   # derby.log and embedded Derby's database go here
        settings.update(metastore.metastore_settings(store))
        if launching:
            settings.update(metastore.launch_settings(store))
    return settings


def log_settings(launch: LaunchSettings) -> dict[str, str]:
    """The log4j2 file of a Spark JVM recsys starts itself (``launch.log4j_conf``: by default the one
    ``spark-submit.sh`` passes), so that ``recsys demo``, ``train``, ``recommend`` and ``sql`` print the job's
    lines and Spark's warnings, not Spark's INFO banner and its local-mode notes."""
    if launch.log4j_conf is None:
        return {}
    return {"spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{launch.log4j_conf}"}


NATIVE_LIBRARIES = ("blas", "lapack")    # what Spark ML's netlib loader looks for, as libblas.so.3, liblapack.so.3


def native_library_settings(find_library: Callable[[str], str | None] | None = None) -> dict[str, str]:
    """Java options that tell Spark ML's BLAS and LAPACK loader not to look for a system library this machine
    does not have.

    ALS (``recsys backtest``, ``recsys evaluate``) first tries netlib's native BLAS; without the system's
    ``libblas.so.3`` it prints ``netlib-blas: JNI_OnLoad: dlopen(libblas.so.3) failed: ... No such file`` (and the
    same for LAPACK) into the command's output, then uses its Java implementation. Told not to try
    (``dev.ludovic.netlib.*.allowNative=false``), it takes the same fallback without the lines. A library that is
    there is left to be used. ``find_library``: :func:`ctypes.util.find_library` unless given."""
    from ctypes.util import find_library as system_library

    find = find_library or system_library
    options = [f"-Ddev.ludovic.netlib.{name}.allowNative=false" for name in NATIVE_LIBRARIES if find(name) is None]
    return {"spark.driver.extraJavaOptions": " ".join(options)} if options else {}


def launching_settings(launch: LaunchSettings, output: OutputConfig | None,
                       storage: StorageConfig | None) -> dict[str, str]:
    """What a JVM this process starts needs from us: its log4j2 file and the native libraries it need not look
    for, then the stores' settings (java options joined in that order)."""
    return merged_settings(merged_settings(log_settings(launch), native_library_settings()),
                           store_settings(output, storage))


def merged_settings(settings: dict[str, str], user: dict[str, str]) -> dict[str, str]:
    """``user`` wins, except java options and class paths, which are joined (ours first, theirs after)."""
    merged = {**settings, **user}
    for key, sep in (("spark.driver.extraJavaOptions", " "), ("spark.driver.extraClassPath", os.pathsep)):
        if key in settings and key in user:
            merged[key] = f"{settings[key]}{sep}{user[key]}"
    return merged


def build_session(spark_cfg: SparkConfig, arrow_batch_size: int | None = None, app_name: str | None = None,
                  launch: LaunchSettings | None = None, output: OutputConfig | None = None,
                  storage: StorageConfig | None = None):
    """Create or join the session and apply the settings every recsys job relies on.

    Under spark-submit or over Spark Connect the session is configured elsewhere: only ``spark.conf``
    and the runtime settings are applied. ``arrow_batch_size``: ``scoring.arrow_batch_size`` for a
    session that scores. ``launch``: the environment's settings (``recsys.config.load_launch_settings``,
    read by the entry point); None: none (no ``SPARK_REMOTE``, 8 shuffle partitions). ``output``,
    ``storage``: the metastore of ``output.table`` and the object-store settings (:func:`store_settings`);
    a Spark Connect session uses its server's.
    """
    from pyspark.sql import SparkSession

    launch = launch or LaunchSettings()
    builder = SparkSession.builder.appName(app_name or spark_cfg.app_name)
    remote = spark_cfg.remote or launch.spark_remote
    launched_by_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    settings = dict(spark_cfg.conf)
    if remote:
        if not remote.startswith("local"):
            wait_for_connect_server(remote, launch.connect_wait_s)
        builder = builder.remote(remote)
        if remote.startswith("local"):   # pyspark starts this Connect server itself, with the builder's settings
            # (and its JVM writes to this process's stderr: no progress bars in the job's log)
            settings = merged_settings(launching_settings(launch, output, storage), {**QUIET_CONSOLE, **settings})
    elif launched_by_submit:
        settings = merged_settings(store_settings(output, storage, launching=False), settings)
    else:
        builder = builder.master(spark_cfg.master)
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        settings = merged_settings(launching_settings(launch, output, storage),
                                   session_settings(spark_cfg, arrow_batch_size, launch))
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    apply_runtime_settings(spark, arrow_batch_size)
    return spark


CONNECT_DEFAULT_PORT = 15002


def wait_for_connect_server(remote: str, wait_s: float, *,
                            clock: Callable[[], float] = time.monotonic) -> None:
    """Fail within ``wait_s`` when nothing listens at the Connect URL's host and port.

    pyspark's Connect client retries an unreachable server for ten minutes or more without a word, which
    a scheduler sees as a hung task. A server that is restarting gets ``wait_s`` (with a line every 10 s);
    one that stays down is :class:`SparkUnavailable` (exit 1, a retry may help), in one line. ``wait_s``:
    ``RECSYS_CONNECT_WAIT_S`` (:class:`recsys.config.LaunchSettings`).
    """
    parts = urlsplit(remote)
    host, port = parts.hostname, parts.port or CONNECT_DEFAULT_PORT
    if parts.scheme != "sc" or not host:
        return   # not a URL this check understands: the client says what is wrong with it
    deadline, said = clock() + wait_s, clock()
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(10.0, max(1.0, wait_s))):
                return
        except OSError as exc:
            left = deadline - clock()
            if left <= 0:
                waited = f" after {wait_s:.0f} s" if wait_s >= 1 else ""
                raise SparkUnavailable(f"the Spark Connect server {redact_uri(remote)} does not answer at {host}:{port} "
                                       f"({exc.strerror or type(exc).__name__}){waited}: start it, or check its URL "
                                       "(spark.remote, SPARK_REMOTE or --remote)") from None
            if clock() - said >= 10:
                log.warning("the Spark Connect server at %s:%d does not answer (%s); waiting up to %.0f s more",
                            host, port, exc.strerror or type(exc).__name__, left)
                said = clock()
            time.sleep(min(1.0, left))   # the server's own schedule, not a test's synchronisation


def apply_runtime_settings(spark, arrow_batch_size: int | None = None) -> None:
    """Set :func:`runtime_settings` on a session that exists (one a test or the demo hands in), and
    :data:`LISTING_SETTINGS` where nobody set them (a session spark-submit or a Connect server configured)."""
    for key, value in runtime_settings(arrow_batch_size).items():
        spark.conf.set(key, value)
    for key, value in LISTING_SETTINGS.items():
        if spark.conf.get(key, None) is None:
            spark.conf.set(key, value)


def default_parallelism(spark) -> int | None:
    """The cores Spark schedules tasks on (``defaultParallelism``); None over Spark Connect, whose
    client has no SparkContext to ask."""
    if is_connect(spark):
        return None
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:   # a stopped context: size tasks without it
        return None


def is_connect(spark) -> bool:
    try:
        from pyspark.sql.utils import is_remote

        return bool(is_remote()) or type(spark).__module__.startswith("pyspark.sql.connect")
    except ImportError:  # pragma: no cover
        return False


@contextmanager
def job_description(spark, text: str) -> Iterator[None]:
    """Label the Spark jobs a stage runs, so the Spark UI reads like the job's log.

    Classic sessions use the job description; Spark Connect has no SparkContext, so it gets a tag.
    """
    if is_connect(spark):
        tag = "recsys-" + "".join(c if c.isalnum() else "-" for c in text.lower())[:60]
        spark.addTag(tag)
        try:
            yield
        finally:
            spark.removeTag(tag)
        return
    sc = spark.sparkContext
    sc.setJobDescription(text)
    try:
        yield
    finally:
        sc.setJobDescription(None)
