"""Training: histories before a date -> a model version in the registry, and a gated alias move.

The training data is built by the same history code the nightly job serves from
(``recsys.data.history``), so the model sees at training time exactly the sequences it will be
scored on. Two fits (docs/quality.md, "What training registers"):

1. **select**: the newest item of each held-out user (every user with enough items, or the share
   ``train.held_out_share`` draws) held out; the epoch count is chosen on them (early stopping);
2. **refit** (``train.refit``, the default): every interaction before the date, newest items and items
   seen only there included, either from scratch for the chosen epoch count or, with
   ``train.refit_epochs``, continuing the selected model for that many epochs; this model is
   registered, so the night after scores with a model that knows yesterday.

The gate judges the *selection* model against the alias holder on held-out items that neither has
trained on: the newest items first touched on or after the holder's training date.

A night is **full** (the selection fit from scratch) or, with ``train.warm_start``, **warm**: the selection
fit starts from the alias holder's weights, its vocabulary grown by the items that appeared since
(:func:`recsys.model.warm.continued_model`), for at most ``train.warm_epochs`` epochs, early-stopped on the
held-out items the holder never trained on (the gate's users). A night trains in full when no full training
finished in the last ``train.full_every_nights`` nights, when the last training was warm and the gate found
it worse than the holder, or when there is no holder to start from (none, unreadable, another architecture,
trained on or after the date); the run records which kind it was and why (:func:`plan_training`).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pyspark.sql import SparkSession

from recsys import __version__
from recsys.config import Config
from recsys import fs as rfs
from recsys.data.contracts import parse_date, start_of_day_us
from recsys.data.readers import KeptWindow
from recsys.errors import GateError, InputDataError, TrackingFailed, first_line
from recsys.hooks import Hooks
from recsys.learning.distributed import FitJob, FitOutput, fit_with_processes
from recsys.learning.settings import model_config, train_settings
from recsys.learning.shards import (TrainingShards, remove_stale_attempts, training_events, training_window,
                                   training_work_dir, write_training_shards)
from recsys.learning.split import SplitData, StreamedHeldOut, mean_gain
from recsys.model.metrics import SELECTION_METRIC, validation_name
from recsys.model.repeats import RepeatBlend
from recsys.pipelines.timing import StageTimer
from recsys.sequences import Vocabulary
from recsys.spark.failures import recorded_error, spark_cause
from recsys.spark.session import job_description
from recsys.tracking import run_notes as run_record
from recsys.tracking import store as tracking
from recsys.tracking import tags
from recsys.redaction import redact_text, redact_uri

if TYPE_CHECKING:
    from recsys.learning.repeats import BlendDays
    from recsys.model.item_to_item import ItemToItem

log = logging.getLogger(__name__)
NO_HOOKS = Hooks()

VALIDATION_METRIC = validation_name(SELECTION_METRIC)   # val_ndcg@10: what the gate compares


FULL, WARM = "full", "warm"
# A refused candidate is "worse" (and a warm one sends the next night to a full training) only when it is
# below the holder by more than this many standard errors of the paired per-user difference; nearer, "close".
GATE_NOISE_Z = 1.96


@dataclass
class TrainResult:
    date: dt.date
    run_id: str
    version: str
    metrics: dict[str, float]
    promoted: bool
    decision: str
    curve: list[dict[str, Any]] = field(default_factory=list)
    kind: str = FULL                 # full | warm (TrainingPlan.kind)

    def summary(self) -> str:
        return (f"trained model version {self.version} (run {self.run_id}, {self.kind} training): "
                f"{VALIDATION_METRIC}={self.metrics.get(VALIDATION_METRIC, float('nan')):.4f}; {self.decision}")


@dataclass(frozen=True)
class TrainingPlan:
    """What kind of training tonight is, and why: full (from scratch) or warm (from the alias holder)."""

    kind: str                                 # full | warm
    reason: str                               # in words: logged, a run parameter and the run's note
    start_state: dict | None = None           # warm: the holder's weights over the selection vocabulary
    holder_version: str | None = None         # warm: the version it starts from
    since_us: int | None = None               # warm: validate on held-out items first touched since (epoch us)
    new_items: int = 0                        # warm: items in the vocabulary the holder did not know

    @classmethod
    def full(cls, reason: str) -> "TrainingPlan":
        return cls(FULL, reason)


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
class _Inputs:
    """What training's one read of the events wrote: the histories' shards and the repeat blend's days."""

    shards: TrainingShards
    blend_days: BlendDays | None      # None without train.repeats.learn


