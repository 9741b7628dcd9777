"""Training: histories before a date -> a model version in the registry, and a gated alias move.

The training data is built by the same history code the nightly job serves from
(``recsys.data.history``), so the model sees at training time exactly the sequences it will be
scored on. Two fits (docs/quality.md, "What training registers"):

1. **select**: each user's newest item held out; the epoch count is chosen on them (early stopping);
2. **refit** (``train.refit``, the default): the same settings for that many epochs on every
   interaction before the date, newest items and items seen only there included; this model is
   registered, so the night after scores with a model that knows yesterday.

The gate judges the *selection* model against the alias holder on held-out items that neither has
trained on: the newest items first touched on or after the holder's training date.
"""
from __future__ import annotations

import datetime as dt
import logging
import math
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

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


@dataclass(frozen=True)
class TrainingData:
    """Every user's history before the date, with when they first touched their newest item."""

    user_ids: np.ndarray          # [U] external user ids
    sequences: Sequences          # [U] item ids, oldest first
    newest_first_us: np.ndarray   # [U] epoch microseconds (UTC) of the user's first event on their newest item


def load_training_data(spark: SparkSession, cfg: Config, date: dt.date) -> TrainingData:
    """Each user's history before ``date``, built by the nightly job's own code, but up to
    ``train.history_items`` long: scoring needs only the recent items (``history.max_items``),
    while training learns from every transition it is given.

    With it, the time of each user's *first* event on their newest item: a history collapses
    repeats to their latest time, and the gate must know whether an older model could have seen
    the pair at all (``SplitData.since``). One more aggregation of the window, by (user, item).
    """
    events = hist.drop_null_ids(read_events_window(spark, cfg.paths.events, date, cfg.history.window_days,
                                                   cfg.history.event_types))
    histories = hist.build_histories(events, max_items=cfg.train.history_items,
                                     tie_break_seed=cfg.history.tie_break_seed)
    first_seen = events.groupBy("user_id", "item_id").agg(F.unix_micros(F.min("ts")).alias("first_us"))
    # histories used once (a second reference would build them, shuffles and all, a second time)
    table = (histories.withColumn("item_id", F.element_at(hist.HISTORY_COLUMN, -1))
             .join(first_seen, ["user_id", "item_id"]).drop("item_id").toArrow())
    user_ids, sequences = hist.histories_to_sequences(table)
    return TrainingData(user_ids, sequences, table.column("first_us").to_numpy())


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
    full_vocab: Vocabulary            # the refit's: every item before the date, newest items included
    full_seqs: Sequences              # index space of full_vocab: every interaction before the date
    device: Any = None
    recorder: Any = None              # tracking.RunRecorder, once the run is opened


