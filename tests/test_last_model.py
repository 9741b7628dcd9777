"""The remembered model resolution stands in for the registry only for the store and the files it came from.

A memo once left by a test's registry in the checkout made an unreachable-MLflow night publish a toy
model as "version 1" with exit 5; these tests pin the binding that prevents it. No Spark, no MLflow
server: the registry's failure is simulated where the job meets it (``resolve_model``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.config import load_config
from recsys.errors import TrackingUnavailable
from recsys.tracking import last_model
from recsys.tracking.last_model import memo_path, recall, remember, resolve_or_remembered
from recsys.tracking.store import ResolvedModel, tracking_store_id

NAME, ALIAS = "recsys-default", "champion"


def _model_dir(root: Path) -> Path:
    d = root / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"format_version": 1}')
    (d / "weights.safetensors").write_bytes(b"\x00" * 64)
    return d


def _model(root: Path, version: str = "1") -> ResolvedModel:
    d = _model_dir(root)
    return ResolvedModel(NAME, ALIAS, version, "r1", str(d), d)


def test_a_memo_is_used_with_the_store_and_files_it_was_remembered_with(tmp_path):
    model = _model(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    remember(tmp_path / "driver", model, store)
    found, why = recall(tmp_path / "driver", NAME, ALIAS, store)
    assert why is None and found == model


def test_a_memo_from_another_tracking_store_is_not_used_and_says_which_stores(tmp_path):
    model = _model(tmp_path)
    remember(tmp_path / "driver", model, f"sqlite:///{tmp_path / 'tests-store' / 'mlflow.db'}")
    for other in ("http://127.0.0.1:9", f"sqlite:///{tmp_path / 'demo' / 'mlflow.db'}"):
        found, why = recall(tmp_path / "driver", NAME, ALIAS, other)
        assert found is None
        assert f"came from the tracking store sqlite:///{tmp_path / 'tests-store' / 'mlflow.db'}" in why
        assert f"not this run's {tracking_store_id(other)}" in why
        assert memo_path(tmp_path / "driver", NAME, ALIAS) in why


def test_model_files_that_changed_or_vanished_since_are_not_used(tmp_path):
    model = _model(tmp_path)
    store = "http://mlflow.internal:5000"
    remember(tmp_path / "driver", model, store)
    before = json.loads(Path(memo_path(tmp_path / "driver", NAME, ALIAS)).read_text())["files_digest"]
    (model.local_dir / "weights.safetensors").write_bytes(b"\x01" * 64)   # same version number, other weights
    found, why = recall(tmp_path / "driver", NAME, ALIAS, store)
    assert found is None and "changed since they were resolved" in why and f"digest {before} then" in why
    (model.local_dir / "config.json").unlink()
    found, why = recall(tmp_path / "driver", NAME, ALIAS, store)
    assert found is None and "are gone" in why


def test_a_memo_written_before_the_binding_is_not_trusted_and_says_to_run_once_with_mlflow(tmp_path):
    model = _model(tmp_path)
    path = Path(memo_path(tmp_path / "driver", NAME, ALIAS))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"name": NAME, "alias": ALIAS, "version": "1", "run_id": None, "source": str(model.source),
                                "local_dir": str(model.local_dir), "resolved_at": "2026-11-30T00:00:00+00:00"}))
    found, why = recall(tmp_path / "driver", NAME, ALIAS, "http://127.0.0.1:9")
    assert found is None and "not trusted" in why and "run the job once with MLflow reachable" in why


def test_one_store_spelled_differently_is_one_store_and_credentials_never_reach_the_memo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tracking_store_id("sqlite:///.recsys/mlflow.db") == tracking_store_id(f"sqlite:///{tmp_path}/.recsys/mlflow.db")
    assert tracking_store_id("http://bob:s3cret@MLflow.internal:80/") == tracking_store_id("http://mlflow.internal")
    assert tracking_store_id("https://h:443/x/?token=t") == "https://h/x"
    assert tracking_store_id("http://h:5000") != tracking_store_id("http://h:5001")
    assert tracking_store_id("mlruns") == (tmp_path / "mlruns").as_uri()
    model = _model(tmp_path)
    remember(tmp_path / "driver", model, "http://bob:s3cret@mlflow.internal:5000/?token=t0ken")
    text = Path(memo_path(tmp_path / "driver", NAME, ALIAS)).read_text()
    assert "s3cret" not in text and "t0ken" not in text and "bob" not in text
    found, why = recall(tmp_path / "driver", NAME, ALIAS, "http://mlflow.internal:5000")
    assert why is None and found == model


def _unreachable(monkeypatch):
    def down(cfg, download_root):
        raise TrackingUnavailable(f"cannot resolve models:/{cfg.model_name}@{cfg.alias}: ConnectionError")

    monkeypatch.setattr(last_model, "resolve_model", down)


@pytest.mark.parametrize("store_of_the_memo, usable", [("the run's", True), ("another", False)])
def test_an_unreachable_store_falls_back_only_to_its_own_memo(tmp_path, monkeypatch, store_of_the_memo, usable):
    model = _model(tmp_path)
    cfg = load_config(overrides=["mlflow.tracking_uri=http://127.0.0.1:9", f"mlflow.model_name={NAME}"]).mlflow
    remember(tmp_path / "driver", model, cfg.tracking_uri if usable else f"sqlite:///{tmp_path / 'other.db'}")
    _unreachable(monkeypatch)
    if usable:
        assert resolve_or_remembered(cfg, tmp_path / "driver") == (model, f"cannot resolve {model.uri}: ConnectionError")
        return
    with pytest.raises(TrackingUnavailable) as caught:
        resolve_or_remembered(cfg, tmp_path / "driver")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"cannot resolve {model.uri}: ConnectionError; ")
    assert "came from the tracking store" in message and message.endswith("Retry when the tracking store is back")