@dataclass
class _Training:
    """One training run under way: its data, settings and MLflow run, handed from step to step."""

    cfg: Config
    date: dt.date
    timer: StageTimer
    spark: SparkSession
    shards: TrainingShards            # what the executors wrote; nothing per user is on the driver
    vocab: Vocabulary                 # the selection fit's: items without each user's held-out newest
    full_vocab: Vocabulary            # the refit's: every item before the date, newest items included
    held_out: StreamedHeldOut         # each user's newest item, streamed from the shards (the gate's users)
    blend_days: BlendDays | None = None   # the repeat blend's held-out days, written with the shards
    work_dir: str = ""                # this attempt's shards/ and the training processes' logs/, removed at the end
    hooks: Hooks = NO_HOOKS
    device: Any = None
    recorder: Any = None              # tracking.RunRecorder, once the run is opened


def run_training(spark: SparkSession, cfg: Config, date: dt.date | str, *, force: bool = False,
                 hooks: Hooks = NO_HOOKS, kept: KeptWindow | None = None) -> TrainResult:
    """Train ``train.model`` on the histories before ``date``, register it as a new version, and move the
    alias unless the holder scores better on held-out items neither has trained on (``force`` moves it anyway).

    Steps: write the histories as shards (executors) -> vocabularies (item counts only) -> open the MLflow
    run -> select (early stopping on each user's held-out newest item) -> refit on everything
    (``train.refit``) -> register -> gate. The fits stream the shards, in this process or in
    ``train.processes`` data-parallel ones. Bad input raises InputDataError before any MLflow run
    exists; any failure after marks the run FAILED and registers nothing. The shards are removed at
    the end, and an attempt that died leaves none behind for the next: a rerun starts clean.
    ``kept``: the events window the process keeps for the night's stages after training (``recsys night``),
    read from there rather than again; the caller releases it.
    """
    import torch

    from recsys.scoring.core import resolve_device

    date = parse_date(date)
    timer = StageTimer(partial(job_description, spark), job=f"train {date}")
    remove_stale_attempts(cfg.paths.work, date)
    work_dir = training_work_dir(cfg, date)
    try:
        run = _prepare(spark, cfg, date, timer, _write(spark, cfg, date, timer, work_dir, kept), hooks)
        run.work_dir = work_dir
        run.device = resolve_device(cfg.train.device)
        model_cfg, settings = model_config(cfg.train.model, len(run.vocab)), train_settings(cfg.train, run.device)
        plan = plan_training(run, model_cfg, settings.seed)
        log.info("[train %s] %s training: %s", date, plan.kind, plan.reason)
        run.recorder = _open_run(run, model_cfg, settings, plan)
        hooks.pause("fitting")
        try:
            result, metrics = _fit(run, model_cfg, settings, plan)
            selection_model = result.model(model_cfg)
            final_model, final_items = selection_model, run.vocab.item_ids
            if cfg.train.refit:
                final_model, final_items = _refit(run, settings, result.best_epoch, selection_model, plan), \
                    run.full_vocab.item_ids
            blend = _repeat_blend(run, GateCandidate(selection_model, run.vocab.item_ids))
            new_items = _items_new_since_holder(cfg, final_items)
            version = _register(run, final_model, final_items, metrics, blend, plan, new_items)
            with timer.stage("gate", "compare with the alias holder") as c:
                gate = _gate(cfg, version, GateCandidate(selection_model, run.vocab.item_ids), run.held_out, force,
                             run.device)
                c.update(decision=gate.decision)
            promoted, decision = gate.promoted, gate.decision
            run.recorder.log_metrics(gate.figures)
            run.recorder.set_tags({tags.MODEL_VERSION: version, tags.PROMOTED: str(promoted), tags.GATE: decision,
                                   tags.GATE_VERDICT: gate.verdict})
            run_record.record_training(run.recorder, date, run_record.Inputs.of(cfg.paths, cfg.history),
                                       run_record.TrainingSummary(cfg.train.model.type, run.shards.users,
                                                                  len(final_items), metrics, cfg.mlflow.model_name,
                                                                  version, decision, plan.kind, plan.reason))
            run.recorder.end("FINISHED")
        except BaseException as exc:
            run.recorder.set_tags({tags.ERROR: redact_text(recorded_error(exc, spark_cause(exc)))[:4000]})
            run.recorder.end("FAILED")
            raise
        finally:
            torch.set_grad_enabled(True)
    finally:
        _remove(work_dir)
    log.info("[train %s] %s", date, decision)
    return TrainResult(date, run.recorder.run_id, version, metrics, promoted, decision, result.curve, plan.kind)


