"""``recsys evaluate``: the project's models and the baselines on one protocol, one table, one MLflow run.

For every model the same three steps, and nothing of the test phase before the last one:

1. **fit** on the validation phase's histories (:mod:`recsys.evaluation.protocols`);
2. **choose** on the validation targets: the epoch of a neural model (early stopping on validation
   NDCG@10, the same rule as ``recsys train``), the grid point of ALS;
3. **test** on the test phase: the neural models read each user's test-phase history (which holds
   the validation interactions) without retraining, exactly as the nightly job scores users whose
   newest events the model has never trained on; ALS is refitted with the chosen point on the
   test-phase histories, since a factor model has no other way to use new interactions;
   popularity is counted on the test-phase histories.

Then the comparison (:mod:`recsys.evaluation.report`): means, 95% bootstrap intervals over test
users, paired differences to ALS, printed, written as ``--json`` and logged to MLflow in the
experiment ``<mlflow.experiment>-evaluation``.
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recsys import __version__

from recsys.tracking import tags
from recsys.tracking import store as tracking
from recsys.config import Config
from recsys.uris import redact_uri
from recsys.errors import ConfigError, InputDataError
from recsys.evaluation import protocols
from recsys.evaluation.protocols import EvalSplit
from recsys.evaluation.ranking import PhaseResult, RankingScorer, SequenceModelScorer, rank_phase
from recsys.evaluation.report import Comparison, compare, format_table, write_json
from recsys.model.registry import MODEL_TYPES

log = logging.getLogger(__name__)

SELECTION_K = 10                 # models are chosen on validation NDCG@10, whatever --k asks for
REFERENCE = "als"


@dataclass
class EvaluationResult:
    comparison: Comparison
    table: str
    split_info: dict[str, Any]
    run_id: str | None
    details: dict[str, Any] = field(default_factory=dict)    # per model: chosen epoch / grid point, seconds


def run_evaluation(spark, cfg: Config, data: str | Path, *, protocol: str, ks: tuple[int, ...] | None = None,
                   tie_break_seed: int | None = None, split_date: dt.date | None = None, test_days: int = 30,
                   json_path: Path | None = None, device: str | None = None) -> EvaluationResult:
    """Evaluate ``cfg.evaluation.models`` on the dataset at ``data`` (``events/`` + ``catalog/``)."""

    from recsys.model.training import fit
    from recsys.scoring.core import resolve_device
    from recsys.learning.settings import model_config, train_settings
    from recsys.learning.split import build_vocabulary

    if protocol not in protocols.PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; choose one of {', '.join(protocols.PROTOCOLS)}")
    ev = cfg.evaluation
    ks = tuple(sorted(set(ks or ev.ks)))
    if any(k < 1 for k in ks):
        raise ConfigError(f"every --k must be at least 1, got {list(ks)}")
    tie_seed = cfg.history.tie_break_seed if tie_break_seed is None else tie_break_seed
    data = check_dataset_root(data)
    device = resolve_device(device or cfg.train.device)
    ranking_ks = tuple(sorted(set(ks) | {SELECTION_K}))

    started = time.perf_counter()
    if protocol == "loo":
        split = protocols.load_loo(spark, data, tie_break_seed=tie_seed, event_types=cfg.history.event_types)
    else:
        split = protocols.load_temporal(spark, data, split_date=split_date, test_days=test_days,
                                        tie_break_seed=tie_seed, event_types=cfg.history.event_types)
    log.info("[evaluate] %s split: %s (%.1f s)", protocol, split.info, time.perf_counter() - started)

    def validation_ndcg(scorer: RankingScorer) -> float:
        return rank_phase(scorer, split.valid, (SELECTION_K,), device=device).means()[f"ndcg@{SELECTION_K}"]

    results: dict[str, PhaseResult] = {}
    details: dict[str, Any] = {}
    curves: dict[str, list[dict]] = {}
    vocab = train_seqs = None
    for name in ev.models:
        t0 = time.perf_counter()
        core_row: tuple[str, RankingScorer] | None = None   # this model ranked by the job's core at scoring.dtype
        if name == "popularity":
            from recsys.evaluation.baselines import popularity_scorer

            details[name] = {"valid_ndcg@10": validation_ndcg(popularity_scorer(split.valid))}
            scorer: RankingScorer = popularity_scorer(split.test)
        elif name == REFERENCE:
            from recsys.evaluation.baselines import als_grid, search_als

            grid = als_grid(list(ev.als.ranks), list(ev.als.reg_params), list(ev.als.alphas), ev.als.max_iter,
                            ev.als.seed)
            search = search_als(spark, split.valid, split.test, grid, validation_ndcg)
            details[name] = {"chosen": search.chosen.label(), "valid_ndcg@10": search.chosen_score,
                             "grid": search.grid}
            scorer = search.scorer
        elif name in MODEL_TYPES:
            if vocab is None:   # every sequence model trains on the same vocabulary and sequences
                vocab = build_vocabulary(split.valid.history, cfg.train.min_item_count)
                if len(vocab) < 2:
                    raise InputDataError(f"only {len(vocab)} item(s) in the validation histories; too little data")
                train_seqs, _ = vocab.map_sequences(split.valid.history)
            model_cfg = model_config(cfg.train.model, len(vocab), name)
            settings = train_settings(cfg.train)

            def validate(model, _ids=vocab.item_ids) -> dict[str, float]:
                return rank_phase(SequenceModelScorer(model, _ids, split.valid, device), split.valid,
                                  (SELECTION_K,), device=device).means()

            def progress(row: dict, _name=name) -> None:
                log.info("[evaluate] %s epoch %d: loss %.4f, valid ndcg@10 %s (%.1f s)", _name, row["epoch"],
                         row["train_loss"], f"{row[f'ndcg@{SELECTION_K}']:.4f}" if f"ndcg@{SELECTION_K}" in row
                         else "-", row["seconds"])

            fitted = fit(train_seqs, model_cfg, settings, device=device, validate=validate, progress=progress)
            curves[name] = fitted.curve
            details[name] = {"best_epoch": fitted.best_epoch, "epochs_run": len(fitted.curve),
                             "valid_ndcg@10": fitted.best_metrics.get(f"ndcg@{SELECTION_K}"),
                             "config": {k: v for k, v in model_cfg.__dict__.items()}}
            scorer = SequenceModelScorer(fitted.model, vocab.item_ids, split.test, device)
            if cfg.scoring.dtype != "float32":   # the same model through the job's core at that dtype, next row
                from recsys.evaluation.ranking import CoreScorer

                core_row = (f"{name}@{cfg.scoring.dtype}", CoreScorer(
                    fitted.model, vocab.item_ids, split.test, max(max(ranking_ks), cfg.scoring.top_n),
                    cfg.scoring.dtype, device))
        else:  # pragma: no cover - EvaluationConfig validates the names
            raise ConfigError(f"unknown model {name!r} in evaluation.models")
        results[name] = rank_phase(scorer, split.test, ranking_ks, device=device)
        details[name]["seconds"] = round(time.perf_counter() - t0, 1)
        log.info("[evaluate] %s: test %s (%.1f s)", name,
                 ", ".join(f"{k}={v:.4f}" for k, v in results[name].means().items() if k.startswith("ndcg")),
                 details[name]["seconds"])
        if core_row is not None:   # its row right after the model's own
            row, core = core_row
            results[row] = rank_phase(core, split.test, ranking_ks, device=device)
            details[row] = {"scored_by": "recsys.scoring.core", "dtype": cfg.scoring.dtype}

    default = cfg.train.model.type if cfg.train.model.type in results else None
    comparison = compare(results, protocol=protocol, ks=ks, candidates=len(split.test.candidates),
                         reference=REFERENCE, resamples=ev.bootstrap_resamples, seed=ev.bootstrap_seed,
                         default_model=default)
    comparison.notes.update(_notes(details))
    table = format_table(comparison)
    if json_path is not None:
        write_json(comparison, Path(json_path))
    run_id = _record(cfg, data, protocol, ks, tie_seed, split, comparison, table, details, curves)
    return EvaluationResult(comparison, table, split.info, run_id, details)


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
        if "best_epoch" in d:
            parts.append(f"epoch {d['best_epoch']} of {d['epochs_run']} chosen on validation")
        if "chosen" in d:
            parts.append(f"{d['chosen']} chosen on validation from {len(d['grid'])} points, refitted with the "
                         "validation interactions")
        if d.get("valid_ndcg@10") is not None:
            parts.append(f"validation ndcg@10 {d['valid_ndcg@10']:.4f}")
        if "scored_by" in d:   # a row ranked through the job's core at another dtype: no training of its own
            parts.append(f"the row above's model, ranked by {d['scored_by']} in {d['dtype']}")
        if "seconds" in d:
            parts.append(f"{d['seconds']:.0f} s")
        notes[name] = "; ".join(parts)
    return notes


def _record(cfg: Config, data: str, protocol: str, ks: tuple[int, ...], tie_seed: int, split: EvalSplit,
            comparison: Comparison, table: str, details: dict[str, Any], curves: dict[str, list[dict]]) -> str | None:
    """One MLflow run: protocol and seeds as parameters, per-model metrics, the table as an artifact."""
    from recsys.tracking import plots

    recorder = tracking.RunRecorder(cfg.mlflow, run_name=f"evaluate {protocol}",
                                    experiment=f"{cfg.mlflow.experiment}-evaluation",
                                    tags={tags.JOB: "evaluate", tags.PROTOCOL: protocol,
                                          tags.VERSION: __version__})
    recorder.log_params({
        "protocol": protocol, "data": data, "k": list(ks), "tie_break_seed": tie_seed,
        "bootstrap_resamples": cfg.evaluation.bootstrap_resamples, "bootstrap_seed": cfg.evaluation.bootstrap_seed,
        "train_seed": cfg.train.seed, "als_seed": cfg.evaluation.als.seed, "models": list(comparison.models),
        "default_model": comparison.default_model, "config_digest": cfg.digest(),
        **{f"split_{k}": v for k, v in split.info.items()},
        **{f"{name}_chosen": d["chosen"] for name, d in details.items() if "chosen" in d},
        **{f"{name}_best_epoch": d["best_epoch"] for name, d in details.items() if "best_epoch" in d},
    })
    metrics: dict[str, float] = {}
    for name, values in comparison.models.items():
        metrics.update({f"{name}.{m}": v for m, v in values.items() if v is not None and np.isfinite(v)})
        for m, (lo, hi) in comparison.intervals.get(name, {}).items():
            metrics.update({f"{name}.{m}.lo": lo, f"{name}.{m}.hi": hi})
        for m, (diff, lo, hi) in comparison.differences.get(name, {}).items():
            metrics.update({f"{name}.{m}.diff_to_{REFERENCE}": diff, f"{name}.{m}.diff_to_{REFERENCE}.lo": lo,
                            f"{name}.{m}.diff_to_{REFERENCE}.hi": hi})
    recorder.log_metrics({k: v for k, v in metrics.items() if np.isfinite(v)})
    recorder.log_text(table + "\n", "evaluation.md")
    recorder.log_dict({**comparison.to_full_json(), "split": split.info, "details": details}, "evaluation.json")
    for name, curve in curves.items():
        for row in curve:
            recorder.log_metrics({f"{name}.{'valid_' if '@' in k else ''}{k}": v for k, v in row.items()
                                  if k != "epoch"}, step=int(row["epoch"]))
        recorder.log_figure(plots.learning_curve(curve, f"ndcg@{SELECTION_K}"), f"plots/learning_curve_{name}.png")
    recorder.end("FINISHED")
    if recorder.failed:
        log.warning("the evaluation could not be recorded in %s: %s", redact_uri(cfg.mlflow.tracking_uri),
                    recorder.error)
    return recorder.run_id