def run_training(spark: SparkSession, cfg: Config, date: dt.date | str, *, force: bool = False) -> TrainResult:
    """Train ``train.model`` on the histories before ``date``, register it as a new version, and move the
    alias unless the holder scores better on held-out items neither has trained on (``force`` moves it anyway).

    Steps: read -> prepare (hold out each user's newest item, build both vocabularies) -> open the MLflow
    run -> select (early stopping on the held-out items) -> refit on everything (``train.refit``) ->
    register -> gate. Bad input raises InputDataError before any MLflow run exists; any failure after
    marks the run FAILED.
    """
    import torch

    from recsys.scoring.core import resolve_device

    date = parse_date(date)
    timer = StageTimer(partial(job_description, spark), job=f"train {date}")
    run = _prepare(cfg, date, timer, _read(spark, cfg, date, timer))
    run.device = resolve_device(cfg.train.device)
    model_cfg, settings = model_config(cfg.train.model, len(run.vocab)), train_settings(cfg.train, run.device)
    run.recorder = _open_run(run, model_cfg, settings)
    try:
        result, metrics = _fit(run, model_cfg, settings)
        final_model, final_items = result.model, run.vocab.item_ids
        if cfg.train.refit:
            final_model, final_items = _refit(run, settings, result.best_epoch), run.full_vocab.item_ids
        version = _register(run, final_model, final_items, metrics)
        with timer.stage("gate", "compare with the alias holder") as c:
            gate = _gate(cfg, version, GateCandidate(result.model, run.vocab.item_ids), run.split, force, run.device)
            c.update(decision=gate.decision)
        promoted, decision = gate.promoted, gate.decision
        run.recorder.log_metrics(gate.figures)
        run.recorder.set_tags({tags.MODEL_VERSION: version, tags.PROMOTED: str(promoted), tags.GATE: decision})
        run_record.record_training(run.recorder, date, run_record.Inputs.of(cfg.paths, cfg.history),
                                   run_record.TrainingSummary(cfg.train.model.type, len(run.user_ids), len(final_items),
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


def _read(spark: SparkSession, cfg: Config, date: dt.date, timer: StageTimer) -> TrainingData:
    with timer.stage("read", "read events and build histories") as c:
        data = load_training_data(spark, cfg, date)
        c.update(users=len(data.user_ids), interactions=len(data.sequences.items))
    if len(data.sequences.items) == 0:
        raise InputDataError(f"no events before {date} within history.window_days={cfg.history.window_days} "
                             f"under {redact_uri(cfg.paths.events)!r}; nothing to train on")
    return data


def _prepare(cfg: Config, date: dt.date, timer: StageTimer, data: TrainingData) -> _Training:
    """Hold out each user's newest item, build the selection vocabulary from what is left and the
    refit's from everything, map both to their indices."""
    with timer.stage("prepare", "split and build vocabulary") as c:
        split = split_last_item(data.sequences, first_us=data.newest_first_us)
        vocab = build_vocabulary(split.train, cfg.train.min_item_count)
        train_seqs, dropped = vocab.map_sequences(split.train)
        valid = validation_set(vocab, split)
        full_vocab = build_vocabulary(data.sequences, cfg.train.min_item_count)
        full_seqs, _ = full_vocab.map_sequences(data.sequences)
        c.update(items=len(vocab), train_items=len(train_seqs.items), dropped_rare=dropped,
                 validation_users=len(valid.targets), refit_items=len(full_vocab),
                 items_only_in_newest=len(full_vocab) - len(vocab))
    if len(vocab) < 2:
        raise InputDataError(f"only {len(vocab)} item(s) qualify for the vocabulary; need more events or a lower "
                             f"train.min_item_count")
    return _Training(cfg, date, timer, data.user_ids, split, vocab, train_seqs, valid, full_vocab, full_seqs)


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
        "refit": cfg.train.refit, "refit_items": len(run.full_vocab), "gate_min_users": cfg.train.gate_min_users,
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


def _refit(run: _Training, settings: Any, epochs: int) -> Any:
    """The registered model: the selection's settings for its chosen epoch count, on every interaction
    before the date (no held-out items, so no early stop: the count is what the selection chose; the
    learning-rate schedule keeps the selection's horizon, so the refit repeats its first epochs)."""
    from recsys.model.training import fit

    def on_epoch(row: dict[str, Any]) -> None:
        log.info("[train %s] refit epoch %d of %d: train_loss=%.4f", run.date, row["epoch"], epochs, row["train_loss"])
        run.recorder.log_metrics({"refit_train_loss": row["train_loss"]}, step=int(row["epoch"]))

    model_cfg = model_config(run.cfg.train.model, len(run.full_vocab))
    with run.timer.stage("refit", f"train on every interaction for {epochs} epochs") as c:
        result = fit(run.full_seqs, model_cfg, settings, device=run.device, progress=on_epoch,
                     stop_after=max(1, epochs))
        c.update(epochs=len(result.curve), items=len(run.full_vocab), interactions=len(run.full_seqs.items))
    run.recorder.log_metrics({"refit_epochs": len(result.curve), **run.timer.as_metrics()})
    return result.model


def _register(run: _Training, model: Any, item_ids: np.ndarray, metrics: dict[str, float]) -> str:
    """The model's files logged to the run and registered as a new version of ``mlflow.model_name``."""
    from recsys.model.io import save_model

    recorder = run.recorder
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(model.cpu(), item_ids, Path(tmp) / "model",
                               metadata={"trained_before": str(run.date), "run_id": recorder.run_id,
                                         VALIDATION_METRIC: metrics.get(VALIDATION_METRIC),
                                         "refit": run.cfg.train.refit, "epochs": int(metrics["best_epoch"])})
        recorder.log_artifacts(model_dir, "model")
    artifact_uri = recorder.artifact_uri("model")
    if recorder.failed or artifact_uri is None:
        raise TrackingFailed(f"the training run could not be recorded: {recorder.error}")
    return tracking.register_version(run.cfg.mlflow.model_name, recorder.run_id, artifact_uri,
                                     description=f"trained on events before {run.date}")


@dataclass(frozen=True)
class GateCandidate:
    """What the gate scores for a new version: the selection model, which never saw the held-out items.

    The registered (refit) model trained on them, so it cannot be judged on them; it is the same
    recipe with one more item per user, and the gate's verdict on the recipe is its verdict.
    """

    model: Any
    item_ids: np.ndarray


@dataclass(frozen=True)
class GateDecision:
    promoted: bool
    decision: str
    figures: dict[str, float] = field(default_factory=dict)   # logged to the training run


def _gate(cfg: Config, version: str, candidate: GateCandidate, split: SplitData, force: bool, device) -> GateDecision:
    """Move the alias unless the holder scores better, by more than the tolerance, on held-out items
    that neither model has trained on.

    The candidate never saw any user's newest item; the holder trained on everything before its
    own ``trained_before`` date, so only newest items the user first touched on or after that date
    are unseen by both (:meth:`SplitData.since`). With fewer such users than ``train.gate_min_users``
    the gate cannot judge and keeps the holder: every night it stays, the set grows by a day.
    A holder that records no training date (a version saved elsewhere) is judged on every held-out
    user, and the decision says so. A holder that cannot be scored (its files gone, a format this
    version cannot read) stops the gate with a message naming it, and ``--force`` still moves the
    alias: a broken holder is exactly when an operator reaches for it.
    """
    name, alias = cfg.mlflow.model_name, cfg.mlflow.alias
    holder = tracking.alias_holder(name, alias)
    if holder is None:
        tracking.set_alias(name, alias, version)
        return GateDecision(True, f"promoted version {version} to @{alias}: no version held the alias")
    holder_version, _ = holder
    tolerance = cfg.train.gate_tolerance
    try:
        loaded = _load_version(cfg, holder_version, device)
        judged, basis = held_out_unseen_by(split, loaded.metadata.get("trained_before"), holder_version)
        enough = judged.users >= cfg.train.gate_min_users
        holder_score = score_on_split(loaded.model, loaded.item_ids, judged, device) if enough or force else math.nan
    except Exception as exc:
        problem = f"the holder version {holder_version} could not be scored ({first_line(exc, with_type=True, limit=300)})"
        if force:
            tracking.set_alias(name, alias, version)
            return GateDecision(True, f"promoted version {version} to @{alias} because of --force; {problem}")
        raise GateError(f"kept @{alias} on version {holder_version}: {problem}; fix or remove that version, "
                        f"or move the alias to version {version} with --force") from exc
    figures = {"gate_users": float(judged.users)}
    if not enough and not force:
        return GateDecision(False, f"kept @{alias} on version {holder_version}: only {judged.users} held-out "
                                   f"user(s) {basis}, fewer than train.gate_min_users={cfg.train.gate_min_users} to "
                                   f"judge on; the set grows every night the holder stays, or use --force", figures)
    new_score = score_on_split(candidate.model.to(device), candidate.item_ids, judged, device)   # _register: on CPU
    figures.update({"gate_candidate_" + SELECTION_METRIC: new_score, "gate_holder_" + SELECTION_METRIC: holder_score})
    detail = (f"new {SELECTION_METRIC}={new_score:.4f} vs holder version {holder_version} {holder_score:.4f} on "
              f"{judged.users} held-out user(s) {basis} (tolerance {tolerance})")
    figures = {k: v for k, v in figures.items() if np.isfinite(v)}
    if force:
        tracking.set_alias(name, alias, version)
        return GateDecision(True, f"promoted version {version} to @{alias} because of --force; {detail}", figures)
    if new_score >= holder_score - tolerance:
        tracking.set_alias(name, alias, version)
        return GateDecision(True, f"promoted version {version} to @{alias}: not worse than the holder; {detail}",
                            figures)
    return GateDecision(False, f"kept @{alias} on version {holder_version}: the new version scores worse; {detail}; "
                               "use --force to override", figures)


def held_out_unseen_by(split: SplitData, trained_before: str | None, holder: str) -> tuple[SplitData, str]:
    """The held-out users whose newest item the holder cannot have trained on, and how they were chosen."""
    if trained_before is None or split.valid_first_us is None:
        return split, f"(all of them: version {holder} records no training date)"
    try:
        cutoff = parse_date(trained_before)
    except Exception:
        return split, f"(all of them: version {holder} records an unreadable training date {trained_before!r})"
    cutoff_us = int(dt.datetime.combine(cutoff, dt.time(), tzinfo=dt.timezone.utc).timestamp()) * 1_000_000
    return split.since(cutoff_us), f"whose newest item was first touched on or after {cutoff} (version {holder} trained before it)"


def _load_version(cfg: Config, version: str, device):
    from recsys.model.io import load_model

    local = tracking.model_version_dir(cfg.mlflow.model_name, version, cfg.paths.driver_dir / "models")
    return load_model(local, device=device)


def _curve_with_val_names(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{(validation_name(k) if "@" in k else k): v for k, v in row.items()} for row in curve]
