"""Credentials in configured URIs never reach a log line, MLflow (params, tags, artifacts), a manifest or stdout.

Each test feeds URIs holding a user, a password and a token query parameter through one way out of
the job and looks for the secrets in everything that came out. The Spark tests run the real CLI on
the shared session, so logging is set up as in production (``configure_logging``).
"""
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobkit
from jobkit import RUN_DATE
from recsys.config import load_config
from recsys.errors import ExitCode
from recsys.processes import free_port

REPO = Path(__file__).resolve().parent.parent
PART = f"dt={RUN_DATE}"
SECRETS = ("s3cret", "t0ken")


def _secret_free(text: str | bytes, where: str) -> None:
    data = text if isinstance(text, bytes) else text.encode()
    for secret in SECRETS:
        assert secret.encode() not in data, f"{secret!r} leaked into {where}"


def _everything_in_mlflow(tracking_uri: str, run_id: str, tmp: Path) -> dict[str, bytes]:
    """Params, tags and every artifact (recursively) of a run, by where they were found."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    found = {"params": json.dumps(run.data.params).encode(), "tags": json.dumps(run.data.tags).encode()}
    pending = [""]
    while pending:
        for info in client.list_artifacts(run_id, pending.pop() or None):
            if info.is_dir:
                pending.append(info.path)
            else:
                found[f"artifact {info.path}"] = Path(client.download_artifacts(run_id, info.path, str(tmp))).read_bytes()
    return found


# ------------------------------------------------------------------------------------------------ no Spark


def test_the_run_recorder_redacts_every_param_tag_and_artifact_it_is_given(tmp_path):
    from recsys.tracking import store as tracking

    uri = "s3://bob:s3cret@bucket/recommendations?token=t0ken"
    cfg = load_config(overrides=[f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                 f"mlflow.artifact_location={tmp_path / 'artifacts'}"])
    recorder = tracking.RunRecorder(cfg.mlflow, run_name="redaction")
    recorder.log_params({"output": uri, "nested": {"uri": uri}})
    recorder.set_tags({"recsys.output": uri, "recsys.error": f"InputDataError: events path {uri!r} does not exist"})
    recorder.log_dict({"where": uri, "list": [uri], uri: 1}, "doc.json")
    recorder.log_text(f"read {uri}\n", "notes.txt")
    recorder.end()
    assert not recorder.failed, recorder.error
    found = _everything_in_mlflow(cfg.mlflow.tracking_uri, recorder.run_id, tmp_path / "dl")
    assert {"params", "tags", "artifact doc.json", "artifact notes.txt"} <= set(found)
    for where, data in found.items():
        _secret_free(data, where)
    assert b"s3://***@bucket/recommendations?token=***" in found["tags"]   # redacted, not dropped


def test_the_demo_summary_prints_neither_credentials_nor_missing_titles(tmp_path, capsys):
    from recsys.cli.demo import _show
    from recsys.publish.manifest import Manifest

    catalog = tmp_path / "catalog" / "dt=2024-05-01"
    catalog.mkdir(parents=True)
    pq.write_table(pa.table({"item_id": pa.array([1, 2], pa.int64()), "available": [True, True],
                             "title": ["Toy Story (1995)", "Heat (1995)"]}), catalog / "part-0.parquet")
    out = tmp_path / "recommendations" / "dt=2024-05-08"
    out.mkdir(parents=True)
    recs = [[{"item_id": 2, "score": 0.9}, {"item_id": 1, "score": 0.5}]]
    pq.write_table(pa.table({"user_id": [7], "recommendations": recs, "source": ["model"]}), out / "part-0.parquet")
    cfg = load_config(overrides=[f"paths.catalog={tmp_path / 'catalog'}",
                                 "mlflow.tracking_uri=https://bob:s3cret@mlflow.example.com/?token=t0ken"])
    result = SimpleNamespace(output_dir=str(out), date=dt.date(2024, 5, 8), run_id="r1",
                             manifest=Manifest.from_dict({"catalog_snapshot": "2024-05-01", "model": {"version": "3"},
                                                          "counts": {"rows": 1, "model_users": 1, "fallback_users": 0}}))
    _show(cfg, result, SimpleNamespace(summary=lambda: "trained"))
    printed = capsys.readouterr().out
    _secret_free(printed, "the demo's stdout")
    assert "--backend-store-uri https://***@mlflow.example.com/?token=***" in printed
    assert "1. Heat (1995)  (item 2" in printed and "2. Toy Story (1995)  (item 1" in printed

    # a URI without credentials is printed as it is, so the command can be pasted
    _show(load_config(overrides=[f"paths.catalog={tmp_path / 'catalog'}"]), result, SimpleNamespace(summary=lambda: "t"))
    assert "--backend-store-uri sqlite:///.recsys/mlflow.db --port" in capsys.readouterr().out

    # a catalog whose titles cannot be read is an error, not a silent list of "?"
    (catalog / "part-0.parquet").write_bytes(b"not parquet")
    with pytest.raises(pa.ArrowInvalid, match=r"dt=2024-05-01/part-0\.parquet.*Parquet magic bytes not found"):
        _show(cfg, result, SimpleNamespace(summary=lambda: "trained"))


def test_importing_the_package_leaves_the_environment_alone():
    code = ("import os, json; before = dict(os.environ)\n"
            "import recsys.tracking.store, recsys.pipelines.nightly, recsys.pipelines.nightly_stages, recsys.cli.main, recsys.spark.session\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_")}
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


# ------------------------------------------------------------------------------------------------ the job


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    store = jobkit.make_store(tmp_path_factory.mktemp("store"))
    return SimpleNamespace(store=store, inputs=jobkit.write_dataset(tmp_path_factory.mktemp("data")))


def _secret_tracking_uri(store: jobkit.Store) -> str:
    return f"{store.tracking_uri}?token=t0ken"   # sqlite URLs accept query options: a tracked run still works


@pytest.mark.spark
@pytest.mark.slow
def test_a_published_run_keeps_credentials_out_of_logs_mlflow_the_manifest_and_stdout(
        spark, data, tmp_path, monkeypatch, caplog, capsys):
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE), *jobkit.recommend_args(
        tmp_path, data.store, f"mlflow.tracking_uri={_secret_tracking_uri(data.store)}",
        "export.redis_url=redis://:s3cret@127.0.0.1:6379/0", "mlflow.experiment=redaction",
        "spark.remote=sc://bob:s3cret@spark.example.com:15002/;token=t0ken", inputs=data.inputs)])
    captured = capsys.readouterr()
    assert code == ExitCode.OK, caplog.text
    manifest_text = (tmp_path / "recommendations" / PART / "_manifest.json").read_text()
    run_id = json.loads(manifest_text)["run_id"]
    found = _everything_in_mlflow(data.store.tracking_uri, run_id, tmp_path / "dl")
    assert {"artifact manifest.json", "artifact config.yaml"} <= set(found)
    assert json.loads(found["artifact manifest.json"]) == json.loads(manifest_text)   # the published copy, unchanged
    for where, text in {**found, "the manifest": manifest_text, "the log": caplog.text, "stdout": captured.out,
                        "stderr": captured.err}.items():
        _secret_free(text, where)
    assert "?token=***" in json.loads(manifest_text)["tracking"]["uri"]
    assert b"sc://***@spark.example.com" in found["artifact config.yaml"]


@pytest.mark.spark
@pytest.mark.slow
def test_an_unreachable_tracking_server_s_credentials_stay_out_of_the_manifest_and_logs(
        spark, data, tmp_path, monkeypatch, caplog, capsys):
    from recsys.tracking.last_model import remember
    from recsys.tracking.store import ResolvedModel

    store = data.store
    port = free_port()
    uri = f"http://bob:s3cret@127.0.0.1:{port}/?token=t0ken"
    remember(str(tmp_path / "driver"),   # jobkit's paths.driver_scratch: where the job looks
             ResolvedModel(store.model_name, "champion", store.version, None, str(store.model_dir), store.model_dir),
             uri)                        # as a night that resolved it through this server left it
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE), *jobkit.recommend_args(
        tmp_path, store, f"mlflow.tracking_uri={uri}", inputs=data.inputs)])
    captured = capsys.readouterr()
    assert code == ExitCode.TRACKING_FAILED, caplog.text
    manifest_text = (tmp_path / "recommendations" / PART / "_manifest.json").read_text()
    for where, text in {"the manifest": manifest_text, "the log": caplog.text, "stdout": captured.out,
                        "stderr": captured.err}.items():
        _secret_free(text, where)
    assert json.loads(manifest_text)["tracking"]["uri"] == f"http://***@127.0.0.1:{port}/?token=***"
