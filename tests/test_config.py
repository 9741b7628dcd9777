import pytest

from recsys.config import load_config
from recsys.redaction import redact_uri
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
        ("train.repeats.popularity_weights=[0, -1]", "train.repeats.popularity_weights"),
        ("train.repeats.popularity_weights=[]", "train.repeats.popularity_weights"),
        ("train.repeats.objective=recall_at_10", "train.repeats.objective"),
        ("train.repeats.item_to_item.weights=[0, 0]", "train.repeats.item_to_item.weights"),
        ("train.repeats.item_to_item.max_items=1", "train.repeats.item_to_item.max_items"),
        ("train.repeats.item_to_item.l2=0", "train.repeats.item_to_item.l2"),
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


def test_each_model_type_has_its_own_typed_section_and_the_type_picks_one():
    from recsys.model.registry import MODEL_TYPES
    from recsys.learning.settings import model_config

    cfg = load_config(overrides=["train.model.type=gru4rec", "train.model.gru4rec.dim=32"])
    assert set(MODEL_TYPES) == set(type(cfg.train.model).model_fields) - {"type"}   # one section per type
    built = model_config(cfg.train.model, num_items=5)
    assert type(built).__name__ == "GRU4RecConfig" and built.dim == 32
    assert type(model_config(cfg.train.model, 5, "sasrec")).__name__ == "SASRecConfig"
    with pytest.raises(ConfigError, match="train.model.type"):
        load_config(overrides=["train.model.type=bert4rec"])
    with pytest.raises(ConfigError, match="train.model.gru4rec.heads"):
        load_config(overrides=["train.model.gru4rec.heads=2"])   # no heads in a GRU


def test_a_moved_model_key_says_where_it_lives_now(tmp_path):
    with pytest.raises(ConfigError, match=r"'train.model.dim'.*moved to train.model.<type>.dim"):
        load_config(overrides=["train.model.dim=32"])
    conf = tmp_path / "old.yaml"
    conf.write_text("train:\n  model:\n    heads: 4\n")
    with pytest.raises(ConfigError, match="moved to train.model.<type>.heads"):
        load_config(conf)


def test_the_progress_interval_is_validated_and_leaves_the_digest_alone():
    assert load_config().progress.interval_s == 30
    assert load_config(overrides=["progress.interval_s=5"]).digest() == load_config().digest()
    with pytest.raises(ConfigError, match="progress.interval_s"):
        load_config(overrides=["progress.interval_s=-1"])


def test_model_hyperparameters_follow_the_model_s_own_rules_when_the_config_is_loaded():
    # one definition (recsys.model.configs): what the model would refuse at training time, the config refuses now
    with pytest.raises(ConfigError, match=r"train\.model\.sasrec.*dim \(10\) must be a multiple of heads \(3\)"):
        load_config(overrides=["train.model.sasrec.dim=10", "train.model.sasrec.heads=3"])
    with pytest.raises(ConfigError, match=r"train\.model\.gru4rec.*layers must be at most 8"):
        load_config(overrides=["train.model.gru4rec.layers=9"])
    assert load_config(overrides=["train.model.sasrec.dim=12", "train.model.sasrec.heads=3"]).train.model.sasrec.dim == 12


def test_model_types_and_their_sections_come_from_the_one_registry():
    import dataclasses
    import typing

    from recsys.config import EVALUATION_MODELS, ModelConfig, ModelType
    from recsys.model.configs import MODEL_CONFIGS
    from recsys.model.registry import MODEL_TYPES

    assert set(typing.get_args(ModelType)) == set(MODEL_CONFIGS) == set(MODEL_TYPES)
    assert set(EVALUATION_MODELS) == {"popularity", "als", *MODEL_CONFIGS}
    for name, config_cls in MODEL_CONFIGS.items():
        section = ModelConfig.model_fields[name].annotation
        model_fields = {f.name for f in dataclasses.fields(config_cls)} - {"num_items"}
        assert set(section.model_fields) == model_fields, name


# --- one home for defaults: recsys/default.yaml (docs/architecture.md) -----------------------------------------