def _write(spark: SparkSession, cfg: Config, date: dt.date, timer: StageTimer, work_dir: str,
           kept: KeptWindow | None = None) -> _Inputs:
    """The events window read once (listed, footers checked, read and kept by Spark for this stage, or for the
    whole night by ``kept``) and written twice: as the training histories' shards and, with
    ``train.repeats.learn``, as the repeat blend's held-out days (:mod:`recsys.learning.repeats`; model-free, so
    written here rather than after the fits). On a log of many small daily partitions the second read used to
    cost as much as the first. Kept by :class:`~recsys.data.readers.KeptWindow` either way: the night's, or one
    of this stage's own."""
    blend_days = None
    with timer.stage("read", "read events, write the training histories as shards and the repeat blend's days") as c:
        own = kept is None                # kept: the window is already kept, for as long as the night needs it
        if own:
            kept = training_window(spark, cfg, date)
        try:
            events = training_events(spark, cfg, date, kept)
            shards = write_training_shards(spark, cfg, date, rfs.join(work_dir, "shards"), shards=cfg.train.shard_files,
                                           events=events)
            if cfg.train.repeats.learn and shards.interactions > 0:
                from recsys.learning.repeats import write_validation_days

                blend_days = write_validation_days(events, cfg, date, rfs.join(work_dir, "repeats"),
                                                   held_out_below=shards.held_out_below)
        finally:
            if own:
                kept.release()
        c.update(users=shards.users, interactions=shards.interactions, files=len(shards.files.paths),
                 **({"sampled_from_users": shards.sampled_from} if shards.sampled_from is not None else {}))
    if shards.interactions == 0:
        raise InputDataError(f"no events before {date} within history.window_days={cfg.history.window_days} "
                             f"under {redact_uri(cfg.paths.events)!r}; nothing to train on")
    return _Inputs(shards, blend_days)


def _prepare(spark: SparkSession, cfg: Config, date: dt.date, timer: StageTimer, inputs: _Inputs,
             hooks: Hooks) -> _Training:
    """The selection vocabulary (each user's newest item held out) and the refit's (everything), from the
    item counts the executors computed."""
    shards = inputs.shards
    with timer.stage("prepare", "build the vocabularies") as c:
        vocab = shards.items.vocabulary(cfg.train.min_item_count, held_out=True)
        full_vocab = shards.items.vocabulary(cfg.train.min_item_count, held_out=False)
        c.update(items=len(vocab), held_out_users=shards.held_out_users,
                 held_out_share=round(shards.held_out_share, 4), refit_items=len(full_vocab),
                 items_only_in_newest=len(full_vocab) - len(vocab))
    if len(vocab) < 2:
        raise InputDataError(f"only {len(vocab)} item(s) qualify for the vocabulary; need more events or a lower "
                             f"train.min_item_count")
    if cfg.train.processes > len(shards.files.paths):
        raise InputDataError(f"the histories fill {len(shards.files.paths)} shard file(s), fewer than "
                             f"train.processes={cfg.train.processes}: too few users for that many processes; "
                             "train with fewer processes")
    return _Training(cfg, date, timer, spark, shards, vocab, full_vocab,
                     StreamedHeldOut(shards.files, held_out_below=shards.held_out_below), hooks=hooks,
                     blend_days=inputs.blend_days)


