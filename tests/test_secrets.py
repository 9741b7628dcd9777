"""Secrets the configuration holds are masked by value, wherever and however a library quotes them.

Pattern redaction finds ``user:password@`` after a scheme; libraries do not always quote a URI whole
(pyarrow strips the scheme, a JDBC driver quotes its properties). Each test plants secrets of its
own (a fresh random suffix), so that one test's registered secrets cannot make another's pass.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from recsys import redaction
from recsys.config import load_config
from recsys.errors import ConfigError, ExitCode, first_line

REPO = Path(__file__).resolve().parent.parent


def _secret(name: str) -> str:
    return f"{name}{uuid.uuid4().hex[:12]}"


def test_every_secret_bearing_setting_and_credential_variable_is_collected_and_masked_without_its_scheme():
    s = {k: _secret(k) for k in ("artkey", "artsecret", "trktoken", "trkpw", "sctoken", "redispw", "derbypw",
                                 "awssecret", "awssession", "mlflowpw", "guessed", "envuri")}
    cfg = load_config(overrides=[
        f"mlflow.tracking_uri=https://bob:{s['trkpw']}@mlflow.example.com/?token={s['trktoken']}",
        f"spark.remote=sc://spark.example.com:15002/;token={s['sctoken']}",
        f"export.redis_url=redis://:{s['redispw']}@127.0.0.1:6379/0",
        f"output.metastore.url=jdbc:derby://127.0.0.1:1527/metastore;user=app;password={s['derbypw']}",
    ], environ={"AWS_ACCESS_KEY_ID": s["artkey"], "AWS_SECRET_ACCESS_KEY": s["artsecret"],
                "AWS_SESSION_TOKEN": s["awssession"], "MLFLOW_TRACKING_PASSWORD": s["mlflowpw"],
                "OLD_AWS_SECRET": s["awssecret"], "MY_SERVICE_API_KEY": s["guessed"],   # credentials by their names
                "DATABASE_URL": f"postgresql://app:{s['envuri']}@db/app",               # and in any variable's URI
                "HOME": "/root", "GIT_TOKEN_PATH": "/x/y", "SPARK_REMOTE_TOKEN_FILE": "/run/secrets/token"})
    assert cfg.mlflow.tracking_uri.startswith("https://bob:")     # the setting itself is kept, only its quotes masked
    known = redaction.registered()
    assert set(s.values()) <= known
    assert not {"/root", "/x/y", "/run/secrets/token"} & known     # not secrets: paths named like credentials, or not

    # quoted the way libraries quote them: no scheme, inside other words, percent-encoded, in a traceback
    quotes = [f"Expected an S3 object path of the form 'bucket/key...', got a URI: "
              f"'{s['artkey']}:{s['artsecret']}@bucket/artifacts'",
              f"password={s['derbypw']}; token {s['sctoken']} rejected", f"auth {s['redispw']}x failed",
              f"{s['awssecret']}/{s['awssession']}|{s['mlflowpw']}|{s['guessed']}|{s['envuri']}",
              f"bad header {s['trktoken']}"]
    for quoted in quotes:
        clean = redaction.redact_text(quoted)
        assert not any(v in clean for v in s.values()), clean
        assert "***" in clean
    assert s["artsecret"] not in first_line(ValueError(quotes[0]))


def test_a_short_or_common_value_is_not_masked_everywhere():
    before = redaction.registered()
    redaction.register(["pw", "", "abc"])            # shorter than MIN_SECRET_LENGTH: left to the patterns
    assert redaction.registered() == before
    found = redaction.collect({"paths": {"work": "abfss://container@account.dfs.core.windows.net/w"}},
                              {"SOME_TOKEN_FILE": "true", "PATH": "/usr/bin"})
    assert found == set()                            # a container's name and a flag are not credentials


def test_every_logger_s_records_are_masked_even_through_a_handler_of_its_own(tmp_path):
    """MLflow logs through a handler of its own that does not propagate to the root: records are cleaned
    when they are made, not only by the root's handlers."""
    secret = _secret("libsecret")
    code = f"""
import io, logging
from recsys import redaction
from recsys.logs import configure_logging
configure_logging()
redaction.register([{secret!r}])
stream = io.StringIO()
lib = logging.getLogger("somelib")
lib.addHandler(logging.StreamHandler(stream))
lib.propagate = False
lib.warning("could not reach %s", "bucket/{secret}/x")
try:
    raise RuntimeError("got a URI: 'KEY:{secret}@bucket/catalog'")
except RuntimeError:
    lib.exception("failed")
print(stream.getvalue())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert secret not in out.stdout + out.stderr
    assert "could not reach bucket/***/x" in out.stdout and "RuntimeError: got a URI: 'KEY:***@bucket/catalog'" in out.stdout


@pytest.mark.parametrize("key, uri", [
    ("paths.events", "s3://AKIAEXAMPLE:{secret}@bucket/events?endpoint_override=127.0.0.1:9"),
    ("paths.catalog", "s3a://{secret}@bucket/catalog"),
    ("paths.output", "gs://bucket/out?token={secret}"),
    ("paths.work", "file://bob:{secret}@localhost/tmp/work"),
    ("mlflow.artifact_location", "s3://AKIAEXAMPLE:{secret}@bucket/artifacts"),   # stored in MLflow's own tables
])
def test_a_path_carrying_credentials_is_bad_input_naming_where_credentials_belong(key, uri):
    secret = _secret("pathsecret")
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=[f"{key}={uri.format(secret=secret)}"], environ={})
    message = str(caught.value)
    assert secret not in message and "\n" not in message
    assert f"config key {key!r}" in message and "storage.s3.credentials" in message


def test_the_issue_s_command_exits_2_in_one_line_and_writes_the_secret_nowhere(tmp_path, caplog, capsys):
    from recsys.cli.main import main

    secret = _secret("S3CRET")
    code = main(["recommend", "--date", "2018-09-25", "--force",
                 "--set", f"paths.events=s3://AKIAEXAMPLE:{secret}@bucket/events?endpoint_override=127.0.0.1:9",
                 "--set", f"paths.catalog=s3://AKIAEXAMPLE:{secret}@bucket/catalog?endpoint_override=127.0.0.1:9",
                 "--set", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                 "--set", f"paths.work={tmp_path / 'work'}", "--set", f"paths.output={tmp_path / 'out'}"])
    out = capsys.readouterr()
    assert code == ExitCode.BAD_INPUT
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "storage.s3.credentials" in errors[0].getMessage()
    assert secret not in caplog.text + out.out + out.err
    assert list(tmp_path.iterdir()) == []        # refused before anything was written: no store, no work directory


def test_an_unanswering_spark_connect_server_fails_in_one_line_within_the_wait_without_its_token():
    import socket

    from recsys.errors import SparkUnavailable
    from recsys.spark.session import wait_for_connect_server

    token = _secret("sctoken")
    with socket.socket() as s:                    # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    redaction.register([token])
    with pytest.raises(SparkUnavailable) as caught:
        wait_for_connect_server(f"sc://127.0.0.1:{port}/;token={token}", 0)
    assert token not in str(caught.value) and f"127.0.0.1:{port}" in str(caught.value)
    assert caught.value.exit_code == ExitCode.UNEXPECTED_ERROR
    with socket.socket() as listening:            # a server that answers passes at once
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        wait_for_connect_server(f"sc://127.0.0.1:{listening.getsockname()[1]}", 0)


# ------------------------------------------------------------------------------------------------ end to end


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _everything_written_under(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (the MLflow sqlite file itself, artifacts, manifests, work and scratch
    directories, logs), by path."""
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.spark
@pytest.mark.slow
def test_secrets_planted_in_every_setting_leak_into_no_log_store_artifact_manifest_or_work_directory(
        spark, tmp_path, monkeypatch, caplog, capsys):
    """One unique secret per secret-bearing setting; every failure path that could quote one is driven: a
    night that publishes and records, then fails its export (Redis unreachable); a path with credentials;
    an unreachable tracking server; an unreachable Spark Connect server; a failing on-demand request."""
    import os
    import time

    import httpx

    import jobkit
    from recsys.cli.main import main

    store = jobkit.make_store(tmp_path / "store")
    inputs = jobkit.write_dataset(tmp_path / "data")
    s = {k: _secret(k) for k in ("sqlitetoken", "sctoken", "redispw", "awskey", "awssecret", "mlflowpw", "pathkey",
                                 "pathsecret", "trkpw", "trktoken", "servetoken")}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s["awskey"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s["awssecret"])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", s["mlflowpw"])
    night = tmp_path / "night"
    base = jobkit.recommend_args(night, store, inputs=inputs)
    said: dict[str, str] = {}

    # 1. a night that publishes and records, every secret planted where the job still runs, then fails its export
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(jobkit.RUN_DATE), *base,
        "--set", f"mlflow.tracking_uri={store.tracking_uri}?token={s['sqlitetoken']}",
        "--set", f"spark.remote=sc://127.0.0.1:{_closed_port()}/;token={s['sctoken']}",   # the test's session is used
        "--set", "export.after_publish=true",
        "--set", f"export.redis_url=redis://:{s['redispw']}@127.0.0.1:{_closed_port()}/0",
        "--set", "export.timeout_s=2"])
    assert code == ExitCode.UNEXPECTED_ERROR, caplog.text
    assert (night / "recommendations" / f"dt={jobkit.RUN_DATE}" / "_manifest.json").is_file()   # published, recorded

    # 2. the credentials in a path: refused before anything runs
    code = main(["recommend", "--date", str(jobkit.RUN_DATE), *base, "--set",
                 f"paths.events=s3://{s['pathkey']}:{s['pathsecret']}@bucket/events?endpoint_override=127.0.0.1:9"])
    assert code == ExitCode.BAD_INPUT

    # 3. the tracking server is down (and nothing is remembered under this scratch directory)
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(jobkit.RUN_DATE), *base,
        "--set", f"mlflow.tracking_uri=http://bob:{s['trkpw']}@127.0.0.1:{_closed_port()}/?token={s['trktoken']}",
        "--set", f"paths.driver_scratch={tmp_path / 'other-scratch'}"])
    assert code == ExitCode.UNEXPECTED_ERROR and "cannot resolve" in caplog.text

    # 4. the Spark Connect server is down: the real session builder, which says so in one line
    monkeypatch.undo()    # the real build_session again; the environment's secrets go too, so set them back
    for name, key in (("AWS_ACCESS_KEY_ID", "awskey"), ("AWS_SECRET_ACCESS_KEY", "awssecret"),
                      ("MLFLOW_TRACKING_PASSWORD", "mlflowpw")):
        monkeypatch.setenv(name, s[key])
    monkeypatch.setenv("RECSYS_CONNECT_WAIT_S", "0")
    code = main(["recommend", "--date", str(jobkit.RUN_DATE), *base,
                 "--set", f"spark.remote=sc://127.0.0.1:{_closed_port()}/;token={s['sctoken']}"])
    assert code == ExitCode.UNEXPECTED_ERROR and "does not answer" in caplog.text

    # 5. an on-demand request while the backend is unreachable: the frontend's log and its error bodies
    port = _closed_port()
    serve_log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "recsys.cli", "serve", "--port", str(port), *base,
                             "--set", "serve.store=none", "--set", "output.table=null",
                             "--remote", f"sc://127.0.0.1:{_closed_port()}/;token={s['servetoken']}"],
                            cwd=tmp_path, stdout=open(serve_log, "w"), stderr=subprocess.STDOUT, env={**os.environ})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:   # until the frontend answers and has tried the backend once
                assert proc.poll() is None, serve_log.read_text()
                try:
                    ready = client.get("/readyz").json()
                    if ready["on_demand"]["reason"] != "starting":
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, serve_log.read_text()
                time.sleep(0.2)   # polling a server we do not control
            answer = client.post("/v1/recommendations", json={"user_ids": [1]})
            lookup = client.get("/v1/users/1/recommendations")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert answer.status_code == 503 and lookup.status_code == 503
    assert "does not answer" in answer.json()["detail"]
    said.update(readyz=json.dumps(ready), answer=answer.text, lookup=lookup.text)

    out = capsys.readouterr()
    said.update(log=caplog.text, stdout=out.out, stderr=out.err)
    written = _everything_written_under(tmp_path)
    assert any(name.endswith("mlflow.db") for name in written) and any("_manifest.json" in n for n in written)
    for secret in s.values():
        for spelling in {secret, quote(secret, safe="")}:
            leaks = [where for where, text in said.items() if spelling in text]
            leaks += [where for where, data in written.items() if spelling.encode() in data]
            assert leaks == [], f"{secret!r} leaked into {leaks}"
