"""The per-date lock: exclusive, stale locks detected and taken over by exactly one run. No Spark.

The races at the end run on the local file system and on S3 (moto's server, whose conditional writes make
the lock a compare-and-set there): the `store` fixture runs each twice.
"""
import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recsys import fs as rfs
from recsys.errors import ExitCode, LockHeld
from recsys.publish.lock import DateLock, lock_path

DATE = dt.date(2024, 5, 8)


def _plant_lock(output, *, host=None, pid=None, heartbeat_age_s=0.0, token="planted", ttl_s=600):
    """A lock file as another run would have left it."""
    path = lock_path(str(output), DATE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"run": "other-run", "token": token, "host": host or socket.gethostname(), "pid": pid or os.getpid(),
                   "pid_started": None, "started_at": "2024-05-08T02:15:00+00:00", "ttl_s": ttl_s}, f)
    old = time.time() - heartbeat_age_s
    os.utime(path, (old, old))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_for_the_same_date_gets_lock_held_with_the_holder_named(tmp_path):
    with DateLock(str(tmp_path), DATE, "first-run"):
        with pytest.raises(LockHeld, match=r"dt=2024-05-08 is locked by run first-run \(pid \d+ on ") as err:
            DateLock(str(tmp_path), DATE, "second-run").acquire()
        assert err.value.exit_code == ExitCode.LOCK_HELD == 4
        DateLock(str(tmp_path), DATE + dt.timedelta(days=1), "other-date").acquire().release()  # other dates are free
    DateLock(str(tmp_path), DATE, "third-run").acquire().release()   # released on exit


def test_the_lock_file_appears_complete_with_holder_details(tmp_path):
    with DateLock(str(tmp_path), DATE, "run-a") as lock:
        data = json.loads(Path(lock.path).read_text())
    assert data["run"] == "run-a" and data["pid"] == os.getpid() and data["host"] == socket.gethostname()
    assert {"token", "started_at", "ttl_s", "pid_started"} <= set(data)
    assert not os.path.exists(lock.path)


def test_a_lock_whose_process_is_gone_on_this_host_is_taken_over(tmp_path, caplog):
    _plant_lock(tmp_path, pid=_dead_pid())
    with caplog.at_level("WARNING"):
        lock = DateLock(str(tmp_path), DATE, "rerun").acquire()
    try:
        assert lock.took_over is not None and lock.took_over.run == "other-run"
        assert "is gone" in caplog.text and "taking over the lock" in caplog.text
        lock.verify()
    finally:
        lock.release()


def test_a_live_process_on_this_host_keeps_its_lock_however_old_the_heartbeat(tmp_path):
    _plant_lock(tmp_path, pid=os.getpid(), heartbeat_age_s=10_000)   # e.g. a stopped process
    with pytest.raises(LockHeld, match="locked by run other-run"):
        DateLock(str(tmp_path), DATE, "rerun").acquire()


def test_a_lock_from_another_host_is_stale_only_after_its_heartbeat_ttl(tmp_path):
    _plant_lock(tmp_path, host="node-that-died", pid=12345, heartbeat_age_s=30, ttl_s=600)
    with pytest.raises(LockHeld, match="last heartbeat 30s ago"):
        DateLock(str(tmp_path), DATE, "rerun").acquire()
    _plant_lock(tmp_path, host="node-that-died", pid=12345, heartbeat_age_s=900, ttl_s=600)
    with DateLock(str(tmp_path), DATE, "rerun") as lock:
        assert lock.took_over.host == "node-that-died"


def test_the_holder_refreshes_its_heartbeat_until_the_lock_is_no_longer_its_own(tmp_path):
    with DateLock(str(tmp_path), DATE, "run-a") as lock:
        assert lock._thread is not None and lock._thread.is_alive()    # beats every ttl/10 in the background
        old = time.time() - 1000
        os.utime(lock.path, (old, old))
        assert lock.beat() is True                                      # what the thread does each interval
        assert os.stat(lock.path).st_mtime > time.time() - 60
        os.unlink(lock.path)
        _plant_lock(tmp_path, pid=os.getpid(), token="someone-else", heartbeat_age_s=1000)
        assert lock.beat() is False                                     # stops, and leaves the other lock alone
        assert os.stat(lock.path).st_mtime < time.time() - 900


def _contend(output: str, i: int, start, judged, done, results) -> None:
    """One would-be run in its own process: try to take the lock, report, hold it until all have tried.

    Every contender first judges the planted lock stale, and only then may any of them act: the
    worst interleaving for a takeover, forced by a barrier rather than left to chance.
    """
    from recsys.publish import lock as lock_module

    judge, first = lock_module.stale_reason, [True]

    def judge_then_wait(holder, **kw):
        reason = judge(holder, **kw)
        if first[0]:
            first[0] = False
            judged.wait()
        return reason

    lock_module.stale_reason = judge_then_wait
    lock = DateLock(output, DATE, f"contender-{i}")
    try:
        start.wait()
        lock.acquire()
        results.put(("won", i, json.loads(Path(lock.path).read_text())["token"] == lock.token))
    except LockHeld:
        results.put(("lost", i, False))
    except BaseException as exc:   # report instead of leaving the parent waiting
        results.put(("error", i, repr(exc)))
    try:
        done.wait()
    finally:
        lock.release()


