"""On demand end to end: a real Spark Connect backend (`recsys backend start`) and the real frontend
(`recsys serve`, a subprocess) on loopback, free ports, both stopped however the tests end.

One backend per module (starting one costs 20-40 s here); it is killed and started again once, by
the fault test. The frontend's config makes queueing observable without sleeps: requests wait up
to ``max_wait_ms`` = 2.5 s for company, so a test can see them queued (``/metrics``) and act while
they are; jobs take at most ``max_batch_users`` = 10 users, the queue holds at most 24. The queue-full
test, which must act while a request is still queued, starts a frontend of its own that waits 60 s.
"""
from __future__ import annotations

import datetime as dt
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import jobkit
from jobkit import N_USERS, RUN_DATE, TOP_N, catalog_table, make_store, write_dataset
from servekit import Frontend, until as _until

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from recsys.config import load_config  # noqa: E402
from recsys.data.contracts import EVENTS_SCHEMA, write_partition  # noqa: E402
from recsys.processes import free_port  # noqa: E402
from recsys.serve import backend  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

MAX_WAIT_MS, MAX_BATCH, MAX_QUEUE = 2500, 10, 24
UNKNOWN_USER = 10 ** 12


def _output_section(root):
    """The default output.table, on the test session's metastore service: the backend's JVM and the tests'."""
    from recsys.spark.metastore import DERBY_CLIENT_JAR

    section = {"table": jobkit.table_name(root), "metastore": {"dir": str(root / "metastore")}}
    if jobkit.METASTORE_URL:
        section["metastore"].update(url=jobkit.METASTORE_URL, jars=[DERBY_CLIENT_JAR])
    return section


@pytest.fixture(scope="module")
def stack(tmp_path_factory, metastore_service):
    root = tmp_path_factory.mktemp("serve")
    from recsys.model.repeats import RepeatBlend

    # new items' popularity prior on: a request must rank them by the same last day's counts as the night did
    store = make_store(root, blend=RepeatBlend(popularity_weight=0.5))
    write_dataset(root)
    conf = root / "serve.yaml"
    conf.write_text(yaml.safe_dump({
        "paths": {"events": str(root / "events"), "catalog": str(root / "catalog"),
                  "output": str(root / "recommendations"), "work": str(root / "work")},
        "mlflow": {"tracking_uri": store.tracking_uri, "model_name": store.model_name,
                   "artifact_location": str(root / "artifacts")},
        "history": {"window_days": 30},
        "scoring": {"top_n": TOP_N, "chunk_size": 4},
        "output": _output_section(root),
        "serve": {"backend_dir": str(root / "backend"), "as_of": str(RUN_DATE), "max_wait_ms": MAX_WAIT_MS,
                  "max_batch_users": MAX_BATCH, "max_concurrent_jobs": 2, "max_queue_users": MAX_QUEUE,
                  "max_request_users": 30, "request_timeout_s": 120, "backend_timeout_s": 2, "refresh_s": 2,
                  "store": "none"},      # every request on demand; lists first: test_serve_lists.py and below
        "spark": {"master": "local[2]", "conf": {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4",
                                                 "spark.driver.memory": "1g"}},
    }))
    cfg = load_config(conf)
    front = None
    try:
        backend.start(cfg, properties_file=None)
        front = Frontend(root, conf, free_port())
        _until(front.ready, 600, "the frontend to be ready")
        yield {"root": root, "cfg": cfg, "front": front, "store": store}
    finally:
        if front is not None:
            front.stop()
        backend.stop(cfg)


def _job_count(front: Frontend) -> float:
    return front.metrics().get('recsys_serve_spark_jobs_total{outcome=ok}', 0.0)