def plan_training(run: _Training, model_cfg: Any, seed: int) -> TrainingPlan:
    """Full or warm tonight (see the module's docstring), and for a warm night where it starts.

    Reads the finished trainings from MLflow (their ``recsys.training_kind`` and ``recsys.gate_verdict``
    tags; a run without them trained in full) and loads the alias holder. Anything that stands in the way
    of a warm start makes the night full, with the reason recorded: a warm night is an optimisation, never
    a reason for the night to fail."""
    cfg, date = run.cfg, run.date
    if not cfg.train.warm_start:
        return TrainingPlan.full("train.warm_start is off")
    earlier = [t for t in tracking.finished_trainings(cfg.mlflow) if t.date < date]
    last_full = next((t.date for t in earlier if t.kind == FULL), None)
    every = cfg.train.full_every_nights
    if last_full is None:
        return TrainingPlan.full(f"no full training has finished before {date}")
    if (date - last_full).days >= every:
        return TrainingPlan.full(f"the last full training was for {last_full}, {(date - last_full).days} night(s) "
                                 f"ago (train.full_every_nights={every})")
    if earlier[0].kind == WARM and earlier[0].gate_verdict == "worse":
        return TrainingPlan.full(f"the warm training for {earlier[0].date} scored worse than the holder at the gate")
    name, alias = cfg.mlflow.model_name, cfg.mlflow.alias
    holder = tracking.alias_holder(name, alias)
    if holder is None:
        return TrainingPlan.full(f"no version holds @{alias} to start from")
    version = holder[0]
    try:
        loaded = _load_version(cfg, version, run.device)
    except Exception as exc:
        return TrainingPlan.full(f"the holder version {version} could not be loaded "
                                 f"({first_line(exc, with_type=True, limit=300)})")
    trained_before = loaded.metadata.get("trained_before")
    try:
        cutoff = parse_date(trained_before)
    except Exception:
        return TrainingPlan.full(f"the holder version {version} records no readable training date ({trained_before!r})")
    if cutoff >= date:
        return TrainingPlan.full(f"the holder version {version} trained on the events before {cutoff}, not before {date}")
    from recsys.model.warm import continued_model

    try:
        start = continued_model(loaded.model, loaded.item_ids, run.vocab.item_ids, model_cfg, seed)
    except ValueError as exc:
        return TrainingPlan.full(f"the holder version {version} is not the configured model "
                                 f"({first_line(exc, limit=300)})")
    new_items = int(len(run.vocab) - np.isin(run.vocab.item_ids, np.asarray(loaded.item_ids)).sum())
    return TrainingPlan(WARM, f"starting from version {version} (trained before {cutoff}; {last_full} was the last "
                              f"full training), {new_items} new item(s)",
                        start.state_dict(), version, start_of_day_us(cutoff), new_items)


def _open_run(run: _Training, model_cfg: Any, settings: Any, plan: TrainingPlan) -> Any:
    """The training's MLflow run, with what it is about to do as parameters; training without a
    record is refused (TrackingFailed): the version it registers must point at a run."""
    cfg, date = run.cfg, run.date
    recorder = tracking.RunRecorder(cfg.mlflow, run_name=f"train {date}",
                                    experiment=tracking.training_experiment(cfg.mlflow),
                                    tags={tags.JOB: tags.TRAIN_JOB, tags.DATE: str(date), tags.VERSION: __version__,
                                          tags.TRAINING_KIND: plan.kind, tags.MODEL_NAME: cfg.mlflow.model_name})
    if recorder.failed:
        raise TrackingFailed(f"cannot record the training run in {redact_uri(cfg.mlflow.tracking_uri)}: {recorder.error}")
    recorder.log_params({
        "date": str(date), "model_type": cfg.train.model.type, **{f"model_{k}": v for k, v in model_cfg.__dict__.items()},
        **{f"train_{k}": v for k, v in settings.__dict__.items()}, "device": str(run.device),
        "window_days": cfg.history.window_days, "train_history_items": cfg.train.history_items,
        "users": run.shards.users, "validation_users": run.shards.held_out_users,
        "held_out_share": round(run.shards.held_out_share, 4), "config_digest": cfg.digest(),
        "refit": cfg.train.refit, "refit_epochs": cfg.train.refit_epochs, "refit_items": len(run.full_vocab),
        "gate_min_users": cfg.train.gate_min_users,
        "processes": cfg.train.processes, "shard_files": len(run.shards.files.paths),
        "max_users": cfg.train.max_users, "sampled_from_users": run.shards.sampled_from,
        "training_kind": plan.kind, "training_reason": plan.reason[:5000], "warm_from_version": plan.holder_version,
        "warm_epochs": cfg.train.warm_fit_epochs if plan.kind == WARM else None,
        "warm_new_items": plan.new_items if plan.kind == WARM else None,
        "warm_replay_share": cfg.train.warm_replay_share if plan.kind == WARM else None,
    })
    return recorder


