"""Training: histories before a date -> a model version in the registry, and a gated alias move.

The training data is built by the same history code the nightly job serves from
(``recsys.data.history``), so the model sees at training time exactly the sequences it will be
scored on. Each user's most recent item is held out for validation (early stopping, the gate).
"""
from __future__ import annotations

import datetime as dt
import logging
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from pyspark.sql import SparkSession

from recsys import __version__
from recsys.config import Config
from recsys.data import history as hist
from recsys.data.contracts import parse_date
from recsys.data.readers import read_events_window
from recsys.errors import GateError, InputDataError, TrackingFailed, first_line
from recsys.learning.settings import model_config, train_settings
from recsys.learning.split import SplitData, build_vocabulary, score_on_split, split_last_item, validation_set
from recsys.model.metrics import SELECTION_METRIC, validation_name
from recsys.pipelines.timing import StageTimer
from recsys.sequences import Sequences, Vocabulary
from recsys.spark.session import job_description
from recsys.tracking import run_notes as run_record
from recsys.tracking import store as tracking
from recsys.tracking import tags
from recsys.uris import redact_text, redact_uri

log = logging.getLogger(__name__)

VALIDATION_METRIC = validation_name(SELECTION_METRIC)   # val_ndcg@10: what the gate compares


@dataclass
class TrainResult:
    date: dt.date
    run_id: str
    version: str
    metrics: dict[str, float]
    promoted: bool
    decision: str
    curve: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        return (f"trained model version {self.version} (run {self.run_id}): "
                f"{VALIDATION_METRIC}={self.metrics.get(VALIDATION_METRIC, float('nan')):.4f}; {self.decision}")


def training_due(cfg: Config, date: dt.date) -> str | None:
    """Why training for ``date`` is not due under ``train.every_nights``, or None when it is.

    The cadence counts from the newest training run that finished (a version was registered, whether
    or not the gate moved the alias); a failed training does not count, so the next night tries again.
    """
    every = cfg.train.every_nights
    last = tracking.last_training_date(cfg.mlflow)
    if last is None:
        return None
    if last >= date:
        return f"a training for {last} already finished (on or after {date})"
    if (date - last).days < every:
        return (f"the last training finished for {last}, {(date - last).days} night(s) ago; "
                f"train.every_nights={every}: next due for {last + dt.timedelta(days=every)}")
    return None


def load_training_data(spark: SparkSession, cfg: Config, date: dt.date) -> tuple[np.ndarray, Sequences]:
    """Each user's history before ``date``, built by the nightly job's own code, but up to
    ``train.history_items`` long: scoring needs only the recent items (``history.max_items``),
    while training learns from every transition it is given."""
    events = read_events_window(spark, cfg.paths.events, date, cfg.history.window_days, cfg.history.event_types)
    histories = hist.build_histories(hist.drop_null_ids(events), max_items=cfg.train.history_items,
                                     tie_break_seed=cfg.history.tie_break_seed)
    return hist.histories_to_sequences(histories.toArrow())


@dataclass
class _Training:
    """One training run under way: its data, settings and MLflow run, handed from step to step."""

    cfg: Config
    date: dt.date
    timer: StageTimer
    user_ids: np.ndarray
    split: SplitData                  # id space: every version is gated on the same users
    vocab: Vocabulary
    train_seqs: Sequences             # index space, each user's newest item held out
    valid: Any                        # recsys.model.training.ValidationSet, for early stopping
    device: Any = None
    recorder: Any = None              # tracking.RunRecorder, once the run is opened