def test_bad_requests_get_400_naming_the_field(stack):
    front = stack["front"]
    before = front.metrics().get("recsys_serve_errors_total{reason=bad_request}", 0)
    cases = {
        "not json": ("the body is not valid JSON", "{user_ids: [1]"),
        "not an object": ("must be a JSON object", [1, 2]),
        "missing ids": ("user_ids is required", {"top_n": 3}),
        "string id": ("user_ids.0", {"user_ids": ["1"]}),
        "float id": ("user_ids.1", {"user_ids": [1, 2.5]}),
        "boolean id": ("user_ids.0", {"user_ids": [True]}),
        "id beyond 64 bits": ("user_ids[0]", {"user_ids": [2 ** 64]}),
        "no ids": ("at least one id", {"user_ids": []}),
        "too many ids": ("serve.max_request_users=30", {"user_ids": list(range(31))}),
        "top_n zero": ("top_n", {"user_ids": [1], "top_n": 0}),
        "top_n too large": ("top_n", {"user_ids": [1], "top_n": TOP_N + 1}),
        "unknown field": ("sql is not a known field", {"user_ids": [1], "sql": "DROP TABLE x"}),
    }
    for name, (expected, body) in cases.items():
        response = front.recommend(body)
        assert response.status_code == 400, (name, response.text)
        assert expected in response.json()["detail"], (name, response.text)
    after = front.metrics()["recsys_serve_errors_total{reason=bad_request}"]
    assert after - before == len(cases)
    assert front.client.get("/healthz").json() == {"status": "ok"}


def test_concurrent_requests_are_coalesced_into_one_spark_job(stack):
    front = stack["front"]
    jobs_before = _job_count(front)
    users = [1, 2, 3, 4, UNKNOWN_USER]
    with ThreadPoolExecutor(len(users)) as pool:
        responses = list(pool.map(lambda u: front.recommend({"user_ids": [u], "top_n": 3}), users))
    assert [r.status_code for r in responses] == [200] * len(users), [r.text for r in responses]
    assert _job_count(front) - jobs_before == 1
    rows = {r.json()["rows"][0]["user_id"]: r.json()["rows"][0] for r in responses}
    assert all(len(row["recommendations"]) == 3 for row in rows.values())
    assert rows[1]["source"] == "model"
    assert rows[UNKNOWN_USER]["source"] == "popularity"   # unknown users get the fallback, marked
    metrics = front.metrics()
    assert metrics["recsys_serve_batch_requests_bucket{le=5.0}"] >= 1