def _job(run: _Training, label: str, model_cfg: Any, settings: Any, vocab: Vocabulary, *, hold_out: bool,
         stop_after: int | None = None) -> FitJob:
    return FitJob(label=f"[train {run.date}] {label}", files=run.shards.files.paths, vocab_ids=vocab.item_ids,
                  model_config=model_cfg, settings=settings, hold_out_newest=hold_out, validate=hold_out,
                  held_out_below=run.shards.held_out_below if hold_out else None,
                  stop_after=stop_after, device=str(run.device), faults=run.hooks.faults,
                  log_dir=rfs.join(run.work_dir, "logs", label))


def _fit(run: _Training, model_cfg: Any, settings: Any, plan: TrainingPlan) -> tuple[FitOutput, dict[str, float]]:
    """Train with early stopping on the held-out items, logging each epoch; the best epoch's figures.
    Warm (``plan``): from the holder's weights, at most ``train.warm_epochs``, validated on the held-out
    items the holder never trained on."""
    from recsys.tracking import plots

    recorder = run.recorder

    def on_epoch(row: dict[str, Any]) -> None:
        recorder.log_metrics({validation_name(k) if "@" in k else k: v for k, v in row.items() if k != "epoch"},
                             step=int(row["epoch"]))

    job = _job(run, "select", model_cfg, settings, run.vocab, hold_out=True)
    what = "train model (select the epoch count)"
    if plan.kind == WARM:
        job = dataclasses.replace(job, label=f"[train {run.date}] warm", init_state=plan.start_state,
                                  stop_after=run.cfg.train.warm_fit_epochs, validate_since_us=plan.since_us,
                                  **_replay(run, plan))
        what = f"train model (warm: from version {plan.holder_version}, at most {run.cfg.train.warm_fit_epochs} epochs)"
    with run.timer.stage("fit", what) as c:
        result = fit_with_processes(run.spark, job, run.cfg.train.processes, on_epoch)
        c.update(kind=plan.kind, best_epoch=result.best_epoch, epochs=len(result.curve), processes=result.processes,
                 trained_users=result.users,
                 **{k: round(v, 4) for k, v in result.best_metrics.items()})
    if result.processes > 1:   # the processes could not reach MLflow: the curve is logged now
        for row in result.curve:
            on_epoch(row)
    metrics = {validation_name(k): v for k, v in result.best_metrics.items()}
    metrics["best_epoch"] = result.best_epoch
    # the epochs that ran: past the best by train.patience epochs or train.patience_windows windows, or the cap
    recorder.log_metrics({**metrics, "fit_users": result.users, "fit_epochs": len(result.curve),
                          **run.timer.as_metrics()})
    recorder.log_figure(plots.learning_curve(_curve_with_val_names(result.curve), VALIDATION_METRIC),
                        "plots/learning_curve.png")
    return result, metrics


def _replay(run: _Training, plan: TrainingPlan) -> dict[str, Any]:
    """A warm night's users (:class:`recsys.model.stream.Replay`): those active since the holder's training date
    and ``train.warm_replay_share`` of the others, drawn anew each night (the date is the draw's salt)."""
    if plan.kind != WARM or plan.since_us is None:
        return {}
    return {"replay_since_us": plan.since_us, "replay_share": run.cfg.train.warm_replay_share,
            "replay_salt": run.date.toordinal()}