def _class_keys(model, prefix=""):
    """(dotted key, field) of every setting the configuration classes define, sections walked into."""
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _class_keys(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def _yaml_keys(data, prefix=""):
    """Dotted keys of the embedded default; open sections (names the user chooses, spark.conf) count as one key."""
    from recsys.config import OPEN_SECTIONS

    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and key not in OPEN_SECTIONS and key != "spark.conf":
            yield from _yaml_keys(value, f"{key}.")
        else:
            yield key


def test_the_embedded_default_is_the_one_home_of_every_default():
    """The classes hold no default, so no code path can get a value the yaml does not give (a class default
    once trained with fixed windows where the yaml said random); the yaml names every key the classes define."""
    import yaml

    from recsys.config import Config, default_config_text

    keys = dict(_class_keys(Config))
    assert len(keys) > 60
    assert [key for key, field in keys.items() if not field.is_required()] == [], \
        "a configuration class has a default: put it in recsys/default.yaml only (docs/architecture.md)"
    assert sorted(_yaml_keys(yaml.safe_load(default_config_text()))) == sorted(keys)


def test_every_guard_threshold_of_the_default_states_both_levels():
    """GuardThreshold's levels keep a default (null: that level off) for figures a user adds, which no yaml
    row can name in advance; the default's own thresholds state both levels, so that default never decides."""
    import yaml

    from recsys.config import default_config_text

    thresholds = yaml.safe_load(default_config_text())["guard"]["thresholds"]
    assert thresholds and all(set(levels) == {"warn", "fail"} for levels in thresholds.values())


def test_the_core_s_own_defaults_are_the_embedded_configuration_s():
    """The model config dataclasses keep defaults for code that runs without a configuration (the core, the GPU
    bench); they must be the yaml's. (ScoringParams: test_scoring_params_defaults_are_the_embedded_configuration_s.)"""
    import dataclasses

    from recsys.model.configs import MODEL_CONFIGS

    model = load_config().train.model
    for name, config_cls in MODEL_CONFIGS.items():
        defaults = {f.name: f.default for f in dataclasses.fields(config_cls) if f.default is not dataclasses.MISSING}
        assert defaults and defaults == {key: getattr(model.section(name), key) for key in defaults}, name


def test_the_digest_covers_exactly_the_sections_its_docstring_names():
    import hashlib
    import json

    from recsys.config import Config

    covered = ("paths", "mlflow", "history", "catalog", "scoring", "recommend", "train", "evaluation", "spark")
    left_out = ("progress", "serve", "export", "output", "storage", "guard")
    assert set(Config.model_fields) == {*covered, *left_out}, "a new section: decide whether the digest covers it"
    doc = " ".join(Config.digest.__doc__.split())
    assert all(f"``{name}``" in doc for name in covered + left_out)
    cfg = load_config(overrides=["scoring.top_n=7"])
    data = {k: v for k, v in cfg.to_dict().items() if k in covered}
    data["evaluation"].pop("backtest")                       # the docstring names it: only the backtest reads it
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert "``evaluation.backtest``" in doc
    assert cfg.digest() == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert cfg.digest() == load_config(overrides=["scoring.top_n=7", "guard.min_users=3", "serve.port=9",
                                                  "evaluation.backtest.half_life_days=3"]).digest()


def test_the_spark_jvm_s_log4j_file_is_spark_submit_s_unless_the_environment_names_another(tmp_path):
    """RECSYS_LOG4J_CONF as spark-submit.sh reads it, for the JVMs the CLI starts itself: unset, the checkout's
    conf/log4j2.properties; empty, none (Spark's own); a file, that file; anything else is exit 2 naming it."""
    from recsys.config import SHIPPED_LOG4J_CONF, load_launch_settings
    from recsys.spark.session import log_settings

    assert SHIPPED_LOG4J_CONF.is_file()
    assert load_launch_settings({}).log4j_conf == SHIPPED_LOG4J_CONF
    assert log_settings(load_launch_settings({})) == {
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{SHIPPED_LOG4J_CONF}"}
    assert load_launch_settings({"RECSYS_LOG4J_CONF": ""}).log4j_conf is None
    assert log_settings(load_launch_settings({"RECSYS_LOG4J_CONF": ""})) == {}
    mine = tmp_path / "mine.properties"
    mine.write_text("rootLogger.level = info\n")
    assert load_launch_settings({"RECSYS_LOG4J_CONF": str(mine)}).log4j_conf == mine
    with pytest.raises(ConfigError, match=r"RECSYS_LOG4J_CONF='.*no-such.properties' is not a file") as raised:
        load_launch_settings({"RECSYS_LOG4J_CONF": str(tmp_path / "no-such.properties")})
    assert raised.value.exit_code == ExitCode.BAD_INPUT
