"""``recsys serve`` answering from the published lists, without an on-demand backend: the embedded index of the
newest published partition, and Redis (the session's ``redis_server``) through the pointer, with a reader that
runs through an export and checks that every answer is one night's list, never a mix.

The frontends are real ``recsys serve`` subprocesses on loopback; the partitions are the nightly job's, made
once per module on the shared Spark session. With a backend running (users missing from the lists, ``fresh``,
the store down): tests/test_serve.py.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import yaml

import jobkit
from jobkit import N_USERS, RUN_DATE, TOP_N
from servekit import Frontend, until

pytest.importorskip("fastapi")

from recsys.errors import ExitCode  # noqa: E402
from recsys.processes import free_port  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
EARLIER = RUN_DATE.replace(day=RUN_DATE.day - 1)
UNKNOWN_USER = 10 ** 12


@pytest.fixture(scope="module")
def nights(spark, tmp_path_factory):
    """The nightly job's partitions of EARLIER and RUN_DATE, to be copied where a frontend serves them."""
    from recsys.pipelines.nightly import run_nightly

    root = tmp_path_factory.mktemp("nights")
    store = jobkit.make_store(root / "store")
    data = jobkit.write_dataset(root / "data")
    cfg = jobkit.config(data, store)
    for date in (EARLIER, RUN_DATE):
        run_nightly(spark, cfg, date)
    output = data / "recommendations"
    rows = {d: {r["user_id"]: r for r in pq.read_table(output / f"dt={d}").to_pylist()} for d in (EARLIER, RUN_DATE)}
    manifests = {d: json.loads((output / f"dt={d}" / "_manifest.json").read_text()) for d in (EARLIER, RUN_DATE)}
    differ = sum(rows[EARLIER][u]["recommendations"] != rows[RUN_DATE][u]["recommendations"] for u in rows[EARLIER])
    assert differ >= N_USERS // 2, "the two nights must differ for a mix to be seen"
    return SimpleNamespace(store=store, data=data, output=output, rows=rows, manifests=manifests)


def _copy_night(nights, root: Path, date) -> None:
    """One published night under ``root``: its run directories and pointer, then its path view."""
    shutil.copytree(nights.output / "_runs" / f"dt={date}", root / "recommendations" / "_runs" / f"dt={date}")
    shutil.copytree(nights.output / f"dt={date}", root / "recommendations" / f"dt={date}")


def _serving_root(nights, root: Path, dates) -> Path:
    """A config serving ``dates`` of the nights from ``root``, with its own output table in the session's
    metastore (the export opens it; the frontend follows the pointers)."""
    for date in dates:
        _copy_night(nights, root, date)
    metastore = {"dir": str(root / "metastore")}
    if jobkit.METASTORE_URL:
        from recsys.spark.metastore import DERBY_CLIENT_JAR

        metastore |= {"url": jobkit.METASTORE_URL, "jars": [DERBY_CLIENT_JAR]}
    conf = root / "serve.yaml"
    conf.write_text(yaml.safe_dump({
        "paths": {"events": str(nights.data / "events"), "catalog": str(nights.data / "catalog"),
                  "output": str(root / "recommendations"), "work": str(root / "work"),
                  "driver_scratch": str(root / "driver")},
        "output": {"table": jobkit.table_name(root), "metastore": metastore},
        "mlflow": {"tracking_uri": nights.store.tracking_uri, "model_name": nights.store.model_name,
                   "artifact_location": str(root / "artifacts")},
        "history": {"window_days": 30},
        "scoring": {"top_n": TOP_N, "chunk_size": 4},
        "serve": {"backend_dir": str(root / "backend"), "refresh_s": 0.5},
        "spark": {"master": "local[2,4]", "conf": {"spark.ui.enabled": "false"}},
    }))
    return conf


def _ids(recs) -> list[int]:
    return [r["item_id"] for r in recs]


