"""Every place a configured path is turned into something else, for every kind of location Spark writes.

No cloud needed: the transformations are string and pyarrow work; where pyarrow would reach a store
(S3 without a region asks for the bucket's region), the test captures what pyarrow was asked for.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest

from recsys import fs as rfs
from recsys.config import load_config
from recsys.errors import ConfigError
from recsys.publish import swap
from recsys.publish.publisher import PartitionLayout, check_output_location
from recsys.uris import is_local_path, local_path, pyarrow_uri, scheme, validate_path
from recsys.redaction import redact_uri

REMOTE = {
    "s3": "s3://bucket/recsys/work",
    "s3a": "s3a://bucket/recsys/work",
    "gs": "gs://bucket/recsys/work",
    "abfss": "abfss://container@account.dfs.core.windows.net/recsys/work",
    "hdfs": "hdfs://namenode:8020/recsys/work",
}
PYARROW_SPELLING = {
    "s3": "s3://bucket/recsys/work",
    "s3a": "s3://bucket/recsys/work",
    "gs": "gs://bucket/recsys/work",
    "abfss": "abfss://container@account.dfs.core.windows.net/recsys/work",
    "hdfs": "hdfs://namenode:8020/recsys/work",
}
CONFIG_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", sorted(REMOTE))
def test_a_remote_uri_is_kept_verbatim_by_validation_and_the_config(kind):
    uri = REMOTE[kind]
    assert validate_path(uri) == uri and not is_local_path(uri) and scheme(uri) == kind
    cfg = load_config(overrides=[f"paths.work={uri}", f"paths.output={uri}-out"])
    assert cfg.paths.work == uri and cfg.paths.output == uri + "-out"


def test_relative_and_file_uris_are_local_and_relative_ones_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["paths.work=rel/work", "paths.driver_scratch=rel/driver",
                                 f"paths.output=file://{tmp_path}/out"])
    assert cfg.paths.work == str(tmp_path / "rel" / "work")
    assert cfg.paths.driver_dir == tmp_path / "rel" / "driver"
    assert cfg.paths.output == f"file://{tmp_path}/out"                 # a file:// URI stays a URI ...
    assert is_local_path(cfg.paths.output) and local_path(cfg.paths.output) == tmp_path / "out"   # ... of a local path
    assert is_local_path("rel/x") and local_path("rel/x") == tmp_path / "rel" / "x"
    assert scheme("rel/x") == "" and scheme("file:///x") == "file"


@pytest.mark.parametrize("bad", ["../elsewhere", "a/../../b"])
def test_a_local_path_with_dotdot_is_refused_but_a_uri_is_the_store_s_business(bad):
    with pytest.raises(ValueError, match=r"\.\."):
        validate_path(bad)
    assert validate_path("s3a://bucket/a/../b") == "s3a://bucket/a/../b"


@pytest.mark.parametrize("kind", sorted(REMOTE))
def test_the_driver_scratch_must_be_local_whatever_the_work_uri(kind):
    with pytest.raises(ConfigError, match=r"paths.driver_scratch.*local directory"):
        load_config(overrides=[f"paths.driver_scratch={REMOTE[kind]}"])
    cfg = load_config(overrides=[f"paths.work={REMOTE[kind]}", "paths.driver_scratch=/tmp/recsys-driver"])
    assert cfg.paths.driver_dir == Path("/tmp/recsys-driver")


@pytest.mark.parametrize("kind", sorted(k for k in REMOTE if not k.startswith("s3")))
def test_pyarrow_is_given_its_own_spelling_of_the_uri(kind, monkeypatch):
    assert pyarrow_uri(REMOTE[kind]) == PYARROW_SPELLING[kind]
    asked = []
    fake = SimpleNamespace(FileSystem=SimpleNamespace(from_uri=lambda uri: (asked.append(uri), (None, "p"))[1]))
    monkeypatch.setattr(rfs, "pafs", fake)
    assert rfs.resolve(REMOTE[kind]) == (None, "p")
    assert asked == [PYARROW_SPELLING[kind]]


@pytest.mark.parametrize("uri, path", [
    ("s3a://bucket/recsys/work?region=us-east-1", "bucket/recsys/work"),
    ("gs://bucket/recsys/work", "bucket/recsys/work"),
    ("abfss://container@account.dfs.core.windows.net/recsys/work", "container/recsys/work"),
])
def test_pyarrow_resolves_object_store_uris_without_a_network_call(uri, path):
    fs, inside = rfs.resolve(uri)
    assert inside == path and not isinstance(fs, pafs.LocalFileSystem)


@pytest.mark.parametrize("kind", ["s3", "s3a"])
def test_s3_uris_go_to_the_installed_object_store_with_the_spark_settings_from_the_same_values(kind):
    from recsys import storage

    store = storage.ObjectStore(endpoint="http://127.0.0.1:9", region="eu-west-1", path_style=True,
                                credentials="env", s3_as_s3a=True)
    previous = storage.install(store, environ={})
    try:
        fs, inside = rfs.resolve(REMOTE[kind])
        assert isinstance(fs, pafs.S3FileSystem) and inside == "bucket/recsys/work"
        assert fs.region == "eu-west-1"
    finally:
        storage.install(previous, environ={})
    assert storage.spark_settings(store) == {
        "spark.hadoop.fs.s3a.endpoint": "http://127.0.0.1:9", "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
        "spark.hadoop.fs.s3a.endpoint.region": "eu-west-1", "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.aws.credentials.provider":
            "software.amazon.awssdk.auth.credentials.EnvironmentVariableCredentialsProvider",
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "spark.hadoop.fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A"}
    env: dict[str, str] = {"MLFLOW_S3_ENDPOINT_URL": "http://operator:1"}
    storage.install(store, environ=env)
    storage.install(previous, environ={})
    assert env == {"MLFLOW_S3_ENDPOINT_URL": "http://operator:1", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9",
                   "AWS_DEFAULT_REGION": "eu-west-1"}    # boto3 (MLflow's artifacts): same store; an operator's value wins


def test_one_storage_setting_reaches_every_session_recsys_starts(tmp_path):
    from recsys.spark.session import store_settings

    cfg = load_config(overrides=["storage.s3.endpoint=http://127.0.0.1:9", "storage.s3.path_style=true",
                                 "output.table=null"])
    settings = store_settings(cfg.output, cfg.storage)
    assert settings["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9"
    assert "spark.sql.catalogImplementation" not in settings          # no table: no metastore
    cfg = load_config(overrides=[f"output.metastore.dir={tmp_path}"])
    settings = store_settings(cfg.output, cfg.storage)
    assert settings["spark.sql.catalogImplementation"] == "hive"
    assert settings["spark.sql.warehouse.dir"] == f"{tmp_path}/warehouse"         # never the working directory
    assert settings["spark.hadoop.javax.jdo.option.ConnectionURL"] == \
        f"jdbc:derby:;databaseName={tmp_path}/metastore_db;create=true"
    assert settings["spark.driver.extraJavaOptions"] == f"-Dderby.stream.error.file={tmp_path}/derby.log"


@pytest.mark.parametrize("uri", ["relative/work", "file:///tmp/recsys-uri-test/work", "/tmp/recsys-uri-test/work"])
def test_local_locations_resolve_to_the_local_file_system_with_an_absolute_path(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, inside = rfs.resolve(uri)
    assert isinstance(fs, pafs.LocalFileSystem) and Path(inside).is_absolute()
    assert inside == str(local_path(uri))


@pytest.mark.parametrize("kind", sorted(REMOTE) + ["file", "relative"])
def test_joining_keeps_the_scheme_and_never_doubles_a_slash(kind):
    base = {"file": "file:///data/work", "relative": "data/work"}.get(kind, REMOTE.get(kind))
    joined = rfs.join(base + "/", "runs", "/dt=2024-05-01/", "key")
    assert joined == base + "/runs/dt=2024-05-01/key"
    assert joined.startswith(base) and "//runs" not in joined


@pytest.mark.parametrize("kind, method", [("s3", "copy"), ("s3a", "copy"), ("gs", "copy"), ("abfss", "copy"),
                                          ("hdfs", "rename")])
def test_object_stores_publish_by_copy_and_file_systems_by_rename(kind, method):
    assert swap.method_for(REMOTE[kind]) == method
    assert swap.method_for("relative/out") in ("exchange", "rename")
    assert swap.method_for("file:///tmp/out") in ("exchange", "rename")


@pytest.mark.parametrize("kind", sorted(REMOTE) + ["file"])
def test_the_partition_layout_lives_under_the_output_uri(kind):
    out = {"file": "file:///data/recs"}.get(kind) or REMOTE[kind].replace("work", "recs")
    layout = PartitionLayout(out, dt.date(2024, 5, 1), "run1")
    assert layout.final_dir == out + "/dt=2024-05-01"
    assert layout.staging_dir == layout.run_dir == out + "/_runs/dt=2024-05-01/run=run1"
    assert layout.view_staging_dir == out + "/_staging/dt=2024-05-01/run1"
    assert layout.trash_dir.startswith(out + "/")


@pytest.mark.parametrize("kind", sorted(REMOTE))
def test_an_output_uri_inside_the_work_uri_is_refused(kind):
    work = REMOTE[kind]
    with pytest.raises(ConfigError, match="overlaps paths.work"):
        check_output_location(load_config(overrides=[f"paths.work={work}", f"paths.output={work}/out"]).paths)
    check_output_location(load_config(overrides=[f"paths.work={work}", f"paths.output={work}-out"]).paths)


@pytest.mark.parametrize("kind", sorted(REMOTE))
def test_credentials_in_any_uri_are_redacted(kind):
    uri = REMOTE[kind].replace("://", "://bob:s3cret@", 1) + "?token=abc&sig=xyz"
    clean = redact_uri(uri)
    assert "s3cret" not in clean and "abc" not in clean and "xyz" not in clean
    assert clean.startswith(f"{kind}://***@")


def test_the_remembered_model_resolution_lives_in_the_driver_scratch(tmp_path):
    from recsys.tracking.last_model import memo_path

    assert memo_path(tmp_path, "m", "champion") == str(tmp_path / "models" / "m" / "last-resolved@champion.json")


def test_the_production_example_config_is_valid_as_shipped():
    cfg = load_config(CONFIG_ROOT / "conf" / "production.example.yaml")
    assert cfg.paths.work.startswith("s3") and not is_local_path(cfg.paths.work)
    assert is_local_path(cfg.paths.driver_scratch) and cfg.paths.driver_dir.is_absolute()


def test_redaction_keeps_uris_without_secrets_as_they_were():
    from recsys.redaction import redact_uri

    for uri in ("sqlite:////tmp/x/mlflow.db", "sqlite:///mlflow.db", "s3://bucket/a/b", "file:///tmp/x",
                "http://127.0.0.1:5000"):
        assert redact_uri(uri) == uri
    assert redact_uri("https://user:pw@host:5000/p") == "https://***@host:5000/p"
