"""The nightly job: read -> join -> score -> validate -> publish -> record, for one date.

``run_nightly`` is what ``jobs/nightly_recommendations.py`` (spark-submit) and ``recsys recommend``
both call. Data flows one way; each stage logs its counts and seconds, labels its Spark jobs,
and hands plain values to the next. Nothing is visible to readers until validation has passed.
"""
from __future__ import annotations

import datetime as dt
import io
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from recsys import __version__, tracking
from recsys.config import Config, local_path, redact_uri
from recsys.data import history as hist
from recsys.data.contracts import parse_date
from recsys.data.readers import CatalogSnapshot, read_catalog_snapshot, read_events_window
from recsys.errors import ExitCode, InputDataError, ValidationFailed
from recsys.progress import StageTimer
from recsys.publish import fs as rfs
from recsys.publish.publisher import PartitionLayout, discard_staging, publish
from recsys.publish.validate import ValidationReport, validate_recommendations
from recsys.scoring.core import popularity_fallback
from recsys.scoring.stage import score_histories, worker_figures
from recsys.scoring.udf import ScoringSpec, faults_from_env
from recsys.sequences import Vocabulary

log = logging.getLogger(__name__)


@dataclass
class NightlyResult:
    date: dt.date
    run_id: str | None
    output_dir: str
    manifest: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)
    exit_code: ExitCode = ExitCode.OK


def run_nightly(spark: SparkSession, cfg: Config, date: dt.date | str) -> NightlyResult:
    """Produce and publish ``recommendations/dt=<date>/`` and its MLflow run.

    Raises a RecsysError subclass for expected failures (bad input, validation), after marking the
    MLflow run FAILED and removing everything staged; the published partition, if any, is untouched.
    """
    date = parse_date(date)
    timer = StageTimer(spark, job=f"recommend {date}")
    recorder = tracking.RunRecorder(
        cfg.mlflow, run_name=f"recommend {date}",
        tags={"recsys.job": "nightly", "recsys.date": str(date), "recsys.version": __version__},
    )
    run_key = recorder.run_id or f"untracked-{uuid.uuid4().hex[:12]}"
    layout = PartitionLayout(cfg.paths.output, date, run_key)
    work_dir = rfs.join(cfg.paths.work, "runs", run_key)
    try:
        result = _run(spark, cfg, date, timer, recorder, layout, work_dir)
    except BaseException as exc:
        discard_staging(layout)
        _cleanup(work_dir)
        recorder.set_tags({"recsys.status": "failed", "recsys.error": str(exc)[:4000]})
        if isinstance(exc, ValidationFailed):
            recorder.log_dict(exc.report, "validation_report.json")
        recorder.end("FAILED")
        raise
    _cleanup(work_dir)
    recorder.end("FINISHED")
    if recorder.failed:
        result.exit_code = ExitCode.TRACKING_FAILED
        log.warning("recommendations for %s are published, but the MLflow run could not be recorded (%s); "
                    "the manifest holds the run's figures", date, recorder.error)
    return result