def test_lookups_from_the_embedded_index_are_the_published_rows_and_move_to_a_newer_night(nights, tmp_path):
    conf = _serving_root(nights, tmp_path, [EARLIER])
    front = Frontend(tmp_path, conf, free_port())
    try:
        until(front.ready, 120, "the frontend to load the embedded index")
        ready = front.readyz()
        run = nights.manifests[EARLIER]["job_run"]
        assert ready["store"] | {"store": "embedded", "date": str(EARLIER), "version": run, "users": N_USERS,
                                 "up": True} == ready["store"]
        assert ready["on_demand"]["ready"] is False                 # no backend: the lists alone
        for user, row in nights.rows[EARLIER].items():
            answer = front.user(user).json()
            assert answer["recommendations"] == row["recommendations"]      # ids and float32 scores, exactly
            assert (answer["source"], answer["model_version"], answer["served_from"], answer["date"],
                    answer["version"]) == (row["source"], row["model_version"], "embedded", str(EARLIER), run)
        assert len(front.user(1, top_n=2).json()["recommendations"]) == 2
        batch = front.recommend({"user_ids": [3, UNKNOWN_USER, 1]}).json()
        assert [r["user_id"] for r in batch["rows"]] == [3, UNKNOWN_USER, 1]
        unknown = batch["rows"][1]                                  # not in the lists, no backend: the fallback
        fallback = nights.manifests[EARLIER]["fallback"]
        assert unknown["source"] == "popularity" and _ids(unknown["recommendations"]) == fallback["item_ids"][:TOP_N]
        assert batch["served_from"] == "embedded" and batch["lists"]["date"] == str(EARLIER)

        assert front.user(1, top_n=TOP_N + 1).status_code == 400
        assert front.user(2 ** 63).status_code == 400
        fresh = front.user(1, fresh="true")                         # asks for on demand, which is not running
        assert fresh.status_code == 503 and fresh.json()["error"] == "backend_unavailable"
        metrics = front.metrics()
        info = [k for k, v in metrics.items() if k.startswith("recsys_serve_store_info{") and v == 1]
        assert len(info) == 1 and f"date={EARLIER}" in info[0] and "store=embedded" in info[0]
        assert metrics["recsys_serve_store_up"] == 1
        assert metrics["recsys_serve_served_users_total{served_from=embedded}"] >= N_USERS + 4
        assert metrics["recsys_serve_lookup_seconds_count"] >= N_USERS

        _copy_night(nights, tmp_path, RUN_DATE)
        until(lambda: front.readyz()["store"]["date"] == str(RUN_DATE), 60, "the newer night to be loaded")
        for user, row in nights.rows[RUN_DATE].items():
            assert front.user(user).json()["recommendations"] == row["recommendations"]
    finally:
        front.stop()


def _export_cli(spark, monkeypatch, conf: Path, redis_url: str, prefix: str, date) -> int:
    return jobkit.cli(monkeypatch, spark, ["export", "--date", str(date), "--conf", str(conf),
                                           "--set", f"export.redis_url={redis_url}", "--set", f"export.prefix={prefix}"])


class Reader(threading.Thread):
    """Asks for one user (GET) and for every user (POST) in turn, recording when each answer arrived and the
    answer; stops on ``stop`` or after ``limit`` requests (bounded). The arrival, not the start: a request in
    flight when the pointer switches may rightly be answered from either version (lookups that arrive together
    share one Redis call, made when the batch runs)."""

    def __init__(self, url: str, stop: threading.Event, seed: int, limit: int = 20_000):
        super().__init__(daemon=True)
        import httpx

        self.client = httpx.Client(base_url=url, timeout=30)
        self.stop_event, self.limit, self.seed = stop, limit, seed
        self.answers: list[tuple[float, str, list[dict]]] = []   # (arrived, kind, rows with version and date)
        self.errors: list[str] = []

    def run(self) -> None:
        users = list(range(1, N_USERS + 1))
        i = self.seed
        while not self.stop_event.is_set() and len(self.answers) < self.limit:
            i += 1
            if i % 2:
                response = self.client.get(f"/v1/users/{users[i % N_USERS]}/recommendations")
                rows = [response.json()] if response.status_code == 200 else None
                kind = "get"
            else:
                response = self.client.post("/v1/recommendations", json={"user_ids": users})
                rows = None
                if response.status_code == 200:
                    body = response.json()
                    rows = [{**r, "version": body["lists"]["version"]} for r in body["rows"]]
                kind = "post"
            arrived = time.monotonic()
            if rows is None:
                self.errors.append(f"{response.status_code}: {response.text[:300]}")
            else:
                self.answers.append((arrived, kind, rows))
        self.client.close()