def test_a_request_for_users_the_nightly_job_scored_returns_the_same_lists(stack):
    """/v1/jobs runs the nightly job on the backend; /v1/recommendations for all its users, split into
    jobs of max_batch_users, answers in request order with the published rows."""
    front, cfg = stack["front"], stack["cfg"]
    submitted = front.client.post("/v1/jobs", json={"date": str(RUN_DATE)})
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    state = _until(lambda: (s := front.client.get(f"/v1/jobs/{job_id}").json())["state"] in ("succeeded", "failed")
                   and s, 600, "the nightly job")
    assert state["state"] == "succeeded" and state["exit_code"] == 0, state
    published = pq.read_table(Path(cfg.paths.output) / f"dt={RUN_DATE}").to_pylist()
    assert state["published"] == [str(Path(cfg.paths.output) / f"dt={RUN_DATE}")]
    nightly = {row["user_id"]: row for row in published}
    assert len(nightly) == N_USERS

    jobs_before = _job_count(front)
    order = sorted(nightly, reverse=True)              # answers follow the request's order
    response = front.recommend({"user_ids": order})
    assert response.status_code == 200, response.text
    rows = response.json()["rows"]
    assert [r["user_id"] for r in rows] == order
    assert _job_count(front) - jobs_before == -(-N_USERS // MAX_BATCH)   # split: 10 + 10 + 4 users
    for row in rows:
        expected = nightly[row["user_id"]]
        assert [r["item_id"] for r in row["recommendations"]] == [r["item_id"] for r in expected["recommendations"]]
        assert [r["score"] for r in row["recommendations"]] == pytest.approx(
            [r["score"] for r in expected["recommendations"]], rel=1e-5, abs=1e-6)
        assert (row["source"], row["model_version"]) == (expected["source"], expected["model_version"])
    assert response.json()["model_version"] == stack["store"].version


def test_with_a_store_listed_users_come_from_it_and_the_backend_answers_the_rest(stack, spark, redis_server):
    """serve.store=Redis on the same backend: listed users from Redis; unknown users, fresh requests and, while
    Redis is down, every user on demand (and /readyz stays ready, saying the store is down)."""
    import uuid

    from recsys.pipelines.export import run_export

    front, cfg, root = stack["front"], stack["cfg"], stack["root"]
    submitted = front.client.post("/v1/jobs", json={"date": str(RUN_DATE)}).json()   # skipped if published above
    assert _until(lambda: (s := front.client.get(f"/v1/jobs/{submitted['id']}").json())["state"] in
                  ("succeeded", "failed") and s, 600, "the nightly job")["exit_code"] == 0
    prefix = f"t{uuid.uuid4().hex[:10]}"
    exporting = load_config(root / "serve.yaml", [f"export.redis_url={redis_server.url}", f"export.prefix={prefix}"])
    assert run_export(spark, exporting, RUN_DATE).version == "v1"
    published = {r["user_id"]: r for r in pq.read_table(Path(cfg.paths.output) / f"dt={RUN_DATE}").to_pylist()}
    listed = Frontend(root, root / "serve.yaml", free_port(),
                      (f"serve.store={redis_server.url}", f"export.prefix={prefix}", "serve.max_wait_ms=20"))
    try:
        _until(lambda: listed.ready() and listed.readyz()["on_demand"]["ready"], 300, "the store and the backend")
        one = listed.user(1).json()
        assert (one["served_from"], one["version"], one["date"]) == ("redis", "v1", str(RUN_DATE))
        assert one["recommendations"] == published[1]["recommendations"]
        unknown = listed.user(UNKNOWN_USER).json()
        assert unknown["served_from"] == "on_demand" and unknown["source"] == "popularity" and unknown["version"] is None
        fresh = listed.user(1, fresh="true").json()
        assert fresh["served_from"] == "on_demand"
        assert [r["item_id"] for r in fresh["recommendations"]] == [r["item_id"] for r in published[1]["recommendations"]]
        mixed = listed.recommend({"user_ids": [1, UNKNOWN_USER]}).json()
        assert mixed["served_from"] == "mixed" and [r["served_from"] for r in mixed["rows"]] == ["redis", "on_demand"]
        redis_server.kill()
        try:
            down = listed.user(1)
            assert down.status_code == 200 and down.json()["served_from"] == "on_demand"
            ready = listed.readyz()
            assert ready["ready"] is True and ready["store"]["up"] is False and "unavailable" in ready["store"]["reason"]
        finally:
            redis_server.start()
        _until(lambda: listed.user(1).json()["served_from"] == "redis", 60, "lookups from Redis again")
        metrics = listed.metrics()
        assert metrics["recsys_serve_served_users_total{served_from=on_demand}"] >= 4
        assert metrics["recsys_serve_store_errors_total"] >= 1
    finally:
        listed.stop()


def test_todays_events_count_for_users_the_window_does_not_know(stack):
    """A user who signed up today: no row in the nightly partition, a model row on demand."""
    front, root = stack["front"], stack["root"]
    newcomer = 5000
    first = front.recommend({"user_ids": [newcomer]})
    assert first.json()["rows"][0]["source"] == "popularity"
    events = pa.Table.from_pylist([dict(user_id=newcomer, item_id=i, event_type="view",
                                        ts=dt.datetime(2024, 5, 8, 9, i, tzinfo=dt.timezone.utc)) for i in (3, 4, 5)],
                                  schema=EVENTS_SCHEMA)
    write_partition(events, root / "events", RUN_DATE)
    row = _until(lambda: (r := front.recommend({"user_ids": [newcomer]}).json()["rows"][0])["source"] == "model"
                 and r, 60, "today's partition to be picked up")
    assert not {3, 4, 5} & {r["item_id"] for r in row["recommendations"]}   # seen today: not recommended


def test_a_failed_batch_answers_500_to_its_requests_and_the_next_batch_runs(stack):
    """An unreadable file in today's partition fails the batches that read it, and only them."""
    front, root = stack["front"], stack["root"]
    bad = root / "events" / f"dt={RUN_DATE}" / "zz-upload-in-progress.parquet"
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"not parquet")
    try:
        def failed_together():
            with ThreadPoolExecutor(2) as pool:
                responses = list(pool.map(front.recommend, [{"user_ids": [1]}, {"user_ids": [2]}]))
            return [r.status_code for r in responses] == [500, 500] and responses
        before = front.metrics().get("recsys_serve_errors_total{reason=batch_failed}", 0)
        responses = _until(failed_together, 60, "a batch reading the bad file")
        assert "zz-upload-in-progress.parquet" in responses[0].json()["detail"]
        assert front.metrics()["recsys_serve_errors_total{reason=batch_failed}"] - before >= 2
        assert front.client.get("/readyz").status_code == 200         # the backend is fine
    finally:
        bad.unlink()
    assert front.recommend({"user_ids": [1]}).status_code == 200     # the next batch runs


