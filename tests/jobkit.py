"""Building blocks for end-to-end job tests: tiny inputs, a registered model without training, the CLI in-process.

A test module builds one model store (``make_store``) and one dataset (``write_dataset``), copies
the dataset per test when it needs to spoil it, and runs the job through ``run_nightly`` or the
real CLI (``cli``), always on the one shared Spark session.
"""
from __future__ import annotations

import datetime as dt
import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from recsys.config import Config, load_config
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition
from recsys.publish.manifest import Manifest, ModelRef

RUN_DATE = dt.date(2024, 5, 8)
METASTORE_URL: str | None = None   # the session's metastore service (conftest.metastore_service sets it)
CATALOG_DATE = dt.date(2024, 5, 1)
UTC = dt.timezone.utc
N_USERS, N_ITEMS, TOP_N = 24, 30, 5


@dataclass(frozen=True)
class Store:
    root: Path
    tracking_uri: str
    model_name: str
    version: str
    model_dir: Path


def make_store(root: Path, model_name: str = "recsys-test", blend=None) -> Store:
    """A sqlite MLflow store with one registered version of a small random SASRec under ``@champion``, saved with
    ``blend`` (a :class:`recsys.model.repeats.RepeatBlend`; None: known items masked, no popularity prior).

    Scoring needs a model, not a good one: no training, so a store costs about a second.
    """
    import torch
    from mlflow import MlflowClient

    from recsys.tracking import store as tracking
    from recsys.model.io import save_model
    from recsys.model.sasrec import SASRec, SASRecConfig

    torch.manual_seed(0)
    model_dir = save_model(SASRec(SASRecConfig(num_items=N_ITEMS, dim=8, layers=1, heads=1, max_len=8, dropout=0.0)),
                           np.arange(1, N_ITEMS + 1), root / "model", blend=blend)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cfg = load_config(overrides=[f"mlflow.tracking_uri={uri}", f"mlflow.model_name={model_name}"])
    tracking.point_at(cfg.mlflow)
    MlflowClient().create_registered_model(model_name)
    return Store(root, uri, model_name, register_version(uri, model_name, model_dir), model_dir)


def register_version(tracking_uri: str, model_name: str, model_dir: Path) -> str:
    """Register ``model_dir`` as the next version of ``model_name`` and point ``@champion`` at it; its version."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    version = str(client.create_model_version(model_name, source=str(model_dir)).version)
    client.set_registered_model_alias(model_name, "champion", version)
    return version


def events_table(day: int, users: range = range(1, N_USERS + 1), seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed + day)
    rows = [dict(user_id=u, item_id=int(i), event_type="view", ts=dt.datetime(2024, 5, day, int(rng.integers(0, 24)), tzinfo=UTC))
            for u in users for i in rng.choice(np.arange(1, N_ITEMS + 1), size=2, replace=False)]
    return pa.Table.from_pylist(rows, schema=EVENTS_SCHEMA)


def catalog_table(items=range(1, N_ITEMS + 1), unavailable=()) -> pa.Table:
    rows = [dict(item_id=i, available=i not in unavailable, title=f"Item {i}", category="c") for i in items]
    return pa.Table.from_pylist(rows, schema=CATALOG_SCHEMA)


def write_dataset(root: Path) -> Path:
    """Events on 2024-05-01..07 (every user, two items a day), one catalog snapshot on 2024-05-01."""
    for day in range(1, 8):
        write_partition(events_table(day), root / "events", dt.date(2024, 5, day))
    write_partition(catalog_table(), root / "catalog", CATALOG_DATE)
    return root


def copy_dataset(source: Path, target: Path) -> Path:
    for name in ("events", "catalog"):
        shutil.copytree(source / name, target / name)
    return target


def write_night(run_dir: str | Path, version: str, users: int) -> None:
    """A run directory as Spark leaves it, without running the job: three Parquet files of the output schema
    (users 0..users-1, one list each, model version ``version``) and ``_SUCCESS``. Publish it with
    ``recsys.publish.publisher.publish(layout, night_manifest(...), ...)``."""
    import pyarrow.parquet as pq

    from recsys.data.contracts import OUTPUT_SCHEMA

    out = Path(run_dir)
    out.mkdir(parents=True)
    for part in range(3):
        rows = [{"user_id": u, "recommendations": [{"item_id": 1, "score": 1.0}], "source": "model",
                 "model_version": version} for u in range(part, users, 3)]
        pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA), out / f"part-{part:05d}.parquet")
    (out / "_SUCCESS").write_bytes(b"")


def night_manifest(run: str, version: str) -> Manifest:
    """The least manifest publishing needs for a :func:`write_night` run."""
    return Manifest(run_id=f"mlflow-{run}", job_run=run, model=ModelRef(version=version), config_digest="d")


def table_name(root: Path) -> str:
    """The output table of a test's output root: one per root, all in the session's one metastore."""
    import hashlib

    return f"recsys_test.r_{hashlib.sha1(str(root).encode()).hexdigest()[:12]}"


def metastore_overrides(root: Path) -> list[str]:
    """The default output.table, unique to ``root``, in the session's metastore service (when one runs)."""
    from recsys.spark.metastore import DERBY_CLIENT_JAR

    found = [f"output.table={table_name(root)}", f"output.metastore.dir={root / 'metastore'}"]
    if METASTORE_URL:
        found += [f"output.metastore.url={METASTORE_URL}", f"output.metastore.jars=[{DERBY_CLIENT_JAR}]"]
    return found