def test_a_reader_through_an_export_gets_each_user_s_list_from_one_night_never_a_mix(
        spark, nights, redis_server, tmp_path, monkeypatch):
    conf = _serving_root(nights, tmp_path, [EARLIER, RUN_DATE])
    prefix = f"t{uuid.uuid4().hex[:10]}"
    assert _export_cli(spark, monkeypatch, conf, redis_server.url, prefix, EARLIER) == ExitCode.OK
    # the session's Redis fsyncs every write (to survive the fault tests' kills) while the export writes, on a
    # shared disk: lookups may wait longer than the default 500 ms, which would count the store as down
    front = Frontend(tmp_path, conf, free_port(), (f"serve.store={redis_server.url}", f"export.prefix={prefix}",
                                                   "serve.store_timeout_ms=10000"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RECSYS_PAUSE_AT": "before_switch", "RECSYS_PAUSE_MAX_S": "300",
           "RECSYS_SHUFFLE_PARTITIONS": "4", "PYSPARK_PYTHON": sys.executable}
    exporter = subprocess.Popen([sys.executable, "-m", "recsys.cli", "export", "--date", str(RUN_DATE), "--conf",
                                 str(conf), "--set", f"export.redis_url={redis_server.url}",
                                 "--set", f"export.prefix={prefix}"],
                                env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, errors="replace")
    stop = threading.Event()
    readers = [Reader(front.url, stop, seed) for seed in range(2)]
    try:
        until(front.ready, 120, "the frontend to find the Redis version")
        assert front.readyz()["store"] | {"store": "redis", "version": "v1", "date": str(EARLIER)} == front.readyz()["store"]
        for reader in readers:
            reader.start()
        for line in exporter.stderr:          # every key of v2 written and counted; the pointer not moved yet
            if "recsys-pause: before_switch" in line:
                break
        else:
            pytest.fail("the export ended without reaching before_switch")
        until(lambda: all(len(r.answers) >= 20 for r in readers), 60, "answers while v2 waits for its switch")
        released = time.monotonic()
        os.kill(exporter.pid, signal.SIGUSR1)                      # the switch
        assert exporter.wait(120) == ExitCode.OK
        until(lambda: all(sum(a[2][0]["version"] == "v2" for a in r.answers) >= 20 for r in readers), 60,
              "answers from v2")
    finally:
        stop.set()
        for reader in readers:
            reader.join(60)
        if exporter.poll() is None:
            exporter.kill()
            exporter.wait(30)
        exporter.stderr.close()
    try:
        dates = {"v1": EARLIER, "v2": RUN_DATE}
        for reader in readers:
            assert reader.errors == []
            seen_new = False
            for arrived, kind, rows in reader.answers:
                versions = {row["version"] for row in rows}
                assert len(versions) == 1, f"a {kind} answer mixed versions {versions}"
                version = versions.pop()
                assert version in dates
                if arrived < released:
                    assert version == "v1", "an answer came from v2 before the pointer was switched"
                if seen_new:
                    assert version == "v2", "an answer went back to v1 after v2 was served"
                seen_new = seen_new or version == "v2"
                for row in rows:                                    # and its list is that night's, for that user
                    published = nights.rows[dates[version]][row["user_id"]]
                    assert row["date"] == str(dates[version])
                    assert row["recommendations"] == published["recommendations"]
            assert seen_new

        redis_server.kill()                   # the store down, no backend: 503 with the reason
        try:
            down = front.user(1)
            assert down.status_code == 503 and down.json()["error"] == "store_unavailable"
            assert "Redis at redis://127.0.0.1" in down.json()["detail"] and "on-demand backend" in down.json()["detail"]
            until(lambda: front.client.get("/readyz").status_code == 503, 30, "/readyz to say the store is down")
        finally:
            redis_server.start()
        until(front.ready, 60, "the frontend to find Redis again")
        assert front.user(1).json()["version"] == "v2"
    finally:
        front.stop()
