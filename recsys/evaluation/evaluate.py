"""``recsys evaluate``: the project's models and the baselines on one protocol, one table, one MLflow run.

For every model the same three steps, and nothing of the test phase before the last one:

1. **fit** on the validation phase's histories (:mod:`recsys.evaluation.protocols`);
2. **choose** on the validation targets: the epoch of a neural model (early stopping on validation
   NDCG@10, the same rule as ``recsys train``), the grid point of ALS;
3. **test** on the test phase. As ``recsys train`` does (``train.refit``), a neural model is trained
   on the test-phase histories (which hold the validation interactions): continued for
   ``train.refit_epochs`` epochs from the chosen model, or from scratch for its chosen epoch count
   when that is null; it reads each user's test-phase history when scored; the model fitted
   on the validation phase alone, which has never trained on those newest interactions, is a row of
   its own (``<model>-heldout``) for the default model: what training registered before the refit.
   ALS is refitted with the chosen point on the test-phase histories; popularity is counted on them.

Then the comparison (:mod:`recsys.evaluation.report`): means, 95% bootstrap intervals over test
users, paired differences to ALS, printed, written as ``--json`` and logged to MLflow in the
experiment ``<mlflow.experiment>-evaluation``.
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from recsys import __version__
from recsys.config import Config
from recsys.errors import ConfigError, InputDataError
from recsys.evaluation import protocols
from recsys.evaluation.protocols import EvalSplit
from recsys.evaluation.ranking import (VALID_SELECTION, PhaseResult, RankingScorer, SequenceModelScorer, merge_seeds,
                                      rank_phase)
from recsys.evaluation.report import Bootstrap, Comparison, compare, format_table, write_json
from recsys.model.metrics import SELECTION_K, SELECTION_METRIC
from recsys.model.registry import MODEL_TYPES
from recsys.tracking import store as tracking
from recsys.tracking import tags
from recsys.redaction import redact_uri

log = logging.getLogger(__name__)

REFERENCE = "als"


@dataclass(frozen=True)
class EvaluationRequest:
    """What ``recsys evaluate`` was asked: one protocol on one dataset (the command's options)."""

    data: str | Path                      # a dataset root in the input layout (events/, catalog/)
    protocol: str                         # loo | temporal
    ks: tuple[int, ...] | None = None     # cut-offs of the table (default: evaluation.ks)
    tie_break_seed: int | None = None     # default: history.tie_break_seed
    split_date: dt.date | None = None     # temporal: the cut (default: test_days before the last event)
    test_days: int = 30
    json_path: Path | None = None
    device: str | None = None             # default: train.device
    seeds: int = 1                        # trainings per sequence model: train.seed, train.seed + 1, ...


@dataclass
class EvaluationResult:
    comparison: Comparison
    table: str
    split_info: dict[str, Any]
    run_id: str | None
    details: dict[str, Any] = field(default_factory=dict)    # per model: chosen epoch / grid point, seconds


@dataclass
class _Evaluation:
    """One evaluation under way: what every model's step reads, and what the sequence models share."""

    spark: Any
    cfg: Config
    split: EvalSplit
    device: Any
    ranking_ks: tuple[int, ...]
    vocab: Any = None              # built once, on first use: every sequence model trains on the same items
    train_seqs: Any = None
    test_vocab: Any = None         # the refit's, likewise: the test phase's histories
    test_seqs: Any = None

    def validation_score(self, scorer: RankingScorer) -> float:
        """The selection metric on the validation phase: what every model is chosen on."""
        return rank_phase(scorer, self.split.valid, (SELECTION_K,), device=self.device).means()[SELECTION_METRIC]


@dataclass
class _Fitted:
    """A model fitted and chosen on validation, ready to rank the test phase."""

    scorer: RankingScorer
    details: dict[str, Any]
    curve: list[dict] | None = None
    extra_rows: list[tuple[str, RankingScorer, dict[str, Any]]] = field(default_factory=list)   # variants of it


def run_evaluation(spark, cfg: Config, request: EvaluationRequest) -> EvaluationResult:
    """Evaluate ``cfg.evaluation.models`` on ``request.data``: split, then per model fit -> choose -> test,
    then compare, print and record."""
    from recsys.scoring.core import resolve_device

    if request.protocol not in protocols.PROTOCOLS:
        raise ConfigError(f"unknown protocol {request.protocol!r}; choose one of {', '.join(protocols.PROTOCOLS)}")
    ev = cfg.evaluation
    ks = tuple(sorted(set(request.ks or ev.ks)))
    if any(k < 1 for k in ks):
        raise ConfigError(f"every --k must be at least 1, got {list(ks)}")
    tie_seed = cfg.history.tie_break_seed if request.tie_break_seed is None else request.tie_break_seed
    data = check_dataset_root(request.data)
    split = _load_split(spark, cfg, request, data, tie_seed)
    run = _Evaluation(spark, cfg, split, resolve_device(request.device or cfg.train.device),
                      tuple(sorted(set(ks) | {SELECTION_K})))

    if request.seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {request.seeds}")
    results: dict[str, PhaseResult] = {}
    details: dict[str, Any] = {}
    curves: dict[str, list[dict]] = {}
    for name in ev.models:
        started = time.perf_counter()
        seeds = [cfg.train.seed + i for i in range(request.seeds)] if name in MODEL_TYPES else [None]
        fits = []
        for seed in seeds:
            if seed is not None and len(seeds) > 1:
                log.info("[evaluate] %s: training with seed %d (%d of %d)", name, seed, len(fits) + 1, len(seeds))
            fits.append(_fit(name)(run, name, seed))
        test = partial(rank_phase, phase=split.test, ks=run.ranking_ks, device=run.device)
        results[name] = merge_seeds([test(f.scorer) for f in fits])
        details[name] = {**_merge_details([f.details for f in fits], seeds), "seconds": round(time.perf_counter() - started, 1)}
        if fits[0].curve is not None:
            curves[name] = fits[0].curve
        log.info("[evaluate] %s: test %s (%.1f s)", name,
                 ", ".join(f"{k}={v:.4f}" for k, v in results[name].means().items() if k.startswith("ndcg")),
                 details[name]["seconds"])
        for j, (row, _, _) in enumerate(fits[0].extra_rows):   # right after the model's own row
            results[row] = merge_seeds([test(f.extra_rows[j][1]) for f in fits])
            details[row] = _merge_details([f.extra_rows[j][2] for f in fits], seeds)
        for row in [name, *(r[0] for r in fits[0].extra_rows)]:
            if results[row].seeds > 1:
                details[row]["seed_" + SELECTION_METRIC] = [round(v, 4) for v in results[row].seed_means(SELECTION_METRIC)]

    default = cfg.train.model.type if cfg.train.model.type in results else None
    comparison = compare(results, protocol=request.protocol, ks=ks, candidates=len(split.test.candidates),
                         reference=REFERENCE, bootstrap=Bootstrap(ev.bootstrap_resamples, ev.bootstrap_seed),
                         pairs=[(d["heldout_of"], row) for row, d in details.items() if "heldout_of" in d])
    comparison.default_model = default
    comparison.notes.update(_notes(details))
    table = format_table(comparison)
    if request.json_path is not None:
        write_json(comparison, Path(request.json_path))
    record = _Record(data, request.protocol, ks, tie_seed, split, comparison, table, details, curves, request.seeds)
    return EvaluationResult(comparison, table, split.info, _record(cfg, record), details)


def _load_split(spark, cfg: Config, request: EvaluationRequest, data: str, tie_seed: int) -> EvalSplit:
    started = time.perf_counter()
    if request.protocol == "loo":
        split = protocols.load_loo(spark, data, tie_break_seed=tie_seed, event_types=cfg.history.event_types)
    else:
        split = protocols.load_temporal(spark, data, split_date=request.split_date, test_days=request.test_days,
                                        tie_break_seed=tie_seed, event_types=cfg.history.event_types)
    log.info("[evaluate] %s split: %s (%.1f s)", request.protocol, split.info, time.perf_counter() - started)
    return split


def _fit(name: str):
    """The step that fits and chooses one model kind (``EvaluationConfig`` has checked the names)."""
    if name in MODEL_TYPES:
        return _fit_sequence_model
    return {"popularity": _fit_popularity, REFERENCE: _fit_als}[name]


def _merge_details(each: list[dict[str, Any]], seeds: list[int | None]) -> dict[str, Any]:
    """One row's details; with several seeds, what differs between them as lists, seed by seed."""
    if len(each) == 1:
        return dict(each[0])
    merged: dict[str, Any] = {"seeds": seeds}
    for key, value in each[0].items():
        values = [d.get(key) for d in each]
        merged[key] = value if all(v == value for v in values) else values
    return merged


def _fit_popularity(run: _Evaluation, name: str, seed: int | None = None) -> _Fitted:
    """Counted on the validation histories to be scored there; on the test histories to be tested."""
    from recsys.evaluation.baselines import popularity_scorer

    return _Fitted(popularity_scorer(run.split.test),
                   {VALID_SELECTION: run.validation_score(popularity_scorer(run.split.valid))})


def _fit_als(run: _Evaluation, name: str, seed: int | None = None) -> _Fitted:
    """The grid searched on validation; the chosen point refitted with the validation interactions."""
    from recsys.evaluation.baselines import als_grid, search_als

    als = run.cfg.evaluation.als
    grid = als_grid(list(als.ranks), list(als.reg_params), list(als.alphas), als.max_iter, als.seed, als.blocks)
    search = search_als(run.spark, run.split.valid, run.split.test, grid, run.validation_score)
    return _Fitted(search.scorer, {"chosen": search.chosen.label(), VALID_SELECTION: search.chosen_score,
                                   "grid": search.grid})


def _fit_sequence_model(run: _Evaluation, name: str, seed: int | None = None) -> _Fitted:
    """Trained on the validation histories with early stopping on the selection metric, then (with
    ``train.refit``, as ``recsys train``) trained again for the chosen epoch count on the test-phase
    histories; tested on each user's test-phase history. Rows of their own: the held-out fit, for the
    default model when it is refitted (the comparison of issue 20), and with ``scoring.dtype`` other
    than float32, the tested model ranked through the job's scoring core."""
    from dataclasses import replace

    from recsys.evaluation.ranking import CoreScorer
    from recsys.learning.settings import model_config, train_settings
    from recsys.learning.split import build_vocabulary
    from recsys.model.training import FitCallbacks, fit

    cfg, split, device = run.cfg, run.split, run.device
    if run.vocab is None:
        run.vocab = build_vocabulary(split.valid.history, cfg.train.min_item_count)
        if len(run.vocab) < 2:
            raise InputDataError(f"only {len(run.vocab)} item(s) in the validation histories; too little data")
        run.train_seqs, _ = run.vocab.map_sequences(split.valid.history)
    item_ids = run.vocab.item_ids
    model_cfg = model_config(cfg.train.model, len(run.vocab), name)

    def validate(model) -> dict[str, float]:
        return rank_phase(SequenceModelScorer(model, item_ids, split.valid, device), split.valid,
                          (SELECTION_K,), device=device).means()

    def progress(row: dict) -> None:
        score = f"{row[SELECTION_METRIC]:.4f}" if SELECTION_METRIC in row else "-"
        log.info("[evaluate] %s epoch %d: loss %.4f, valid %s %s (%.1f s)", name, row["epoch"], row["train_loss"],
                 SELECTION_METRIC, score, row["seconds"])

    settings = train_settings(cfg.train, device)
    if seed is not None:
        settings = replace(settings, seed=seed)
    fitted = fit(run.train_seqs, model_cfg, settings, device=device, valid=validate,
                 callbacks=FitCallbacks(progress=progress))
    details = {"best_epoch": fitted.best_epoch, "epochs_run": len(fitted.curve),
               VALID_SELECTION: fitted.best_metrics.get(SELECTION_METRIC),
               "config": {k: v for k, v in model_cfg.__dict__.items()}}
    model, tested_items, extra_rows = fitted.model, item_ids, []
    if cfg.train.refit:
        if run.test_vocab is None:
            run.test_vocab = build_vocabulary(split.test.history, cfg.train.min_item_count)
            run.test_seqs, _ = run.test_vocab.map_sequences(split.test.history)
        started = time.perf_counter()
        refit_cfg = model_config(cfg.train.model, len(run.test_vocab), name)
        epochs, start, how = fitted.best_epoch, None, "from scratch"
        if cfg.train.continue_epochs is not None:  # as recsys train: continue the selected model, vocabulary grown
            from recsys.model.warm import continued_model

            epochs, how = cfg.train.continue_epochs, "continuing the selected model"
            start = continued_model(fitted.model, item_ids, run.test_vocab.item_ids, refit_cfg, settings.seed)
        model = fit(run.test_seqs, refit_cfg if start is None else start, settings, device=device,
                    stop_after=epochs).model
        tested_items = run.test_vocab.item_ids
        details.update(refit_epochs=epochs, refit_seconds=round(time.perf_counter() - started, 1))
        log.info("[evaluate] %s refitted on the test-phase histories for %d epochs, %s (%.1f s)", name,
                 epochs, how, details["refit_seconds"])
        if name == cfg.train.model.type:
            extra_rows.append((f"{name}-heldout", SequenceModelScorer(fitted.model, item_ids, split.test, device),
                               {"heldout_of": name, "best_epoch": fitted.best_epoch}))
    if cfg.scoring.dtype != "float32":
        top = max(max(run.ranking_ks), cfg.scoring.top_n)
        extra_rows.append((f"{name}@{cfg.scoring.dtype}",
                           CoreScorer(model, tested_items, split.test, top, cfg.scoring.dtype, device),
                           {"scored_by": "recsys.scoring.core", "dtype": cfg.scoring.dtype}))
    return _Fitted(SequenceModelScorer(model, tested_items, split.test, device), details, fitted.curve, extra_rows)


def check_dataset_root(data: str | Path) -> str:
    """Fail before any Spark work when a local ``--data`` is not a dataset root in the input layout."""
    data = str(data)
    if "://" not in data and not (Path(data, "events").is_dir() and Path(data, "catalog").is_dir()):
        raise InputDataError(f"{data} has no events/ and catalog/ directories: --data must be a dataset root in the "
                             "input layout (events/dt=.../, catalog/dt=.../), e.g. what `recsys import-movielens "
                             "--out DIR` writes")
    return data


def _notes(details: dict[str, Any]) -> dict[str, str]:
    notes = {}
    for name, d in details.items():
        parts = []
        if "seeds" in d:
            parts.append(f"{len(d['seeds'])} trainings, seeds {', '.join(map(str, d['seeds']))}")
        if "heldout_of" in d:
            parts.append(f"the row above's model before its refit: trained on the validation phase only, "
                         f"epoch {_each(d['best_epoch'])}")
        elif "best_epoch" in d:
            parts.append(f"epoch {_each(d['best_epoch'])} of {_each(d['epochs_run'])} chosen on validation")
        if "refit_epochs" in d:
            parts.append(f"refitted for {_each(d['refit_epochs'])} epochs on the test-phase histories")
        if "seed_" + SELECTION_METRIC in d:
            parts.append(f"test {SELECTION_METRIC} by seed {' / '.join(f'{v:.4f}' for v in d['seed_' + SELECTION_METRIC])}")
        if "chosen" in d:
            parts.append(f"{d['chosen']} chosen on validation from {len(d['grid'])} points, refitted with the "
                         "validation interactions")
        if d.get(VALID_SELECTION) is not None:
            value = d[VALID_SELECTION]
            shown = " / ".join(f"{v:.4f}" for v in value) if isinstance(value, list) else f"{value:.4f}"
            parts.append(f"validation {SELECTION_METRIC} {shown}")
        if "scored_by" in d:   # a row ranked through the job's core at another dtype: no training of its own
            parts.append(f"the row above's model, ranked by {d['scored_by']} in {d['dtype']}")
        if "seconds" in d:
            parts.append(f"{d['seconds']:.0f} s")
        notes[name] = "; ".join(parts)
    return notes


def _each(value: Any) -> str:
    """A detail that may differ by seed: one value, or the seeds' values joined."""
    return "/".join(map(str, value)) if isinstance(value, list) else str(value)


@dataclass(frozen=True)
class _Record:
    """What one evaluation's MLflow run holds."""

    data: str
    protocol: str
    ks: tuple[int, ...]
    tie_seed: int
    split: EvalSplit
    comparison: Comparison
    table: str
    details: dict[str, Any]
    curves: dict[str, list[dict]]
    seeds: int = 1


def _record(cfg: Config, r: _Record) -> str | None:
    """One MLflow run: protocol and seeds as parameters, per-model metrics, the table as an artifact."""
    from recsys.tracking import plots

    comparison, details = r.comparison, r.details
    recorder = tracking.RunRecorder(cfg.mlflow, run_name=f"evaluate {r.protocol}",
                                    experiment=f"{cfg.mlflow.experiment}-evaluation",
                                    tags={tags.JOB: tags.EVALUATE_JOB, tags.PROTOCOL: r.protocol,
                                          tags.VERSION: __version__})
    recorder.log_params({
        "protocol": r.protocol, "data": r.data, "k": list(r.ks), "tie_break_seed": r.tie_seed,
        "bootstrap_resamples": cfg.evaluation.bootstrap_resamples, "bootstrap_seed": cfg.evaluation.bootstrap_seed,
        "train_seed": cfg.train.seed, "seeds": r.seeds, "als_seed": cfg.evaluation.als.seed, "models": list(comparison.models),
        "default_model": comparison.default_model, "config_digest": cfg.digest(),
        **{f"split_{k}": v for k, v in r.split.info.items()},
        **{f"{name}_chosen": d["chosen"] for name, d in details.items() if "chosen" in d},
        **{f"{name}_best_epoch": d["best_epoch"] for name, d in details.items() if "epochs_run" in d},
        "refit": cfg.train.refit,
    })
    metrics: dict[str, float] = {}
    for name, values in comparison.models.items():
        metrics.update({f"{name}.{m}": v for m, v in values.items() if v is not None and np.isfinite(v)})
        for m, (lo, hi) in comparison.intervals.get(name, {}).items():
            metrics.update({f"{name}.{m}.lo": lo, f"{name}.{m}.hi": hi})
        for m, (diff, lo, hi) in comparison.differences.get(name, {}).items():
            metrics.update({f"{name}.{m}.diff_to_{REFERENCE}": diff, f"{name}.{m}.diff_to_{REFERENCE}.lo": lo,
                            f"{name}.{m}.diff_to_{REFERENCE}.hi": hi})
    for pair, diffs in comparison.pair_differences.items():
        a, b = pair.split(" - ")
        for m, (diff, lo, hi) in diffs.items():
            metrics.update({f"{a}.{m}.diff_to_{b}": diff, f"{a}.{m}.diff_to_{b}.lo": lo, f"{a}.{m}.diff_to_{b}.hi": hi})
    recorder.log_metrics({k: v for k, v in metrics.items() if np.isfinite(v)})
    recorder.log_text(r.table + "\n", "evaluation.md")
    recorder.log_dict({**comparison.to_full_json(), "split": r.split.info, "details": details}, "evaluation.json")
    for name, curve in r.curves.items():
        for row in curve:
            recorder.log_metrics({f"{name}.{'valid_' if '@' in k else ''}{k}": v for k, v in row.items()
                                  if k != "epoch"}, step=int(row["epoch"]))
        recorder.log_figure(plots.learning_curve(curve, SELECTION_METRIC), f"plots/learning_curve_{name}.png")
    recorder.end("FINISHED")
    if recorder.failed:
        log.warning("the evaluation could not be recorded in %s: %s", redact_uri(cfg.mlflow.tracking_uri),
                    recorder.error)
    return recorder.run_id
