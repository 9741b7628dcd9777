"""The training cadence a schedule follows (``train.every_nights``, ``recsys train --if-due``), on a real
sqlite MLflow store. No Spark: a training that is not due never starts a session."""
from __future__ import annotations

import datetime as dt

import pytest

from recsys.config import load_config

D = dt.date(2024, 5, 8)


@pytest.fixture
def cfg(tmp_path):
    return load_config(overrides=[f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                  f"mlflow.artifact_location={tmp_path / 'artifacts'}", "train.every_nights=2"])


def _training_run(cfg, date: dt.date, status: str = "FINISHED", model_name: str | None = None) -> None:
    from mlflow import MlflowClient

    from recsys.tracking import store, tags

    experiment = store.setup(cfg.mlflow, store.training_experiment(cfg.mlflow))
    client = MlflowClient()
    named = {} if model_name is None else {tags.MODEL_NAME: model_name}
    run = client.create_run(experiment, tags={tags.JOB: tags.TRAIN_JOB, tags.DATE: str(date), **named})
    client.set_terminated(run.info.run_id, status)


def test_training_is_due_every_n_nights_after_the_last_finished_one(cfg):
    from recsys.pipelines.train import training_due

    assert training_due(cfg, D) is None                               # never trained: due
    _training_run(cfg, D)
    assert "already finished" in training_due(cfg, D)                 # the same date again: not due
    reason = training_due(cfg, D + dt.timedelta(days=1))
    assert "1 night(s) ago" in reason and "next due for 2024-05-10" in reason
    assert training_due(cfg, D + dt.timedelta(days=2)) is None


def test_a_failed_training_does_not_reset_the_cadence(cfg):
    from recsys.pipelines.train import training_due

    _training_run(cfg, D)
    _training_run(cfg, D + dt.timedelta(days=2), status="FAILED")
    assert training_due(cfg, D + dt.timedelta(days=2)) is None        # the failed night is tried again
    _training_run(cfg, D + dt.timedelta(days=2))
    assert training_due(cfg, D + dt.timedelta(days=3)) is not None


def test_each_model_name_keeps_its_own_cadence_in_a_shared_experiment(cfg):
    from recsys.pipelines.train import training_due
    from recsys.tracking import store

    other = cfg.mlflow.model_name + "-challenger"
    _training_run(cfg, D + dt.timedelta(days=1), model_name=other)      # another model, the same experiment
    _training_run(cfg, D, model_name=cfg.mlflow.model_name)
    assert [t.date for t in store.finished_trainings(cfg.mlflow)] == [D]
    assert "1 night(s) ago" in training_due(cfg, D + dt.timedelta(days=1))   # not "already finished" for D+1
    assert training_due(cfg, D + dt.timedelta(days=2)) is None
    # a run from before the name was tagged counts for every name
    _training_run(cfg, D + dt.timedelta(days=2))
    assert store.last_training_date(cfg.mlflow) == D + dt.timedelta(days=2)


def test_train_if_due_exits_0_without_starting_spark_when_not_due(cfg, monkeypatch, caplog):
    import recsys.spark.session
    from recsys.cli.main import main

    _training_run(cfg, D)

    def no_spark(*args, **kwargs):
        raise AssertionError("a training that is not due started a Spark session")

    monkeypatch.setattr(recsys.spark.session, "build_session", no_spark)
    argv = ["train", "--date", str(D + dt.timedelta(days=1)), "--if-due",
            "--set", f"mlflow.tracking_uri={cfg.mlflow.tracking_uri}", "--set", "train.every_nights=2"]
    with caplog.at_level("INFO", logger="recsys"):
        assert main(argv) == 0
    assert "finished with exit code 0" in caplog.text and "not due" in caplog.text


def test_an_unreachable_store_is_reported_in_one_line(tmp_path):
    from recsys.errors import TrackingUnavailable
    from recsys.pipelines.train import training_due

    broken = load_config(overrides=[f"mlflow.tracking_uri=sqlite:///{tmp_path / 'not-a-dir' / 'x' / '..' / 'm.db'}"])
    (tmp_path / "not-a-dir").write_text("a file where the store's directory should be")
    with pytest.raises(TrackingUnavailable, match="cannot read the training runs"):
        training_due(broken, D)
