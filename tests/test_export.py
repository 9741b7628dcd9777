"""``recsys export``: published lists into a real Redis (the session's ``redis_server``), one switch, and its faults.

The value format and the Redis primitives are tested without Spark; the export itself runs the real CLI
on the shared Spark session against partitions the nightly job published. Each test uses a key prefix
of its own in the one Redis. The faults that need a process to die (Redis killed mid-export, the exporter
killed mid-export) run ``recsys export`` in a subprocess held at a pause point (docs/faults.md).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobkit
from jobkit import N_USERS, RUN_DATE
from recsys.errors import ExitCode
from recsys.export import encoding
from recsys.export import redis_store as store

REPO = Path(__file__).resolve().parent.parent
EARLIER = RUN_DATE.replace(day=RUN_DATE.day - 1)


def _client(redis_server):
    import redis

    return redis.Redis.from_url(redis_server.url)


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------------------------------------------
# the value format


def test_a_value_laid_out_as_documented_decodes_to_its_list():
    """docs/export.md's layout, built by hand as another language's writer would: uint32 ids, then int64."""
    narrow = bytes([1, 1, 1, 0]) + struct.pack("<2I", 7, 4_000_000_000) + struct.pack("<2f", 0.5, 0.25)
    decoded = encoding.decode(narrow)
    assert decoded.item_ids.tolist() == [7, 4_000_000_000] and decoded.scores.tolist() == [0.5, 0.25]
    assert decoded.source == 1
    wide = bytes([1, 0, 0, 0]) + struct.pack("<2q", -3, 2 ** 40) + struct.pack("<2f", 1.0, -1.5)
    assert encoding.decode(wide).item_ids.tolist() == [-3, 2 ** 40]
    assert encoding.encode_list([7, 4_000_000_000], [0.5, 0.25], 1) == narrow   # the writer agrees byte for byte
    assert encoding.encode_list([-3, 2 ** 40], [1.0, -1.5], 0) == wide
    assert len(encoding.encode_list(np.arange(100), np.ones(100), 0)) == 804   # top 100: 4 + 100 x (4 + 4)


def test_a_batch_of_rows_encodes_to_each_row_s_list_whatever_its_length_ids_and_source():
    rows = [
        {"user_id": 5, "recommendations": [{"item_id": 1, "score": 0.5}, {"item_id": 2, "score": 0.25}],
         "source": "model", "model_version": "1"},
        {"user_id": 3, "recommendations": [{"item_id": 9, "score": 0.125}], "source": "popularity",
         "model_version": "1"},
        {"user_id": 8, "recommendations": [], "source": "model", "model_version": "1"},
        {"user_id": 2 ** 40, "recommendations": [{"item_id": 2 ** 35, "score": 1.0}, {"item_id": 3, "score": 0.0}],
         "source": "popularity", "model_version": "1"},
    ]
    from recsys.data.contracts import OUTPUT_SCHEMA

    table = pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
    batch = table.slice(1).to_batches()[0]         # a sliced batch: offsets that do not start at 0
    encoded = encoding.encode_batch(batch, ["model", "popularity"])
    assert encoded.user_ids.tolist() == [3, 8, 2 ** 40]
    assert encoded.value_bytes == sum(map(len, encoded.values))
    for row, value in zip(rows[1:], encoded.values):
        decoded = encoding.decode(value)
        assert decoded.item_ids.tolist() == [r["item_id"] for r in row["recommendations"]]
        assert decoded.scores.tolist() == [r["score"] for r in row["recommendations"]]
        assert ["model", "popularity"][decoded.source] == row["source"]
    assert encoded.values[2][1] == 0                # an id beyond 32 bits: that group is written with int64 ids
    with pytest.raises(encoding.EncodingError, match="not among the version's sources"):
        encoding.encode_batch(batch, ["model"])


def test_a_value_of_another_format_or_a_broken_length_is_refused():
    with pytest.raises(encoding.EncodingError, match="format 2"):
        encoding.decode(bytes([2, 1, 0, 0]))
    with pytest.raises(encoding.EncodingError, match="whole"):
        encoding.decode(bytes([1, 1, 0, 0, 1, 2, 3]))
    with pytest.raises(encoding.EncodingError, match="shorter"):
        encoding.decode(b"\x01")


# ---------------------------------------------------------------------------------------------------
# Redis: the lock, the switch, the lookup


def test_the_export_lock_is_exclusive_and_a_dead_holder_on_this_host_is_taken_over(redis_server):
    from recsys.errors import LockHeld

    client, keys = _client(redis_server), store.Keyspace(_prefix())
    with store.ExportLock(client, keys, ttl_s=30):
        with pytest.raises(LockHeld, match="another export holds"):
            store.ExportLock(client, keys, ttl_s=30).acquire()
    assert client.get(keys.lock) is None           # released
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    client.set(keys.lock, json.dumps({"token": "x", "host": os.uname().nodename, "pid": dead.pid,
                                      "pid_started": 1.0, "started_at": "then"}), px=30_000)
    lock = store.ExportLock(client, keys, ttl_s=30).acquire()
    try:
        assert lock.took_over["pid"] == dead.pid and json.loads(client.get(keys.lock))["token"] == lock.token
    finally:
        lock.release()


def test_the_switch_refuses_a_lost_lock_a_moved_pointer_and_an_incomplete_version(redis_server):
    from recsys.errors import LockHeld

    client, keys = _client(redis_server), store.Keyspace(_prefix())
    fields = {"version": "v1", "date": "2024-05-08", "sources": ["model"]}
    with store.ExportLock(client, keys, ttl_s=30) as lock:
        version = store.begin_version(client, keys, {"date": "2024-05-08"})
        client.hset(keys.files_key(version), "a.parquet", 3)
        with pytest.raises(store.SwitchRefused, match="1 of 2 files"):
            store.switch(client, keys, lock, store.Switch(version, 2, fields, {}), None)
        with pytest.raises(LockHeld, match="another export moved the pointer"):
            store.switch(client, keys, lock, store.Switch(version, 1, fields, {}), "v0")
        assert store.read_pointer(client, keys) is None
        store.switch(client, keys, lock, store.Switch(version, 1, {**fields, "version": version}, {"users": 3}), None)
        assert store.read_pointer(client, keys).version == version
        assert store.read_versions(client, keys)[version]["state"] == store.LIVE
    with pytest.raises(LockHeld, match="lock .* was lost"):
        store.switch(client, keys, lock, store.Switch(version, 1, fields, {}), version)


def test_the_lookup_script_answers_from_the_version_the_pointer_names_and_removal_leaves_nothing(redis_server):
    client, keys = _client(redis_server), store.Keyspace(_prefix())
    script = client.register_script(store.LOOKUP_SCRIPT)
    assert script(keys=[keys.pointer], args=[f"{keys.prefix}:", 1]) == [None]      # nothing exported yet
    for version, item in (("v1", 10), ("v2", 20)):
        client.set(keys.user_key(version, 1), encoding.encode_list([item], [1.0], 0))
        client.set(keys.fallback_key(version), encoding.encode_list([item + 1], [0.5], 1))
    client.hset(keys.pointer, mapping={"version": "v1", "date": "2024-05-08"})
    answer = script(keys=[keys.pointer], args=[f"{keys.prefix}:", 1, 2])
    assert answer[0] == b"v1" and encoding.decode(answer[1]).item_ids.tolist() == [10] and answer[2] is None
    assert encoding.decode(answer[3]).item_ids.tolist() == [11]                     # user 2: v1's fallback
    client.hset(keys.pointer, "version", "v2")
    answer = script(keys=[keys.pointer], args=[f"{keys.prefix}:", 1])
    assert answer[0] == b"v2" and encoding.decode(answer[1]).item_ids.tolist() == [20] and answer[2] is None
    client.hset(keys.versions, "v1", json.dumps({"state": "live"}))
    assert store.remove_version(client, keys, "v1") == 2
    assert list(client.scan_iter(match=keys.version_pattern("v1"))) == [] and not client.hexists(keys.versions, "v1")


# ---------------------------------------------------------------------------------------------------
# the export, end to end


@pytest.fixture(scope="module")
def published(spark, tmp_path_factory):
    """The nightly job's partitions for EARLIER and RUN_DATE (one model store, one dataset)."""
    from recsys.pipelines.nightly import run_nightly

    store_ = jobkit.make_store(tmp_path_factory.mktemp("store"))
    data = jobkit.write_dataset(tmp_path_factory.mktemp("data"))
    cfg = jobkit.config(data, store_)
    results = {d: run_nightly(spark, cfg, d) for d in (EARLIER, RUN_DATE)}
    return SimpleNamespace(store=store_, data=data, results=results, output=data / "recommendations")