def test_a_moved_alias_and_a_new_catalog_snapshot_reach_the_next_batches(stack):
    front, root, store = stack["front"], stack["root"], stack["store"]
    users = list(range(1, N_USERS + 1))
    before = front.recommend({"user_ids": users}).json()
    recommended = sorted({r["item_id"] for row in before["rows"] for r in row["recommendations"]})
    gone = recommended[:3]
    write_partition(catalog_table(unavailable=gone), root / "catalog", dt.date(2024, 5, 6))
    version = jobkit.register_version(store.tracking_uri, store.model_name, store.model_dir)

    after = _until(lambda: (a := front.recommend({"user_ids": users}).json())["catalog_snapshot"] == "2024-05-06"
                   and a["model_version"] == version and a, 60, "the new snapshot and version")
    assert not set(gone) & {r["item_id"] for row in after["rows"] for r in row["recommendations"]}
    assert {row["model_version"] for row in after["rows"]} == {version}


def test_a_full_queue_answers_429_with_retry_after(stack):
    """A request that would take the queue past max_queue_users is refused at once; the queued one is unaffected.

    On a frontend of its own whose batches wait up to 60 s for company: with the module's 2.5 s, a loaded
    machine could dispatch the queued request before the test, having seen it queued, sends the next one.
    Here the queued users stay until the test sends the user that fills their batch.
    """
    root = stack["root"]
    conf = yaml.safe_load((root / "serve.yaml").read_text())
    conf["serve"]["max_wait_ms"] = 60_000
    patient_conf = root / "serve-patient.yaml"
    patient_conf.write_text(yaml.safe_dump(conf))
    front = Frontend(root, patient_conf, free_port())
    pool = ThreadPoolExecutor(1)
    try:
        _until(front.ready, 180, "the patient frontend to be ready")
        waiting = pool.submit(front.recommend, {"user_ids": list(range(1, MAX_BATCH))})   # 9 users wait for company
        _until(lambda: front.metrics()["recsys_serve_queue_users"] == MAX_BATCH - 1, 30, "the first request to queue")
        refused = front.recommend({"user_ids": list(range(100, 100 + MAX_QUEUE - MAX_BATCH + 2))})   # 16: 25 > 24
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert front.metrics()["recsys_serve_queue_users"] == MAX_BATCH - 1   # refused at once, the queue as it was
        filler = front.recommend({"user_ids": [MAX_BATCH]})                  # the 10th user: a full batch runs now
        assert filler.status_code == 200, filler.text
        assert waiting.result(timeout=120).status_code == 200                # the queued request is unaffected
        assert front.metrics()["recsys_serve_errors_total{reason=queue_full}"] == 1
    finally:
        front.stop()
        pool.shutdown(wait=True)


def test_a_request_past_its_deadline_gets_504_and_leaves_the_queue(stack):
    front = stack["front"]
    jobs_before = _job_count(front)
    response = front.recommend({"user_ids": [5], "timeout_ms": 300})   # the batch waits 2.5 s for company
    assert response.status_code == 504, response.text
    metrics = front.metrics()
    assert metrics["recsys_serve_queue_users"] == 0
    assert metrics["recsys_serve_errors_total{reason=deadline}"] >= 1
    assert _job_count(front) == jobs_before