def run_training(spark: SparkSession, cfg: Config, date: dt.date | str, *, force: bool = False) -> TrainResult:
    """Train ``train.model`` on the histories before ``date``, register it as a new version, and move the
    alias unless the holder scores better on the same validation users (``force`` moves it anyway).

    Steps: read -> prepare (hold out each user's newest item, build the vocabulary) -> open the MLflow
    run -> fit (early stopping on the held-out items) -> register -> gate. Bad input raises
    InputDataError before any MLflow run exists; any failure after marks the run FAILED.
    """
    import torch

    from recsys.scoring.core import resolve_device

    date = parse_date(date)
    timer = StageTimer(partial(job_description, spark), job=f"train {date}")
    run = _prepare(cfg, date, timer, *_read(spark, cfg, date, timer))
    run.device = resolve_device(cfg.train.device)
    model_cfg, settings = model_config(cfg.train.model, len(run.vocab)), train_settings(cfg.train)
    run.recorder = _open_run(run, model_cfg, settings)
    try:
        result, metrics = _fit(run, model_cfg, settings)
        version = _register(run, result, metrics)
        with timer.stage("gate", "compare with the alias holder") as c:
            new_score = score_on_split(result.model, run.vocab.item_ids, run.split, run.device)
            promoted, decision = _gate(cfg, version, new_score, run.split, force, run.device)
            c.update(decision=decision)
        run.recorder.set_tags({tags.MODEL_VERSION: version, tags.PROMOTED: str(promoted), tags.GATE: decision})
        run_record.record_training(run.recorder, date, run_record.Inputs.of(cfg.paths, cfg.history),
                                   run_record.TrainingSummary(cfg.train.model.type, len(run.user_ids), len(run.vocab),
                                                              metrics, cfg.mlflow.model_name, version, decision))
        run.recorder.end("FINISHED")
    except BaseException as exc:
        run.recorder.set_tags({tags.ERROR: redact_text(str(exc))[:4000]})
        run.recorder.end("FAILED")
        raise
    finally:
        torch.set_grad_enabled(True)
    log.info("[train %s] %s", date, decision)
    return TrainResult(date, run.recorder.run_id, version, metrics, promoted, decision, result.curve)


def _read(spark: SparkSession, cfg: Config, date: dt.date, timer: StageTimer) -> tuple[np.ndarray, Sequences]:
    with timer.stage("read", "read events and build histories") as c:
        user_ids, id_seqs = load_training_data(spark, cfg, date)
        c.update(users=len(user_ids), interactions=len(id_seqs.items))
    if len(id_seqs.items) == 0:
        raise InputDataError(f"no events before {date} within history.window_days={cfg.history.window_days} "
                             f"under {redact_uri(cfg.paths.events)!r}; nothing to train on")
    return user_ids, id_seqs


def _prepare(cfg: Config, date: dt.date, timer: StageTimer, user_ids: np.ndarray, id_seqs: Sequences) -> _Training:
    """Hold out each user's newest item, build the vocabulary from what is left, map to its indices."""
    with timer.stage("prepare", "split and build vocabulary") as c:
        split = split_last_item(id_seqs)
        vocab = build_vocabulary(split.train, cfg.train.min_item_count)
        train_seqs, dropped = vocab.map_sequences(split.train)
        valid = validation_set(vocab, split)
        c.update(items=len(vocab), train_items=len(train_seqs.items), dropped_rare=dropped,
                 validation_users=len(valid.targets))
    if len(vocab) < 2:
        raise InputDataError(f"only {len(vocab)} item(s) qualify for the vocabulary; need more events or a lower "
                             f"train.min_item_count")
    return _Training(cfg, date, timer, user_ids, split, vocab, train_seqs, valid)


def _open_run(run: _Training, model_cfg: Any, settings: Any) -> Any:
    """The training's MLflow run, with what it is about to do as parameters; training without a
    record is refused (TrackingFailed): the version it registers must point at a run."""
    cfg, date = run.cfg, run.date
    recorder = tracking.RunRecorder(cfg.mlflow, run_name=f"train {date}",
                                    experiment=tracking.training_experiment(cfg.mlflow),
                                    tags={tags.JOB: tags.TRAIN_JOB, tags.DATE: str(date), tags.VERSION: __version__})
    if recorder.failed:
        raise TrackingFailed(f"cannot record the training run in {redact_uri(cfg.mlflow.tracking_uri)}: {recorder.error}")
    recorder.log_params({
        "date": str(date), "model_type": cfg.train.model.type, **{f"model_{k}": v for k, v in model_cfg.__dict__.items()},
        **{f"train_{k}": v for k, v in settings.__dict__.items()}, "device": str(run.device),
        "window_days": cfg.history.window_days, "train_history_items": cfg.train.history_items,
        "users": len(run.user_ids), "validation_users": len(run.valid.targets), "config_digest": cfg.digest(),
    })
    return recorder