def _run(spark: SparkSession, cfg: Config, date: dt.date, timer: StageTimer, recorder: tracking.RunRecorder,
         layout: PartitionLayout, work_dir: str) -> NightlyResult:
    metrics: dict[str, float] = {}

    with timer.stage("resolve_model", "resolve model") as c:
        model = tracking.resolve_model(cfg.mlflow, local_path(cfg.paths.work) / "models")
        vocab = Vocabulary(np.load(model.local_dir / "item_ids.npy", allow_pickle=False))
        c.update(model=model.uri, version=model.version, vocabulary=len(vocab))
    recorder.log_params(_params(cfg, date, model))

    with timer.stage("read_catalog", "read the latest catalog snapshot") as c:
        catalog = read_catalog_snapshot(spark, cfg.paths.catalog, date, cfg.catalog.max_age_days)
        catalog_figures, available_ids = _catalog_figures(catalog)
        cand_index_all = vocab.index_of(available_ids)
        known = cand_index_all > 0
        order = np.argsort(cand_index_all[known], kind="stable")
        cand_index = cand_index_all[known][order]
        cand_ids = available_ids[known][order]
        catalog_figures["available_unknown_to_model"] = int((~known).sum())
        catalog_figures["candidate_items"] = int(len(cand_index))
        if len(cand_index) == 0:
            raise InputDataError(
                f"none of the {len(available_ids)} available items in catalog snapshot {catalog.date} is known to "
                f"model version {model.version}; retrain the model or check the catalog"
            )
        c.update(snapshot=str(catalog.date), **catalog_figures)
    metrics.update({f"catalog_{k}": v for k, v in catalog_figures.items()})
    recorder.log_params({"catalog_snapshot": str(catalog.date)})

    histories_dir = rfs.join(work_dir, "histories")
    with timer.stage("histories", "read events and build histories") as c:
        obs_events, obs_hist = Observation("events"), Observation("histories")
        events = read_events_window(spark, cfg.paths.events, date, cfg.history.window_days, cfg.history.event_types)
        events = hist.drop_null_ids(events.observe(obs_events, *hist.input_quality_metrics()))
        histories = hist.build_histories(events, max_items=cfg.history.max_items,
                                         tie_break_seed=cfg.history.tie_break_seed)
        histories.observe(obs_hist, *hist.history_metrics()).write.mode("overwrite").parquet(histories_dir)
        event_figures = {k: int(v or 0) for k, v in {**obs_events.get, **obs_hist.get}.items()}
        c.update(event_figures)
        if event_figures["users_in_window"] == 0:
            start = date - dt.timedelta(days=cfg.history.window_days)
            raise InputDataError(
                f"no usable events between {start} and {date} (exclusive) under {cfg.paths.events!r} "
                f"({event_figures['events_read']} rows read); check the events path, history.window_days "
                f"and history.event_types"
            )
    metrics.update(event_figures)

    with timer.stage("fallback", "popularity fallback") as c:
        histories = spark.read.parquet(histories_dir)
        fallback, pop_counts = _popularity(histories, cand_ids, cfg.scoring.top_n)
        c.update(items=len(fallback.item_ids))

    staging = layout.staging_dir
    with timer.stage("score", "score users") as c:
        spec = ScoringSpec(
            model_dir=str(model.local_dir),
            model_version=model.version,
            model_key=f"{model.name}/{model.version}@{model.source}",
            candidates_index=cand_index.astype(np.int64),
            candidates_item_ids=cand_ids.astype(np.int64),
            candidates_digest=f"{catalog.date}:{_digest(cand_index)}",
            fallback_item_ids=fallback.item_ids,
            fallback_scores=fallback.scores,
            fallback_name=fallback.name,
            top_n=cfg.scoring.top_n,
            chunk_size=cfg.scoring.chunk_size,
            device=cfg.scoring.device,
            dtype=cfg.scoring.dtype,
            item_tile=cfg.scoring.item_tile,
            cache_size=cfg.scoring.cache_size,
            faults=faults_from_env(),
        )
        scored, obs_score = score_histories(histories, spec, cfg.scoring.partitions)
        started = time.perf_counter()
        scored.write.mode("overwrite").parquet(staging)
        score_seconds = time.perf_counter() - started
        worker = worker_figures(obs_score)
        scoring_figures = {
            "users_scored": worker["model_users"],
            "fallback_users": worker["fallback_users"],
            "users_per_s": worker["users"] / score_seconds if score_seconds > 0 else 0.0,
            **{k: v for k, v in worker.items() if not isinstance(v, (list, dict, str))},
        }
        c.update(users=worker["users"], model_users=worker["model_users"], fallback=worker["fallback_users"],
                 users_per_s=round(scoring_figures["users_per_s"]), device=worker["device"],
                 model_loads=worker["model_misses"], workers=worker["workers"])
    metrics.update(scoring_figures)

    with timer.stage("validate", "validate staged output") as c:
        staged = spark.read.parquet(staging)
        report = validate_recommendations(
            staged, histories, candidate_ids=cand_ids, top_n=cfg.scoring.top_n,
            fallback_name=fallback.name, fallback_len=len(fallback.item_ids), model_version=model.version,
        )
        c.update(passed=report.passed, rows=report.figures["rows"], coverage=round(report.figures["catalog_coverage"], 4))
        if not report.passed:
            raise ValidationFailed(
                f"validation failed for {date}, nothing published: " + "; ".join(report.failures()),
                report.as_dict(),
            )
    metrics.update({k: v for k, v in report.figures.items()})
    metrics["catalog_coverage"] = report.figures["catalog_coverage"]

    manifest = _manifest(cfg, date, model, catalog.date, recorder, metrics, timer, report)
    with timer.stage("publish", "publish partition") as c:
        final_dir = publish(layout, manifest)
        c.update(path=final_dir)

    metrics.update(timer.as_metrics())
    metrics["total_s"] = timer.total
    manifest["timings"] = timer.as_metrics()
    _record(recorder, cfg, manifest, metrics, worker, report, staged_path=final_dir,
            catalog=catalog, pop=(cand_ids, pop_counts), spark=spark)
    log.info("recommend %s: published %s rows to %s in %.1fs (run %s)", date, report.figures["rows"], final_dir,
             timer.total, recorder.run_id or "untracked")
    return NightlyResult(date, recorder.run_id, final_dir, manifest, metrics)