def test_metrics_and_openapi_describe_the_service(stack):
    front = stack["front"]
    text = front.client.get("/metrics").text
    for name in ("recsys_serve_queue_users", "recsys_serve_queue_requests", "recsys_serve_wait_seconds_bucket",
                 "recsys_serve_batch_users_bucket", "recsys_serve_requests_total", "recsys_serve_users_total",
                 "recsys_serve_errors_total", "recsys_serve_spark_jobs_in_flight", "recsys_backend_model_cache_hits_total",
                 "recsys_backend_model_cache_misses_total", "recsys_backend_model_load_seconds_total",
                 "recsys_serve_requests_per_second", "recsys_serve_users_per_second", "recsys_serve_ready"):
        assert name in text, name
    metrics = front.metrics()
    assert metrics["recsys_backend_model_cache_misses_total"] >= 1     # the warm-up loaded the model
    assert metrics["recsys_backend_model_cache_hits_total"] >= 1       # and later jobs found it
    paths = front.client.get("/openapi.json").json()["paths"]
    assert {"/v1/recommendations", "/v1/jobs", "/v1/jobs/{job_id}", "/metrics", "/healthz", "/readyz"} <= set(paths)
    body = paths["/v1/recommendations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "user_ids" in body["properties"]


def test_a_dtype_the_executors_refuse_keeps_the_frontend_not_ready_and_says_why(stack):
    """float16 on CPU executors: every job would fail, so the frontend never turns ready; /readyz and
    requests name the setting, not a Spark stack trace. The other frontend is not affected."""
    root = stack["root"]
    conf = yaml.safe_load((root / "serve.yaml").read_text())
    conf["scoring"].update({"dtype": "float16", "device": "cpu"})
    bad_conf = root / "serve-float16.yaml"
    bad_conf.write_text(yaml.safe_dump(conf))
    bad = Frontend(root, bad_conf, free_port())
    try:
        def refused() -> str:
            try:
                response = bad.client.get("/readyz")
            except httpx.TransportError:
                return ""
            reason = response.json().get("reason", "")
            return reason if "refused" in reason else ""
        reason = _until(refused, 180, "the float16 frontend to report the executors' refusal")
        assert reason.startswith("the executors refused scoring.dtype=float16: scoring.dtype=float16 is for CUDA")
        assert bad.client.get("/readyz").status_code == 503
        response = bad.recommend({"user_ids": [1]})
        assert response.status_code == 503 and "refused scoring.dtype=float16" in response.json()["detail"]
    finally:
        bad.stop()
    assert stack["front"].recommend({"user_ids": [1]}).status_code == 200


def test_backend_killed_then_restarted(stack):
    """In-flight requests fail fast with 503, /readyz turns false, the frontend reconnects by itself."""
    front, cfg = stack["front"], stack["cfg"]
    in_flight = ThreadPoolExecutor(1).submit(front.recommend, {"user_ids": [1]})
    _until(lambda: front.metrics()["recsys_serve_queue_requests"] == 1, 30, "a queued request")
    state = backend.read_state(cfg.serve.backend_dir)
    os.kill(state.pid, signal.SIGKILL)
    started = time.monotonic()
    response = in_flight.result(timeout=60)
    assert response.status_code == 503, response.text
    assert time.monotonic() - started < 30
    _until(lambda: front.client.get("/readyz").status_code == 503, 30, "/readyz to turn false")
    refused = front.recommend({"user_ids": [1]})
    assert refused.status_code == 503 and "backend" in refused.json()["detail"]
    assert front.metrics()["recsys_serve_errors_total{reason=backend_unavailable}"] >= 2

    backend.stop(cfg)      # clears the dead server's state
    backend.start(cfg, properties_file=None)
    _until(front.ready, 600, "the frontend to reconnect")
    again = front.recommend({"user_ids": [1, 2]})
    assert again.status_code == 200, again.text
    assert front.metrics()["recsys_serve_backend_reconnects_total"] >= 2


def test_sigterm_stops_accepting_and_drains_the_queue(stack):
    front = stack["front"]
    with ThreadPoolExecutor(3) as pool:
        queued = [pool.submit(front.recommend, {"user_ids": [u]}) for u in (1, 2, 3)]
        _until(lambda: front.metrics()["recsys_serve_queue_requests"] == 3, 30, "three queued requests")
        front.proc.send_signal(signal.SIGTERM)
        assert [f.result(timeout=120).status_code for f in queued] == [200, 200, 200]
    assert front.proc.wait(60) in (0, -signal.SIGTERM)   # uvicorn exits by re-raising the signal it handled
    assert "stopped" in front.tail()                        # after the lifespan's drain, not killed mid-way
    with pytest.raises(httpx.TransportError):
        front.client.get("/healthz")