def _fit(run: _Training, model_cfg: Any, settings: Any) -> tuple[Any, dict[str, float]]:
    """Train with early stopping on the held-out items, logging each epoch; the best epoch's figures."""
    from recsys.model.training import fit
    from recsys.tracking import plots

    recorder = run.recorder

    def on_epoch(row: dict[str, Any]) -> None:
        log.info("[train %s] epoch %d: %s", run.date, row["epoch"],
                 ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "epoch" and isinstance(v, float)))
        recorder.log_metrics({validation_name(k) if "@" in k else k: v for k, v in row.items() if k != "epoch"},
                             step=int(row["epoch"]))

    with run.timer.stage("fit", "train model") as c:
        result = fit(run.train_seqs, model_cfg, settings, valid=run.valid, device=run.device, progress=on_epoch)
        c.update(best_epoch=result.best_epoch, **{k: round(v, 4) for k, v in result.best_metrics.items()})
    metrics = {validation_name(k): v for k, v in result.best_metrics.items()}
    metrics["best_epoch"] = result.best_epoch
    recorder.log_metrics({**metrics, **run.timer.as_metrics()})
    recorder.log_figure(plots.learning_curve(_curve_with_val_names(result.curve), VALIDATION_METRIC),
                        "plots/learning_curve.png")
    return result, metrics


def _register(run: _Training, result: Any, metrics: dict[str, float]) -> str:
    """The model's files logged to the run and registered as a new version of ``mlflow.model_name``."""
    from recsys.model.io import save_model

    recorder = run.recorder
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(result.model.cpu(), run.vocab.item_ids, Path(tmp) / "model",
                               metadata={"trained_before": str(run.date), "run_id": recorder.run_id,
                                         VALIDATION_METRIC: metrics.get(VALIDATION_METRIC)})
        recorder.log_artifacts(model_dir, "model")
    artifact_uri = recorder.artifact_uri("model")
    if recorder.failed or artifact_uri is None:
        raise TrackingFailed(f"the training run could not be recorded: {recorder.error}")
    return tracking.register_version(run.cfg.mlflow.model_name, recorder.run_id, artifact_uri,
                                     description=f"trained on events before {run.date}")


def _gate(cfg: Config, version: str, new_score: float, split: SplitData, force: bool, device):
    """Move the alias unless the holder scores better on *this* validation set by more than the tolerance.

    Comparing on the same validation users is what makes the decision fair: the holder's own
    training-time figure was measured on older data. A holder that cannot be scored (its files gone,
    a format this version cannot read) stops the gate with a message naming it, and ``--force``
    still moves the alias: a broken holder is exactly when an operator reaches for it.
    """
    name, alias = cfg.mlflow.model_name, cfg.mlflow.alias
    holder = tracking.alias_holder(name, alias)
    if holder is None:
        tracking.set_alias(name, alias, version)
        return True, f"promoted version {version} to @{alias}: no version held the alias"
    holder_version, _ = holder
    tolerance = cfg.train.gate_tolerance
    try:
        holder_score = _score_version(cfg, holder_version, split, device)
    except Exception as exc:
        problem = f"the holder version {holder_version} could not be scored ({first_line(exc, with_type=True, limit=300)})"
        if force:
            tracking.set_alias(name, alias, version)
            return True, f"promoted version {version} to @{alias} because of --force; {problem}"
        raise GateError(f"kept @{alias} on version {holder_version}: {problem}; fix or remove that version, "
                        f"or move the alias to version {version} with --force") from exc
    detail = (f"new {VALIDATION_METRIC}={new_score:.4f} vs holder version {holder_version} "
              f"{holder_score:.4f} on the same validation users (tolerance {tolerance})")
    if force:
        tracking.set_alias(name, alias, version)
        return True, f"promoted version {version} to @{alias} because of --force; {detail}"
    if not np.isfinite(new_score):
        return False, f"kept @{alias} on version {holder_version}: the new version has no validation score; {detail}"
    if new_score >= holder_score - tolerance:
        tracking.set_alias(name, alias, version)
        return True, f"promoted version {version} to @{alias}: not worse than the holder; {detail}"
    return False, f"kept @{alias} on version {holder_version}: the new version validates worse; {detail}; use --force to override"


def _score_version(cfg: Config, version: str, split: SplitData, device) -> float:
    from recsys.model.io import load_model

    local = tracking.model_version_dir(cfg.mlflow.model_name, version, cfg.paths.driver_dir / "models")
    loaded = load_model(local, device=device)
    return score_on_split(loaded.model, loaded.item_ids, split, device)


def _curve_with_val_names(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{(validation_name(k) if "@" in k else k): v for k, v in row.items()} for row in curve]