def _refit(run: _Training, settings: Any, epochs: int, selected: Any, plan: TrainingPlan) -> Any:
    """The registered model, trained on every interaction before the date (no held-out items, so no early
    stop). From scratch (``train.refit_epochs`` null): the selection's settings for its chosen epoch count,
    the learning-rate schedule keeping the selection's horizon, so the refit repeats its first epochs.
    Continued (``train.refit_epochs: N``): the selected model's weights, its vocabulary grown by the items
    seen only in the newest interactions (:func:`recsys.model.warm.grown_state`), for N more epochs; on a warm
    night, on the warm fit's users (the active ones and the replayed share of the others)."""
    from recsys.model.warm import continued_model

    def on_epoch(row: dict[str, Any]) -> None:
        run.recorder.log_metrics({"refit_train_loss": row["train_loss"]}, step=int(row["epoch"]))

    model_cfg = model_config(run.cfg.train.model, len(run.full_vocab))
    init_state, how = None, "from scratch"
    if run.cfg.train.continue_epochs is not None:
        epochs, how = run.cfg.train.continue_epochs, "continuing the selected model"
        init_state = continued_model(selected, run.vocab.item_ids, run.full_vocab.item_ids, model_cfg,
                                     settings.seed).state_dict()
    with run.timer.stage("refit", f"train on every interaction for {epochs} epochs, {how}") as c:
        job = _job(run, "refit", model_cfg, settings, run.full_vocab, hold_out=False, stop_after=max(1, epochs))
        if init_state is not None:
            job = dataclasses.replace(job, **_replay(run, plan))
        result = fit_with_processes(run.spark, dataclasses.replace(job, init_state=init_state),
                                    run.cfg.train.processes, on_epoch)
        c.update(epochs=len(result.curve), items=len(run.full_vocab), trained_users=result.users)
    if result.processes > 1:
        for row in result.curve:
            on_epoch(row)
    run.recorder.log_metrics({"refit_epochs": len(result.curve), "refit_users": result.users,
                              **run.timer.as_metrics()})
    return result.model(model_cfg)


def _repeat_blend(run: _Training, ranker: "GateCandidate") -> RepeatBlend | None:
    """How the user's known items compete with new ones, chosen on the days before the date
    (:mod:`recsys.model.repeats`); None with ``train.repeats.learn`` off (known items masked).

    The new items are ranked by the selection model, which never trained on each user's newest item: the
    refit model trained on the very days the blend is judged on, and would make new items look better."""
    if run.blend_days is None:        # written in the read stage exactly when train.repeats.learn is on
        return None
    from recsys.learning.repeats import describe, fit_repeat_blend

    with run.timer.stage("repeats", "choose how known items compete with new ones") as c:
        blend = fit_repeat_blend(run.cfg, run.date, ranker, run.device, run.blend_days)
        c.update(blend=describe(blend), rows=blend.figures.get("validation_rows", 0))
    run.recorder.log_params({"repeat_bias": "masked" if blend.masks_known else blend.repeat_bias,
                             "repeat_age_weight": blend.age_weight, "repeat_new_rank_weight": blend.new_rank_weight,
                             "repeat_popularity_weight": blend.popularity_weight,
                             "repeat_item_to_item_weight": blend.item_to_item_weight,
                             "repeat_objective": run.cfg.train.repeats.objective})
    run.recorder.log_metrics({f"repeats_{k}": v for k, v in blend.figures.items() if isinstance(v, (int, float))
                              and math.isfinite(v)})
    return blend


def _remove(work_dir: str) -> None:
    try:
        fs, path = rfs.resolve(work_dir)
        rfs.delete_dir_if_exists(fs, path)
    except OSError as exc:   # a rerun removes it (remove_stale_attempts)
        log.warning("could not remove the training shards under %s: %s", redact_uri(work_dir), exc)


def _items_new_since_holder(cfg: Config, item_ids: np.ndarray) -> np.ndarray | None:
    """The items of ``item_ids`` the alias holder's vocabulary lacks (what this version will be the first to
    recommend), or None with no holder, or one whose vocabulary cannot be read (the gate says why)."""
    from recsys.model.io import read_item_ids

    holder = tracking.alias_holder(cfg.mlflow.model_name, cfg.mlflow.alias)
    if holder is None:
        return None
    try:
        local = tracking.model_version_dir(cfg.mlflow.model_name, holder[0], cfg.paths.driver_dir / "models")
        known = read_item_ids(local)
    except Exception as exc:
        log.warning("the holder version %s's items could not be read (%s): new items are not recorded", holder[0],
                    first_line(exc, with_type=True, limit=300))
        return None
    return np.setdiff1d(np.asarray(item_ids, dtype=np.int64), known.astype(np.int64))