def test_only_one_of_many_processes_takes_over_the_same_stale_lock(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    n = 6
    for round_ in range(4):
        out = str(tmp_path / f"round{round_}")
        _plant_lock(out, pid=_dead_pid(), token=f"stale{round_}")
        start, judged, done = (ctx.Barrier(n, timeout=30) for _ in range(3))
        results = ctx.Queue()
        procs = [ctx.Process(target=_contend, args=(out, i, start, judged, done, results), daemon=True)
                 for i in range(n)]
        try:
            for p in procs:
                p.start()
            outcomes = [results.get(timeout=60) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=35)
                if p.is_alive():
                    p.kill()
        winners = [o for o in outcomes if o[0] == "won"]
        assert len(winners) == 1, (round_, outcomes)
        assert winners[0][2] is True            # and the lock file is the winner's


def test_a_run_whose_lock_was_taken_over_cannot_publish(tmp_path):
    lock = DateLock(str(tmp_path), DATE, "slow-run").acquire()
    lock._stop_heartbeat()
    os.unlink(lock.path)                                    # as if another run had replaced it
    _plant_lock(tmp_path, pid=os.getpid(), token="someone-else")
    with pytest.raises(LockHeld, match="lost the lock"):
        lock.verify()
    lock.release()                                          # must not delete the other run's lock
    assert json.loads(Path(lock.path).read_text())["token"] == "someone-else"


def test_the_holder_records_its_mlflow_run_in_the_lock_for_whoever_finds_it_dead(tmp_path):
    lock = DateLock(str(tmp_path), DATE, "dying-run").acquire()
    lock._stop_heartbeat()
    first = json.loads(Path(lock.path).read_text())
    assert "mlflow_run_id" not in first                              # no MLflow run yet: nothing to record
    assert lock.annotate(mlflow_run_id="a" * 32, tracking_store="sqlite:////x/mlflow.db") is True
    data = json.loads(Path(lock.path).read_text())
    assert data == {**first, "mlflow_run_id": "a" * 32, "tracking_store": "sqlite:////x/mlflow.db"}   # the rest kept
    lock._held = False                                               # the process dies holding it
    os.utime(lock.path, (time.time() - 900, time.time() - 900))
    with open(lock.path) as f:
        data = json.load(f)
    data["pid"] = _dead_pid()
    Path(lock.path).write_text(json.dumps(data))
    with DateLock(str(tmp_path), DATE, "next-run") as rerun:
        assert rerun.took_over.run == "dying-run" and rerun.took_over.mlflow_run_id == "a" * 32
        assert rerun.took_over.tracking_store == "sqlite:////x/mlflow.db"
        assert "is gone" in rerun.took_over_reason
        # the dead run's handle can no longer write into the new holder's lock
        assert lock.annotate(mlflow_run_id="b" * 32, tracking_store="elsewhere") is False
        assert json.loads(Path(rerun.path).read_text())["run"] == "next-run"
        assert "mlflow_run_id" not in json.loads(Path(rerun.path).read_text())


def test_a_lock_written_before_it_recorded_mlflow_runs_is_still_read_and_taken_over(tmp_path):
    _plant_lock(tmp_path, pid=_dead_pid())                             # the old format: no MLflow fields
    with DateLock(str(tmp_path), DATE, "rerun") as lock:
        assert lock.took_over.run == "other-run"
        assert lock.took_over.mlflow_run_id is None and lock.took_over.tracking_store is None


# -- races, on the local file system and on S3 (moto's server: conditional writes) ---------------------------------


def _race(n: int, take) -> list[tuple[str, object]]:
    """``take(i)`` in ``n`` threads released together; each outcome is ("won", lock) or ("lost", LockHeld)."""
    import threading

    start = threading.Barrier(n, timeout=30)
    outcomes: list = [None] * n

    def run(i: int) -> None:
        try:
            start.wait()
            outcomes[i] = ("won", take(i))
        except LockHeld as exc:
            outcomes[i] = ("lost", exc)
        except BaseException as exc:   # reported, not lost in the thread
            outcomes[i] = ("error", exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(o is not None and o[0] != "error" for o in outcomes), outcomes
    return outcomes


def _lock_data(store, output: str) -> dict:
    fs, path = rfs.resolve(lock_path(output, DATE))
    return json.loads(rfs.read_text(fs, path))


def _plant_stale(store, output: str) -> None:
    """The lock of a run on a host that died 15 minutes ago: stale by its heartbeat, for any host."""
    path = lock_path(output, DATE)
    store.write(path, json.dumps({"run": "dead-run", "token": "dead-token", "host": "node-that-died", "pid": 12345,
                                  "started_at": "2024-05-08T02:15:00+00:00", "ttl_s": 0.001}).encode())
    if store.name == "local":
        os.utime(path, (time.time() - 900, time.time() - 900))
    # on S3 the heartbeat is the object's Last-Modified: older than the ttl of 1 ms by the time anyone reads it


def test_race_of_8_takers_for_one_date_on_local_and_s3_one_holds_it_the_others_get_lock_held_naming_it(store):
    out = store.root()
    locks = [DateLock(out, DATE, f"taker-{i}") for i in range(8)]
    outcomes = _race(8, lambda i: locks[i].acquire())
    try:
        won = [lock for kind, lock in outcomes if kind == "won"]
        assert len(won) == 1, outcomes
        assert _lock_data(store, out)["token"] == won[0].token           # and the lock is the winner's
        assert won[0].kind == ("exclusive" if store.name == "local" else "compare-and-set")
        for kind, exc in outcomes:
            if kind == "lost":
                assert exc.exit_code == ExitCode.LOCK_HELD == 4
                assert f"dt=2024-05-08 is locked by run {won[0].run} (pid {os.getpid()}" in str(exc)
                assert "\n" not in str(exc)                               # one line, naming the holder
    finally:
        for kind, lock in outcomes:
            if kind == "won":
                lock.release()
    assert not store.exists(lock_path(out, DATE))
    with DateLock(out, DATE, "next-night"):                                # free again once released
        pass


def test_race_of_4_takers_for_a_stale_lock_on_local_and_s3_exactly_one_takes_it_over(store, monkeypatch):
    """Every taker judges the stale lock before any of them acts: the worst interleaving, forced by a barrier."""
    import threading

    from recsys.publish import lock as lock_module

    out = store.root()
    _plant_stale(store, out)
    judged, judge = threading.Barrier(4, timeout=30), lock_module.stale_reason

    def judge_then_wait(holder, **kw):
        reason = judge(holder, **kw)
        judged.wait()
        return reason

    monkeypatch.setattr(lock_module, "stale_reason", judge_then_wait)
    locks = [DateLock(out, DATE, f"taker-{i}") for i in range(4)]
    outcomes = _race(4, lambda i: locks[i].acquire())
    try:
        won = [lock for kind, lock in outcomes if kind == "won"]
        assert len(won) == 1, outcomes
        assert won[0].took_over.run == "dead-run" and "no heartbeat" in won[0].took_over_reason
        assert _lock_data(store, out)["token"] == won[0].token
        for kind, exc in outcomes:
            if kind == "lost":
                assert exc.exit_code == 4 and "\n" not in str(exc)
                assert "taking over the stale lock of run dead-run" in str(exc)
    finally:
        for kind, lock in outcomes:
            if kind == "won":
                lock.release()


def test_race_lost_on_local_and_s3_a_holder_whose_lock_was_taken_over_stops_before_publishing(store, monkeypatch):
    """A holder on another host stalls past its ttl; a run here takes its lock over; the stalled one then
    tries to publish through the real publish step and is stopped before switching anything."""
    from recsys.publish.manifest import Manifest
    from recsys.publish.publisher import PartitionLayout, publish
    from recsys.publish.published import pointer_path

    out = store.root()
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    stalled = DateLock(out, DATE, "stalled-run", ttl_s=0.001).acquire()
    monkeypatch.undo()
    stalled._stop_heartbeat()                                            # stalled: no more heartbeats
    if store.name == "local":
        os.utime(stalled.path, (time.time() - 900, time.time() - 900))
    layout = PartitionLayout(out, DATE, "stalled-run")
    store.write(f"{layout.run_dir}/part-00000.parquet", b"rows")
    store.write(f"{layout.run_dir}/_SUCCESS", b"")
    with DateLock(out, DATE, "next-run") as taker:
        assert taker.took_over.run == "stalled-run"
        with pytest.raises(LockHeld, match=r"lost the lock on dt=2024-05-08 \(now held by run next-run .*nothing was "
                                           r"published") as err:
            publish(layout, Manifest(job_run="stalled-run"), "copy" if store.name == "s3" else None,
                    still_ours=stalled.verify)
        assert err.value.exit_code == 4
        assert not store.exists(pointer_path(out, DATE)) and not store.exists(layout.final_dir)   # nothing switched
        assert stalled.annotate(mlflow_run_id="m", tracking_store="s") is False   # nor written into the new lock
        stalled.release()                                                # leaves the new holder's lock alone
        assert _lock_data(store, out)["token"] == taker.token
        taker.verify()