def _params(cfg: Config, date: dt.date, model: tracking.ResolvedModel) -> dict[str, Any]:
    return {
        "date": str(date),
        "model_uri": model.uri,
        "model_version": model.version,
        "model_source": model.source,
        "top_n": cfg.scoring.top_n,
        "chunk_size": cfg.scoring.chunk_size,
        "device": cfg.scoring.device,
        "dtype": cfg.scoring.dtype,
        "item_tile": cfg.scoring.item_tile,
        "arrow_batch_size": cfg.scoring.arrow_batch_size,
        "window_days": cfg.history.window_days,
        "max_history_items": cfg.history.max_items,
        "event_types": ",".join(cfg.history.event_types) or "all",
        "events_path": cfg.paths.events,
        "catalog_path": cfg.paths.catalog,
        "output_path": cfg.paths.output,
        "config_digest": cfg.digest(),
        "tracking_uri": redact_uri(cfg.mlflow.tracking_uri),
        "recsys_version": __version__,
    }


def _catalog_figures(catalog: CatalogSnapshot) -> tuple[dict[str, int], np.ndarray]:
    frame = catalog.frame
    counts = frame.agg(
        F.count(F.lit(1)).alias("rows"),
        F.count_if(F.col("item_id").isNull()).alias("null_item_ids"),
        F.count_distinct("item_id").alias("distinct_items"),
        F.count_distinct(F.when(F.col("available"), F.col("item_id"))).alias("available_items"),
    ).first().asDict()
    figures = {k: int(v or 0) for k, v in counts.items()}
    if figures["rows"] == 0:
        raise InputDataError(f"catalog snapshot {catalog.date} is empty; nothing can be recommended")
    if figures["available_items"] == 0:
        raise InputDataError(f"catalog snapshot {catalog.date} has {figures['rows']} items but none is available")
    available = frame.filter(F.col("available") & F.col("item_id").isNotNull()).select("item_id").distinct().toArrow()
    return figures, np.sort(available.column("item_id").to_numpy().astype(np.int64))


def _popularity(histories: DataFrame, cand_ids: np.ndarray, top_n: int):
    """Users per item in the window's histories, restricted to candidates -> fallback + counts."""
    counted = histories.select(F.explode(hist.HISTORY_COLUMN).alias("item_id")).groupBy("item_id").count().toArrow()
    ids = counted.column("item_id").to_numpy()
    counts = counted.column("count").to_numpy()
    pos = np.searchsorted(cand_ids, ids)
    pos = np.minimum(pos, max(len(cand_ids) - 1, 0))
    is_cand = cand_ids[pos] == ids if len(cand_ids) else np.zeros(len(ids), bool)
    per_cand = np.zeros(len(cand_ids), dtype=np.int64)
    np.add.at(per_cand, pos[is_cand], counts[is_cand])
    return popularity_fallback(cand_ids, per_cand, top_n), per_cand