def _copy_output(published, root: Path, dates=(EARLIER, RUN_DATE)) -> Path:
    """The published dates under ``root``: their run directories and pointers, and their path views. The
    export there opens the output table of ``root``, which registers every date a pointer names."""
    for date in dates:
        shutil.copytree(published.output / "_runs" / f"dt={date}", root / "recommendations" / "_runs" / f"dt={date}")
        shutil.copytree(published.output / f"dt={date}", root / "recommendations" / f"dt={date}")
    return root / "recommendations"


def _run_dir(output: Path, date=RUN_DATE) -> Path:
    """The run directory the date's pointer names: what the table's partition points at, and readers read."""
    from recsys.publish.published import read_pointer, run_dir

    return Path(run_dir(str(output), date, read_pointer(str(output), date).run))


def _args(root, published, redis_url: str, prefix: str, *extra: str) -> list[str]:
    return jobkit.recommend_args(root, published.store, f"export.redis_url={redis_url}", f"export.prefix={prefix}",
                                 *extra, inputs=published.data)


def _export(monkeypatch, spark, root, published, redis_url, prefix, date=RUN_DATE, *flags, extra=()) -> int:
    return jobkit.cli(monkeypatch, spark, ["export", "--date", str(date), *flags,
                                           *_args(root, published, redis_url, prefix, *extra)])