def overrides(root: Path, store: Store, *extra: str, inputs: Path | None = None) -> list[str]:
    """Config overrides putting output and work under ``root``, inputs under ``inputs`` (default: ``root``),
    and the output table in the test session's metastore."""
    inputs = inputs or root
    return [*metastore_overrides(root),
        f"paths.events={inputs / 'events'}", f"paths.catalog={inputs / 'catalog'}",
        f"paths.output={root / 'recommendations'}", f"paths.work={root / 'work'}",
        f"paths.driver_scratch={root / 'driver'}",
        f"mlflow.tracking_uri={store.tracking_uri}", f"mlflow.artifact_location={store.root / 'artifacts'}",
        f"mlflow.model_name={store.model_name}",
        "history.window_days=30", f"scoring.top_n={TOP_N}", "scoring.chunk_size=4", "scoring.partitions=4",
        *extra,
    ]


def config(root: Path, store: Store, *extra: str, inputs: Path | None = None) -> Config:
    return load_config(overrides=overrides(root, store, *extra, inputs=inputs))


def cli(monkeypatch, spark, argv: list[str]) -> int:
    """``recsys <argv>`` in this process, on the shared session (which it must not stop)."""
    import recsys.spark.session
    from recsys.cli import main as recsys_cli

    monkeypatch.setattr(recsys.spark.session, "build_session", lambda *a, **k: spark)
    monkeypatch.setattr(spark, "stop", lambda: None)
    return recsys_cli.main(argv)


def record_calls(monkeypatch, owner, name: str) -> list[tuple[tuple, dict]]:
    """Wrap ``owner.name`` (a module's function) so that every call is recorded, arguments and all, in the list
    returned, and still made: how a test counts the reads a run makes without changing what it reads."""
    calls, original = [], getattr(owner, name)

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls


SESSION_ENV = ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "SPARK_REMOTE")


def own_session_env(*dropped: str, **added: str) -> dict[str, str]:
    """This process's environment for a child that starts its own Spark session, as a user's shell would: without
    what would point it at this test process's JVM gateway or a Connect server (:data:`SESSION_ENV`), nor the
    names in ``dropped``; with ``added``."""
    import os

    env = {**os.environ, **added}
    for key in (*SESSION_ENV, *dropped):
        env.pop(key, None)
    return env


def recommend_args(root: Path, store: Store, *extra: str, inputs: Path | None = None) -> list[str]:
    args = []
    for item in overrides(root, store, *extra, inputs=inputs):
        args += ["--set", item]
    return args


def descendants(pid: int) -> list["psutil.Process"]:
    """The processes under ``pid`` now (a job's JVM, its Python daemon and workers); none once it is gone."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(proc: subprocess.Popen, tree: list["psutil.Process"] | None = None) -> None:
    """SIGKILL ``proc`` (while it runs) and the processes under it, and wait for them all. ``tree``: those taken
    earlier, for processes that may since have lost their parent (a killed JVM's workers); default, or when empty,
    those under ``proc`` now."""
    import psutil

    tree = tree or descendants(proc.pid)
    for p in [*tree, psutil.Process(proc.pid)] if proc.poll() is None else tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
    proc.wait(timeout=30)


def errors_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("recsys")]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes: two snapshots are equal only if nothing changed."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def partitions(output: Path) -> list[str]:
    return sorted(p.name for p in output.glob("dt=*")) if output.exists() else []


def runs(output: Path) -> list[str]:
    """The run directories kept under ``output`` (``dt=D/run=KEY``), sorted."""
    return sorted(f"{p.parent.name}/{p.name}" for p in output.glob("_runs/dt=*/run=*")) if output.exists() else []