def _manifest(cfg: Config, date: dt.date, model: tracking.ResolvedModel, snapshot: dt.date,
              recorder: tracking.RunRecorder, metrics: dict[str, float], timer: StageTimer,
              report: ValidationReport) -> dict[str, Any]:
    return {
        "format_version": 1,
        "date": str(date),
        "run_id": recorder.run_id,
        "published_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "recsys_version": __version__,
        "model": {"uri": model.uri, "name": model.name, "alias": model.alias, "version": model.version,
                  "source": model.source},
        "catalog_snapshot": str(snapshot),
        "config_digest": cfg.digest(),
        "counts": {
            "rows": report.figures["rows"],
            "users_in_window": int(metrics.get("users_in_window", 0)),
            "model_users": int(metrics.get("users_scored", 0)),
            "fallback_users": int(metrics.get("fallback_users", 0)),
            "candidate_items": int(metrics.get("catalog_candidate_items", 0)),
            "events_read": int(metrics.get("events_read", 0)),
        },
        "validation": report.as_dict()["violations"],
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        "timings": timer.as_metrics(),
        "tracking": {"uri": redact_uri(cfg.mlflow.tracking_uri), "experiment": cfg.mlflow.experiment,
                     "error": recorder.error},
    }


def _record(recorder: tracking.RunRecorder, cfg: Config, manifest: dict[str, Any], metrics: dict[str, float],
            worker: dict[str, Any], report: ValidationReport, *, staged_path: str, catalog: CatalogSnapshot,
            pop: tuple[np.ndarray, np.ndarray], spark: SparkSession) -> None:
    """Metrics, per-worker cache figures, artifacts and plots; each call degrades, never raises."""
    import yaml

    from recsys import plots

    recorder.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    for step, w in enumerate(worker["per_worker"]):   # one point per worker: a per-worker series in the UI
        recorder.log_metrics({"worker_model_misses": w["model_misses"], "worker_model_hits": w["model_hits"],
                              "worker_model_load_s": w["model_load_s"], "worker_tasks": w["tasks"]}, step=step)
    recorder.log_dict(manifest, "manifest.json")
    recorder.log_text(yaml.safe_dump(cfg.redacted_dict(), sort_keys=False), "config.yaml")
    recorder.log_dict({"workers": worker["per_worker"]}, "worker_stats.json")
    recorder.log_dict(report.as_dict(), "validation_report.json")
    recorder.set_tags({"recsys.status": "published", "recsys.output": staged_path,
                       "recsys.model_version": manifest["model"]["version"]})
    if recorder.failed or recorder.run_id is None:
        return
    published = spark.read.parquet(staged_path)
    sample = _recommendation_sample(published, catalog)
    recorder.log_text(sample, "recommendations_sample.csv")
    scores = published.select(F.posexplode(F.transform("recommendations", lambda x: x["score"])).alias("rank", "score"))
    sample_scores = scores.sample(False, min(1.0, 20000 / max(1, report.figures["recommended_items"])), seed=0).toArrow()
    fig = plots.score_distribution(sample_scores.column("score").to_numpy(), sample_scores.column("rank").to_numpy(),
                                   cfg.scoring.top_n)
    recorder.log_figure(fig, "plots/score_distribution.png")
    cand_ids, pop_counts = pop
    rec_ids, rec_times = report.item_counts
    times = np.zeros(len(cand_ids), dtype=np.int64)
    pos = np.searchsorted(cand_ids, rec_ids)
    ok = (pos < len(cand_ids)) & (cand_ids[np.minimum(pos, len(cand_ids) - 1)] == rec_ids)
    times[pos[ok]] = rec_times[ok]
    recorder.log_figure(plots.popularity_long_tail(times, pop_counts), "plots/popularity_long_tail.png")


def _recommendation_sample(published: DataFrame, catalog: CatalogSnapshot, users: int = 20) -> str:
    """A CSV of a few users' lists with item titles, for eyeballing a run in the MLflow UI."""
    rows = published.orderBy("user_id").limit(users).select(
        "user_id", "source", F.posexplode("recommendations").alias("rank", "rec")
    ).select("user_id", "source", (F.col("rank") + 1).alias("rank"), "rec.item_id", "rec.score")
    described = [c for c in ("title", "category") if c in catalog.frame.columns]
    if described:
        rows = rows.join(catalog.frame.select("item_id", *described).dropDuplicates(["item_id"]), "item_id", "left")
    pdf = rows.orderBy("user_id", "rank").toPandas()
    buf = io.StringIO()
    pdf.to_csv(buf, index=False)
    return buf.getvalue()


def _digest(values: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()[:16]


def _cleanup(work_dir: str) -> None:
    try:
        fs, path = rfs.resolve(work_dir)
        rfs.delete_dir_if_exists(fs, path)
    except OSError as exc:  # leftover scratch data is not worth failing a published run for
        log.warning("could not remove work directory %s: %s", work_dir, exc)