def _rows(partition: Path) -> dict[int, dict]:
    return {r["user_id"]: r for r in pq.read_table(partition).to_pylist()}


def _served(client, keys: store.Keyspace, version: str, users) -> dict[int, tuple[list, list, int]]:
    out = {}
    for user in users:
        decoded = encoding.decode(client.get(keys.user_key(version, user)))
        out[user] = (decoded.item_ids.tolist(), decoded.scores.tolist(), decoded.source)
    return out


def _keys_of(client, keys: store.Keyspace, version: str) -> list[bytes]:
    return list(client.scan_iter(match=keys.version_pattern(version), count=1000))


def test_an_export_writes_every_published_row_then_switches_the_pointer_and_records_its_figures(
        spark, published, redis_server, tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    output = _copy_output(published, tmp_path)
    prefix = _prefix()
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix) == ExitCode.OK
    client, keys = _client(redis_server), store.Keyspace(prefix)
    pointer = store.read_pointer(client, keys)
    manifest = json.loads((_run_dir(output) / "_manifest.json").read_text())
    assert (pointer.version, pointer.date, pointer.model_version, pointer.run) == (
        "v1", RUN_DATE, published.store.version, manifest["job_run"])
    assert _run_dir(output).name == f"run={manifest['job_run']}"
    assert pointer.sources == ("model", "popularity") and pointer.users == N_USERS
    rows = _rows(_run_dir(output))
    served = _served(client, keys, "v1", rows)
    for user, row in rows.items():                  # every published row, exactly: ids, float32 scores, source
        ids, scores, source = served[user]
        assert ids == [r["item_id"] for r in row["recommendations"]]
        assert scores == [r["score"] for r in row["recommendations"]]
        assert pointer.sources[source] == row["source"]
    fallback = encoding.decode(client.get(keys.fallback_key("v1")))
    assert fallback.item_ids.tolist() == manifest["fallback"]["item_ids"]
    assert len(_keys_of(client, keys, "v1")) == N_USERS + 2          # the users, the fallback, the files' record
    record = store.read_versions(client, keys)["v1"]
    assert record["state"] == "live" and record["users"] == N_USERS and record["files"] >= 1
    assert record["partition"] == str(_run_dir(output))           # read from the run directory, not the path view
    assert record["value_bytes"] == sum(4 + 8 * len(r["recommendations"]) for r in rows.values())
    assert record["users_per_s"] > 0 and record["seconds"] > 0
    run = MlflowClient(published.store.tracking_uri).get_run(manifest["run_id"])
    assert run.data.metrics["export_users"] == N_USERS and run.data.metrics["export_value_bytes"] == record["value_bytes"]
    assert run.data.tags["recsys.export.version"] == "v1"
    assert "version v1" in capsys.readouterr().out
    assert client.get(keys.lock) is None