def _register(run: _Training, model: Any, item_ids: np.ndarray, metrics: dict[str, float],
              blend: RepeatBlend | None, plan: TrainingPlan, new_item_ids: np.ndarray | None = None) -> str:
    """The model's files (and its repeat blend) logged to the run and registered as a new version of
    ``mlflow.model_name``."""
    from recsys.model.io import save_model

    recorder = run.recorder
    if new_item_ids is not None:
        recorder.log_metrics({"new_items": len(new_item_ids)})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(model.cpu(), item_ids, Path(tmp) / "model",
                               metadata={"trained_before": str(run.date), "run_id": recorder.run_id,
                                         VALIDATION_METRIC: metrics.get(VALIDATION_METRIC),
                                         "refit": run.cfg.train.refit, "epochs": int(metrics["best_epoch"]),
                                         "refit_epochs": run.cfg.train.continue_epochs if run.cfg.train.refit else None,
                                         "held_out_share": round(run.shards.held_out_share, 4),
                                         "training_kind": plan.kind, "warm_from_version": plan.holder_version,
                                         "new_items": None if new_item_ids is None else len(new_item_ids)},
                               blend=blend, new_item_ids=new_item_ids, item_to_item=_night_item_to_item(run, blend))
        recorder.log_artifacts(model_dir, "model")
    artifact_uri = recorder.artifact_uri("model")
    if recorder.failed or artifact_uri is None:
        raise TrackingFailed(f"the training run could not be recorded: {recorder.error}")
    return tracking.register_version(run.cfg.mlflow.model_name, recorder.run_id, artifact_uri,
                                     description=f"trained on events before {run.date}")


def _night_item_to_item(run: _Training, blend: RepeatBlend | None) -> "ItemToItem | None":
    """The item-to-item weights fitted on the whole window, saved with the model when the blend weighs them."""
    if blend is None or not blend.item_to_item_weight or run.blend_days is None:
        return None
    return run.blend_days.item_to_item.night if run.blend_days.item_to_item is not None else None


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
    verdict: str = "undecided"   # promoted | worse (kept: the holder scored better beyond the noise) | close
                                 # (kept: lower, within the paired noise; not a failure for the next night's plan)
                                 # | undecided (kept: too few users to judge on) | forced (--force moved the alias)


