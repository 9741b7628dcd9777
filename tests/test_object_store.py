"""The driver's operations on object-store paths, against a real S3-compatible HTTP server (moto's, on loopback).

Publishing, recovery, staging discard, rollback and retention on S3 are in tests/test_publish_swap.py (every
test there that takes the ``store`` fixture runs on the local file system and on this endpoint, kills
included). Here: the date's lock, the manifest, the work directories and the model download. Spark's own
S3A cannot run here (no hadoop-aws jar): docs/cluster.md says what a cluster needs.
"""
from __future__ import annotations

import datetime as dt
import json

import pytest

import storekit
from recsys import fs as rfs
from recsys import storage
from recsys.config import load_config
from recsys.errors import LockHeld
from recsys.publish import manifest as manifest_file
from recsys.publish.lock import DateLock, lock_path
from recsys.publish.publisher import PartitionLayout, publish

DATE = dt.date(2024, 5, 8)


@pytest.fixture()
def s3(s3_installed) -> storekit.Store:
    return storekit.Store("s3", f"s3://{s3_installed.bucket()}/t", s3_installed.object_store)


def test_the_date_lock_on_s3_is_taken_held_annotated_and_released(s3):
    out = s3.root()
    with DateLock(out, DATE, "run-a") as lock:
        assert s3.exists(lock_path(out, DATE))
        with pytest.raises(LockHeld, match="is locked by run run-a"):
            DateLock(out, DATE, "run-b").acquire()
        assert lock.annotate(mlflow_run_id="m1", tracking_store="sqlite:///x") is True
        fs, path = rfs.resolve(lock_path(out, DATE))
        assert json.loads(rfs.read_text(fs, path))["mlflow_run_id"] == "m1"
        assert lock.beat() is True
        lock.verify()
    assert not s3.exists(lock_path(out, DATE))
    with DateLock(out, DATE, "run-b"):
        pass


def test_a_stale_lock_on_s3_from_another_host_is_taken_over(s3):
    out = s3.root()
    s3.write(lock_path(out, DATE), json.dumps({"run": "dead", "token": "t0", "host": "elsewhere", "pid": 1,
                                                "started_at": "2024-05-08T00:00:00+00:00", "ttl_s": 0.001}).encode())
    # a TTL shorter than the time to take the lock: the heartbeat (the object's modification time) is stale
    with DateLock(out, DATE, "run-b") as lock:
        assert lock.took_over is not None and lock.took_over.run == "dead"


def test_the_manifest_on_s3_is_read_back_and_rewritten_when_the_run_was_not_recorded(s3):
    out = s3.root()
    layout = PartitionLayout(out, DATE, "r1")
    s3.write(f"{layout.run_dir}/part-00000.parquet", b"x")
    s3.write(f"{layout.run_dir}/_SUCCESS", b"")
    night = publish(layout, manifest_file.Manifest(run_id="m1", job_run="r1"), "copy")
    assert manifest_file.read(out, DATE).run_id == "m1"
    marked = manifest_file.mark_unrecorded([night.location, layout.final_dir], night.manifest, "MLflow unreachable")
    assert marked.tracking.error == "MLflow unreachable" and night.manifest.tracking.error is None
    for directory in (night.location, layout.final_dir):
        fs, path = rfs.resolve(manifest_file.path_in(directory))
        assert json.loads(rfs.read_text(fs, path))["tracking"]["error"] == "MLflow unreachable"


def test_the_work_directories_of_dead_runs_on_s3_are_removed(s3):
    from recsys.pipelines import nightly, nightly_stages

    cfg = load_config(overrides=[f"paths.work={s3.root('work')}", f"paths.output={s3.root()}"])
    base = nightly_stages.date_work_root(cfg.paths.work, DATE)
    for run in ("dead-1", "dead-2", "mine"):
        s3.write(f"{base}/{run}/histories/part-0.parquet", b"x")
    nightly._remove_stale_work_dirs(cfg, DATE, "mine")
    assert sorted(s3.snapshot(base)) == ["mine/histories/part-0.parquet"]


def test_the_model_is_downloaded_from_an_s3_artifact_store(s3, s3_server, tmp_path, monkeypatch):
    """MLflow's boto3 client reaches the same endpoint through the environment recsys.storage sets."""
    import torch
    from mlflow import MlflowClient

    from recsys.fs import files_digest
    from recsys.model.io import save_model
    from recsys.model.sasrec import SASRec, SASRecConfig
    from recsys.tracking import store as tracking
    from recsys.tracking.last_model import resolve_or_remembered

    for key, value in {**storekit.S3_CREDENTIALS, **storage.client_environment(s3_server.object_store)}.items():
        monkeypatch.setenv(key, value)
    torch.manual_seed(0)
    import numpy as np

    local = save_model(SASRec(SASRecConfig(num_items=5, dim=8, layers=1, heads=1, max_len=4, dropout=0.0)),
                       np.arange(1, 6), tmp_path / "model")
    source = s3.root("models/v1")
    for path in sorted(local.iterdir()):
        s3.write(f"{source}/{path.name}", path.read_bytes())
    cfg = load_config(overrides=[f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "mlflow.model_name=m"])
    tracking.point_at(cfg.mlflow)
    client = MlflowClient()
    client.create_registered_model("m")
    version = client.create_model_version("m", source=source).version
    client.set_registered_model_alias("m", "champion", version)
    model, error = resolve_or_remembered(cfg.mlflow, tmp_path / "driver")
    assert error is None and model.version == str(version)
    assert model.local_dir.is_relative_to(tmp_path / "driver")            # downloaded, not read in place
    assert files_digest(model.local_dir) == files_digest(local)
