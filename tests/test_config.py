import pytest

from recsys.config import load_config, redact_uri
from recsys.errors import ConfigError, ExitCode


def test_embedded_default_loads_without_a_file():
    cfg = load_config()
    assert cfg.scoring.device == "auto"
    assert cfg.mlflow.tracking_uri.startswith("sqlite:///")


def test_file_and_overrides_merge_over_the_default(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("scoring:\n  top_n: 7\nhistory:\n  window_days: 30\n")
    cfg = load_config(conf, ["scoring.top_n=9", "spark.conf.spark.driver.memory=4g"])
    assert cfg.scoring.top_n == 9           # --set wins over the file
    assert cfg.history.window_days == 30    # the file wins over the default
    assert cfg.scoring.chunk_size == load_config().scoring.chunk_size  # untouched keys keep the default
    assert cfg.spark.conf == {"spark.driver.memory": "4g"}


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("scoring.top_n=0", "scoring.top_n"),
        ("scoring.device=tpu", "scoring.device"),
        ("scoring.topn=5", "scoring.topn"),
        ("history.window_days=abc", "history.window_days"),
        ("paths.output=../elsewhere", "paths.output"),
        ("nonsense", "key=value"),
    ],
)
def test_invalid_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")) as info:
        load_config(overrides=[override])
    assert info.value.exit_code == ExitCode.BAD_INPUT


def test_unknown_key_in_file_is_rejected(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("scoring:\n  chunksize: 5\n")
    with pytest.raises(ConfigError, match="scoring.chunksize"):
        load_config(conf)


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_digest_changes_with_output_shaping_settings():
    assert load_config().digest() != load_config(overrides=["scoring.top_n=21"]).digest()
    assert load_config().digest() == load_config().digest()


def test_credentials_are_redacted_from_uris():
    assert redact_uri("https://bob:s3cret@mlflow.example.com/path?token=abc&x=1") == \
        "https://***@mlflow.example.com/path?token=***&x=1"
    cfg = load_config(overrides=["mlflow.tracking_uri=https://bob:s3cret@mlflow.example.com"])
    assert "s3cret" not in str(cfg.redacted_dict())