def test_exporting_the_same_run_again_is_a_no_op_unless_forced_and_versions_beyond_keep_versions_go(
        spark, published, redis_server, tmp_path, monkeypatch, capsys):
    _copy_output(published, tmp_path)
    prefix = _prefix()
    client, keys = _client(redis_server), store.Keyspace(prefix)
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix) == ExitCode.OK
    capsys.readouterr()
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix) == ExitCode.OK
    assert "skipped" in capsys.readouterr().out and store.read_pointer(client, keys).version == "v1"
    assert sorted(store.read_versions(client, keys)) == ["v1"]
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, RUN_DATE, "--force",
                   extra=["export.keep_versions=2"]) == ExitCode.OK
    assert store.read_pointer(client, keys).version == "v2"
    assert sorted(store.read_versions(client, keys)) == ["v1", "v2"]          # the previous one is kept
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, RUN_DATE, "--force",
                   extra=["export.keep_versions=1"]) == ExitCode.OK
    assert store.read_pointer(client, keys).version == "v3"
    assert sorted(store.read_versions(client, keys)) == ["v3"]
    assert _keys_of(client, keys, "v1") == [] and _keys_of(client, keys, "v2") == []   # every key of theirs


def test_an_older_date_than_the_one_served_needs_allow_older(spark, published, redis_server, tmp_path, monkeypatch,
                                                              caplog):
    _copy_output(published, tmp_path)
    prefix = _prefix()
    client, keys = _client(redis_server), store.Keyspace(prefix)
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix) == ExitCode.OK
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, EARLIER) == ExitCode.BAD_INPUT
    assert "--allow-older" in jobkit.errors_logged(caplog)[-1]
    assert store.read_pointer(client, keys).date == RUN_DATE and sorted(store.read_versions(client, keys)) == ["v1"]
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, EARLIER,
                   "--allow-older") == ExitCode.OK
    assert store.read_pointer(client, keys).date == EARLIER


def test_a_date_that_is_not_published_or_failed_validation_is_refused_with_exit_2(
        spark, published, redis_server, tmp_path, monkeypatch, caplog):
    output = _copy_output(published, tmp_path, dates=(RUN_DATE,))
    prefix = _prefix()
    client, keys = _client(redis_server), store.Keyspace(prefix)
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, EARLIER) == ExitCode.BAD_INPUT
    assert f"nothing is published for {EARLIER}" in jobkit.errors_logged(caplog)[-1]
    staged = output / "_runs" / f"dt={EARLIER}" / "run=20240507T000000Z-1"   # complete, but neither the table nor
    shutil.copytree(_run_dir(output), staged)                                # a pointer names it: not published
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, EARLIER) == ExitCode.BAD_INPUT
    manifest_path = _run_dir(output) / "_manifest.json"                      # the published run's own manifest
    manifest = json.loads(manifest_path.read_text())
    manifest["validation"]["unavailable_items"] = 3
    manifest_path.unlink()                                                   # not through a hard link to the view
    manifest_path.write_text(json.dumps(manifest))
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix) == ExitCode.BAD_INPUT
    assert "failed validation checks {'unavailable_items': 3}" in jobkit.errors_logged(caplog)[-1]
    assert client.exists(keys.pointer, keys.versions, keys.seq) == 0               # nothing was written