def _gate(cfg: Config, version: str, candidate: GateCandidate, split: SplitData | StreamedHeldOut, force: bool,
          device) -> GateDecision:
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
        return GateDecision(True, f"promoted version {version} to @{alias}: no version held the alias",
                            verdict="promoted")
    holder_version, _ = holder
    tolerance = cfg.train.gate_tolerance
    try:
        loaded = _load_version(cfg, holder_version, device)
        judged, basis = held_out_unseen_by(split, loaded.metadata.get("trained_before"), holder_version)
        enough = judged.users >= cfg.train.gate_min_users
        holder_gains = judged.user_gains(loaded.model, loaded.item_ids, device) if enough or force else None
    except Exception as exc:
        problem = f"the holder version {holder_version} could not be scored ({first_line(exc, with_type=True, limit=300)})"
        if force:
            tracking.set_alias(name, alias, version)
            return GateDecision(True, f"promoted version {version} to @{alias} because of --force; {problem}",
                                verdict="forced")
        raise GateError(f"kept @{alias} on version {holder_version}: {problem}; fix or remove that version, "
                        f"or move the alias to version {version} with --force") from exc
    figures = {"gate_users": float(judged.users)}
    if not enough and not force:
        return GateDecision(False, f"kept @{alias} on version {holder_version}: only {judged.users} held-out "
                                   f"user(s) {basis}, fewer than train.gate_min_users={cfg.train.gate_min_users} to "
                                   f"judge on; the set grows every night the holder stays, or use --force", figures)
    new_gains = judged.user_gains(candidate.model.to(device), candidate.item_ids, device)   # _register: on CPU
    new_score, holder_score = mean_gain(new_gains), mean_gain(holder_gains)
    figures.update({"gate_candidate_" + SELECTION_METRIC: new_score, "gate_holder_" + SELECTION_METRIC: holder_score})
    detail = (f"new {SELECTION_METRIC}={new_score:.4f} vs holder version {holder_version} {holder_score:.4f} on "
              f"{judged.users} held-out user(s) {basis} (tolerance {tolerance})")
    figures = {k: v for k, v in figures.items() if np.isfinite(v)}
    if force:
        tracking.set_alias(name, alias, version)
        return GateDecision(True, f"promoted version {version} to @{alias} because of --force; {detail}", figures,
                            "forced")
    if new_score >= holder_score - tolerance:
        tracking.set_alias(name, alias, version)
        return GateDecision(True, f"promoted version {version} to @{alias}: not worse than the holder; {detail}",
                            figures, "promoted")
    gap = holder_score - tolerance - new_score          # > 0: how far below the holder, beyond the tolerance
    se = paired_standard_error(new_gains, holder_gains)
    figures["gate_difference_se"] = se
    if refused_verdict(gap, se) == "close":
        return GateDecision(False, f"kept @{alias} on version {holder_version}: the new version scores lower, by "
                                   f"{gap:.4f} beyond the tolerance, within the noise ({GATE_NOISE_Z} standard "
                                   f"errors of the paired difference: {GATE_NOISE_Z * se:.4f}); {detail}; use "
                                   "--force to override", figures, "close")
    return GateDecision(False, f"kept @{alias} on version {holder_version}: the new version scores worse; {detail}, "
                               f"{gap:.4f} beyond it, more than {GATE_NOISE_Z} standard errors of the paired "
                               f"difference ({GATE_NOISE_Z * se:.4f}); use --force to override", figures, "worse")


def refused_verdict(gap: float, se: float) -> str:
    """A refused candidate, ``gap`` below the holder beyond the tolerance: ``worse`` when the gap is more than
    ``GATE_NOISE_Z`` standard errors ``se`` of the paired difference, else ``close``.

    >>> refused_verdict(0.0017, 0.004), refused_verdict(0.02, 0.004)
    ('close', 'worse')
    """
    return "close" if gap <= GATE_NOISE_Z * se else "worse"


def paired_standard_error(new: np.ndarray, holder: np.ndarray) -> float:
    """The standard error of the mean of ``new - holder`` (per-user figures of two versions on the same users).

    What tells a gap the gate sees from the noise of which users happened to be held out: a candidate refused by
    less than that is no evidence that warm training went wrong (docs/training.md, "Warm nights").

    >>> round(paired_standard_error(np.array([0.5, 1.0, 0.0, 0.5]), np.array([0.5, 0.5, 0.0, 0.0])), 4)
    0.1443
    """
    new, holder = np.asarray(new, dtype=np.float64), np.asarray(holder, dtype=np.float64)
    if len(new) != len(holder) or len(new) < 2:   # nothing to pair: no noise to grant, so a refusal stays "worse"
        return 0.0
    return float((new - holder).std(ddof=1) / math.sqrt(len(new)))


def held_out_unseen_by(split: SplitData | StreamedHeldOut, trained_before: str | None, holder: str) -> tuple[Any, str]:
    """The held-out users whose newest item the holder cannot have trained on, and how they were chosen."""
    if trained_before is None or getattr(split, "valid_first_us", 0) is None:
        return split, f"(all of them: version {holder} records no training date)"
    try:
        cutoff = parse_date(trained_before)
    except Exception:
        return split, f"(all of them: version {holder} records an unreadable training date {trained_before!r})"
    return split.since(start_of_day_us(cutoff)), f"whose newest item was first touched on or after {cutoff} (version {holder} trained before it)"


def _load_version(cfg: Config, version: str, device):
    from recsys.model.io import load_model

    local = tracking.model_version_dir(cfg.mlflow.model_name, version, cfg.paths.driver_dir / "models")
    return load_model(local, device=device)


def _curve_with_val_names(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{(validation_name(k) if "@" in k else k): v for k, v in row.items()} for row in curve]
