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


def test_s3_race_for_the_pointer_of_runs_that_read_the_same_pointer_exactly_one_switches_it(s3):
    """Two runs read the date's pointer, pass their lock check, then switch it together (the check is the
    barrier both wait at): one write succeeds, the other names a pointer that changed and raises LockHeld."""
    import threading

    from recsys.publish.published import read_pointer

    from recsys import conditional

    out = s3.root()
    conditional.support(lock_path(out, DATE))                 # as setting up the date's lock does in every writer
    history: list[str] = []
    for round_ in range(2):                                   # a first pointer (If-None-Match: *), then If-Match
        layouts = [PartitionLayout(out, DATE, f"r{round_}-{c}") for c in "ab"]
        for layout in layouts:
            s3.write(f"{layout.run_dir}/part-00000.parquet", layout.run_key.encode())
            s3.write(f"{layout.run_dir}/_SUCCESS", b"")
        both_checked = threading.Barrier(2, timeout=30)
        outcomes: dict[str, object] = {}

        def run(layout: PartitionLayout) -> None:
            try:
                publish(layout, manifest_file.Manifest(job_run=layout.run_key), "copy", still_ours=lambda: both_checked.wait() and None)
                outcomes[layout.run_key] = "published"
            except LockHeld as exc:
                outcomes[layout.run_key] = exc

        threads = [threading.Thread(target=run, args=(layout,)) for layout in layouts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        winners = [k for k, v in outcomes.items() if v == "published"]
        assert len(winners) == 1, outcomes
        [loser] = [v for v in outcomes.values() if v != "published"]
        assert loser.exit_code == 4
        assert (f"the pointer of dt=2024-05-08 changed since this run read it (it now names run {winners[0]})"
                in str(loser))
        history += winners
        pointer = read_pointer(out, DATE)
        assert pointer.run == winners[0] and [e.run for e in pointer.history] == history   # the loser is in none
        assert manifest_file.read(out, DATE).job_run == winners[0]


def test_a_store_that_ignores_conditional_writes_is_named_once_and_its_lock_is_best_effort(s3_server, caplog):
    """``recsys runs`` names such a lock: tests/test_killed_runs.py."""
    with storekit.S3Proxy(s3_server) as proxy:
        previous = storage.install(proxy.object_store, environ={})
        try:
            out = f"s3://{s3_server.bucket()}/t/recommendations"
            with caplog.at_level("INFO"):
                with DateLock(out, DATE, "run-a") as lock:
                    assert lock.kind == "best effort"
                    with pytest.raises(LockHeld, match="is locked by run run-a"):
                        DateLock(out, DATE, "run-b").acquire()
                    lock.verify()
                with DateLock(out, DATE + dt.timedelta(days=1), "run-c") as other:
                    assert other.kind == "best effort"
        finally:
            storage.install(previous, environ={})
    assert proxy.dropped > 0                                   # the probe did send conditional writes
    said = [r.getMessage() for r in caplog.records if "conditional writes" in r.getMessage()]
    assert len(said) == 1 and "If-None-Match ignored" in said[0] and "best effort" in said[0], said
    assert said[0].startswith(out.split("/t/")[0]) and "docs/operations.md" in said[0]


def test_s3_race_for_a_released_lock_on_a_store_without_conditional_deletes_one_run_takes_it(s3_server, caplog):
    """Where deletes are not conditional, a release replaces the lock with a marker (still conditionally):
    the next run takes the marker like an absent lock, and of two racing for it exactly one does."""
    import threading

    with storekit.S3Proxy(s3_server, drop_conditions_on=(b"DELETE",)) as proxy:
        previous = storage.install(proxy.object_store, environ={})
        try:
            out = f"s3://{s3_server.bucket()}/t/recommendations"
            with caplog.at_level("INFO"):
                with DateLock(out, DATE, "run-a") as lock:
                    assert lock.kind == "compare-and-set"
            assert "no conditional delete: released locks stay as markers" in caplog.text
            fs, path = rfs.resolve(lock_path(out, DATE))
            marker = json.loads(rfs.read_text(fs, path))
            assert marker["released"] is True and marker["run"] == "run-a"
            start, outcomes = threading.Barrier(2, timeout=30), {}
            locks = {name: DateLock(out, DATE, name) for name in ("run-b", "run-c")}

            def take(name: str) -> None:
                start.wait()
                try:
                    outcomes[name] = locks[name].acquire()
                except LockHeld as exc:
                    outcomes[name] = exc

            threads = [threading.Thread(target=take, args=(name,)) for name in locks]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            won = [v for v in outcomes.values() if isinstance(v, DateLock)]
            assert len(won) == 1 and won[0].took_over is None, outcomes      # a released lock is free, not stale
            [lost] = [v for v in outcomes.values() if not isinstance(v, DateLock)]
            assert f"is locked by run {won[0].run}" in str(lost)
            assert json.loads(rfs.read_text(fs, path))["token"] == won[0].token
            won[0].release()
        finally:
            storage.install(previous, environ={})


def test_a_reader_with_read_only_credentials_finds_the_published_night_on_s3_without_writing(s3_installed):
    """Readers of published nights (the guard, recsys serve) never write, not even the conditional-writes probe."""
    from recsys import conditional
    from recsys.publish.published import find_published

    out = f"s3://{s3_installed.bucket()}/t/recommendations"
    layout = PartitionLayout(out, DATE, "r1")
    with DateLock(out, DATE, "r1"):
        storekit.Store("s3", out).write(f"{layout.run_dir}/part-00000.parquet", b"x")
        storekit.Store("s3", out).write(f"{layout.run_dir}/_SUCCESS", b"")
        publish(layout, manifest_file.Manifest(job_run="r1"), "copy")
    conditional.forget()                                      # a fresh reader process
    with storekit.S3Proxy(s3_installed, drop_conditions_on=(), refuse=(b"PUT", b"POST", b"DELETE")) as read_only:
        previous = storage.install(read_only.object_store, environ={})
        try:
            night = find_published(out, DATE)
        finally:
            storage.install(previous, environ={})
    assert night is not None and night.run == "r1" and read_only.refused == 0


def test_without_boto3_the_lock_on_s3_is_best_effort_and_says_how_to_get_the_strong_one(s3, monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "boto3", None)           # import boto3 raises ImportError
    with caplog.at_level("WARNING"):
        with DateLock(s3.root(), DATE, "run-a") as lock:
            assert lock.kind == "best effort"
    assert "boto3 is not installed: pip install 'recsys[s3]'" in caplog.text