def test_with_no_redis_configured_the_scheduler_s_export_has_nothing_to_do_and_a_plain_one_exits_2(
        spark, published, tmp_path, monkeypatch, caplog):
    """The scheduler's export task runs ``--if-configured`` after every night (conf/schedulers): a deployment
    without Redis gets a successful task that says so, while an operator's own ``recsys export`` is told what
    to set."""
    caplog.set_level(logging.INFO, logger="recsys")
    args = ["export", "--date", str(RUN_DATE), *jobkit.recommend_args(tmp_path, published.store,
                                                                       inputs=published.data)]
    assert jobkit.cli(monkeypatch, spark, [*args, "--if-configured"]) == ExitCode.OK
    assert "recsys export: nothing to do, export.redis_url is not set" in caplog.messages
    assert jobkit.errors_logged(caplog) == []
    assert jobkit.cli(monkeypatch, spark, args) == ExitCode.BAD_INPUT
    assert "export.redis_url is not set: name the Redis to export to" in jobkit.errors_logged(caplog)[-1]


def test_redis_down_at_the_start_exits_1_and_leaves_the_pointer_unchanged(
        spark, published, redis_server, tmp_path, monkeypatch, caplog):
    _copy_output(published, tmp_path)
    prefix = _prefix()
    keys = store.Keyspace(prefix)
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, EARLIER) == ExitCode.OK
    redis_server.kill()
    try:
        code = _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix)
    finally:
        redis_server.start()
    assert code == ExitCode.UNEXPECTED_ERROR
    assert "is unavailable" in jobkit.errors_logged(caplog)[-1] and "pointer is unchanged" in jobkit.errors_logged(caplog)[-1]
    client = _client(redis_server)
    assert store.read_pointer(client, keys).date == EARLIER and sorted(store.read_versions(client, keys)) == ["v1"]


def test_the_nightly_job_exports_as_its_last_stage_when_configured(spark, published, redis_server, tmp_path):
    from recsys.pipelines.nightly import run_dates

    prefix = _prefix()
    cfg = jobkit.config(tmp_path, published.store, f"export.redis_url={redis_server.url}", f"export.prefix={prefix}",
                        "export.after_publish=true", inputs=published.data)
    results = run_dates(spark, cfg, [RUN_DATE, EARLIER])                # a backfill that ends on an older date
    assert [r.export.status for r in results] == ["exported", "skipped"]
    assert "serves the later date" in results[1].export.reason
    pointer = store.read_pointer(_client(redis_server), store.Keyspace(prefix))
    assert pointer.date == RUN_DATE and pointer.run == results[0].manifest.job_run
    assert [r.exit_code for r in results] == [ExitCode.OK, ExitCode.OK]


# ---------------------------------------------------------------------------------------------------
# a process dies in the middle


def _start_export(root: Path, published, redis_url: str, prefix: str, pause_at: str, pause_max_s: int = 300):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RECSYS_PAUSE_AT": pause_at, "RECSYS_PAUSE_MAX_S": str(pause_max_s),
           "RECSYS_SHUFFLE_PARTITIONS": "4", "PYSPARK_PYTHON": sys.executable}
    env.pop("RECSYS_FAULT_INJECTION", None)
    argv = [sys.executable, "-m", "recsys.cli", "export", "--date", str(RUN_DATE),
            *_args(root, published, redis_url, prefix, "spark.master=local[2,4]", "spark.conf.spark.ui.enabled=false")]
    return subprocess.Popen(argv, env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, errors="replace")


def _wait_for_pause(proc, point: str) -> tuple[int, list[str]]:
    """The pid the pause line names (the process holding), reading the exporter's stderr up to it."""
    seen = []
    for line in proc.stderr:                # the JVM relays the Python workers' stderr; EOF if it dies first
        seen.append(line)
        if f"recsys-pause: {point} pid=" in line:
            return int(line.rsplit("pid=", 1)[1].split()[0]), seen
    raise AssertionError(f"the export ended without reaching {point}:\n" + "".join(seen[-30:]))


@pytest.mark.slow
def test_redis_killed_mid_export_leaves_the_pointer_and_the_old_version_and_a_rerun_removes_the_partial_one(
        spark, published, redis_server, tmp_path, monkeypatch):
    _copy_output(published, tmp_path)
    prefix = _prefix()
    keys = store.Keyspace(prefix)
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, EARLIER) == ExitCode.OK
    old = _served(_client(redis_server), keys, "v1", range(1, N_USERS + 1))
    proc = _start_export(tmp_path, published, redis_server.url, prefix, "export_writing")
    try:
        worker, _ = _wait_for_pause(proc, "export_writing")   # a task wrote its first users of version v2
        redis_server.kill()
        os.kill(worker, signal.SIGUSR1)                        # the task carries on, into a dead Redis
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            jobkit.kill_tree(proc)
        if not redis_server.running:
            redis_server.start()
    assert proc.returncode == ExitCode.UNEXPECTED_ERROR
    redis_server.kill()                  # and a second crash: what was acknowledged is in the append-only file
    redis_server.start()
    client = _client(redis_server)
    pointer = store.read_pointer(client, keys)
    assert (pointer.version, pointer.date) == ("v1", EARLIER)                         # unchanged
    assert _served(client, keys, "v1", range(1, N_USERS + 1)) == old                    # the old night, still served
    assert store.read_versions(client, keys)["v2"]["state"] == "writing" and _keys_of(client, keys, "v2")

    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix) == ExitCode.OK
    versions = store.read_versions(client, keys)
    assert "v2" not in versions and _keys_of(client, keys, "v2") == []               # the partial version is gone
    assert store.read_pointer(client, keys).version == "v3" and store.read_pointer(client, keys).date == RUN_DATE
    assert sorted(versions) == ["v1", "v3"]                                           # keep_versions = 2


@pytest.mark.slow
def test_an_exporter_killed_mid_export_leaves_the_pointer_and_the_next_export_takes_over_and_cleans_up(
        spark, published, redis_server, tmp_path, monkeypatch, caplog):
    _copy_output(published, tmp_path)
    prefix = _prefix()
    keys, client = store.Keyspace(prefix), _client(redis_server)
    assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix, EARLIER) == ExitCode.OK
    proc = _start_export(tmp_path, published, redis_server.url, prefix, "export_writing")
    try:
        _wait_for_pause(proc, "export_writing")
        jobkit.kill_tree(proc)                                        # SIGKILL: the exporter, its JVM and workers
    finally:
        if proc.poll() is None:
            jobkit.kill_tree(proc)
        proc.stderr.close()
    assert store.read_pointer(client, keys).version == "v1"
    assert json.loads(client.get(keys.lock))["pid"] == proc.pid                       # its lock, left behind
    with caplog.at_level("WARNING"):
        assert _export(monkeypatch, spark, tmp_path, published, redis_server.url, prefix) == ExitCode.OK
    assert "took over the export lock" in caplog.text and "removed version v2" in caplog.text
    assert _keys_of(client, keys, "v2") == [] and store.read_pointer(client, keys).version == "v3"
