"""The nightly job: read -> join -> score -> validate -> publish -> record, for one date or a range.

``run_dates`` is what ``jobs/nightly_recommendations.py`` (spark-submit) and ``recsys recommend``
both call; it runs ``run_nightly`` per date. Data flows one way; each stage logs its counts and
seconds, labels its Spark jobs, and hands plain values to the next. Nothing is visible to readers
until validation has passed.

Scheduler semantics, in the order a run meets them: the date's lock (a second run exits with
LOCK_HELD; a lock left by a killed run is taken over), recovery of whatever a killed run of the
date left behind, model resolution (falling back to the last remembered version if MLflow is
unreachable), and the skip check (a date already published with the same model version and
config digest is left alone unless forced). Only then is an MLflow run started.
"""
from __future__ import annotations

import datetime as dt
import io
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from recsys import __version__, pause, tracking
from recsys.config import Config
from recsys.uris import redact_uri
from recsys.data import history as hist
from recsys.data.contracts import OUTPUT_SPARK_DDL, parse_date, partition_name
from recsys.data.readers import (CatalogSnapshot, catalog_figures, read_catalog_snapshot, read_errors_as_input_errors,
                                 read_events_window)
from recsys.errors import ConfigError, ExitCode, InputDataError, ValidationFailed
from recsys.last_model import resolve_or_remembered
from recsys.progress import StageTimer
from recsys import fs as rfs
from recsys.publish.lock import DateLock
from recsys.publish.publisher import (PartitionLayout, check_output_location, discard_staging, publish, publish_method,
                                      read_manifest, recover)
from recsys.publish.validate import ValidationReport, validate_recommendations
from recsys.scoring.core import popularity_fallback
from recsys.scoring.stage import score_histories, worker_figures
from recsys.scoring.udf import ScoringSpec, faults_from_env
from recsys.sequences import Vocabulary

log = logging.getLogger(__name__)

PUBLISHED, SKIPPED = "published", "skipped"


@dataclass
class NightlyResult:
    date: dt.date
    run_id: str | None
    output_dir: str
    manifest: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)
    exit_code: ExitCode = ExitCode.OK
    status: str = PUBLISHED          # or SKIPPED: the date was already published the same way
    reason: str | None = None        # why it was skipped


def run_dates(spark: SparkSession, cfg: Config, dates: Sequence[dt.date], *, force: bool = False) -> list[NightlyResult]:
    """Run the job for each date in order, in one Spark session (a backfill, or one date).

    One session keeps the Python workers, and so the model cache, warm from date to date. The
    first date that fails stops the backfill and its error propagates (so the exit code is that
    date's): later dates are not attempted, because a backfill that carries on past a failure
    leaves a hole that is easy to miss, and rerunning the same range is cheap since published
    dates are skipped. A date that is published but not recorded in MLflow (exit 5) does not stop it.
    """
    results: list[NightlyResult] = []
    for i, date in enumerate(dates):
        try:
            results.append(run_nightly(spark, cfg, date, force=force))
        except BaseException:
            if len(dates) > 1:
                log.warning("backfill %s..%s stopped at %s: %s; not attempted: %s", dates[0], dates[-1], date,
                            _summary(results) or "nothing done",
                            ", ".join(str(d) for d in dates[i + 1:]) or "none")
            raise
    if len(dates) > 1:
        log.info("backfill %s..%s done: %s", dates[0], dates[-1], _summary(results))
    return results


def overall_exit_code(results: Sequence[NightlyResult]) -> ExitCode:
    """The worst code of dates that all ran to the end: OK, or TRACKING_FAILED if any date had it."""
    return max((r.exit_code for r in results), default=ExitCode.OK)


def _summary(results: Sequence[NightlyResult]) -> str:
    published = [str(r.date) for r in results if r.status == PUBLISHED]
    skipped = [str(r.date) for r in results if r.status == SKIPPED]
    parts = []
    if published:
        parts.append(f"published {len(published)} ({', '.join(published)})")
    if skipped:
        parts.append(f"skipped {len(skipped)} as already published ({', '.join(skipped)})")
    return "; ".join(parts)


def run_nightly(spark: SparkSession, cfg: Config, date: dt.date | str, *, force: bool = False) -> NightlyResult:
    """Produce and publish ``recommendations/dt=<date>/`` and its MLflow run, under the date's lock.

    A date already published with the same model version and config digest is skipped (no MLflow
    run is created; the log says why) unless ``force``. Raises a RecsysError subclass for expected
    failures (bad input, validation, a held lock) after marking the MLflow run FAILED and removing
    everything staged; the published partition, if any, is untouched.
    """
    date = parse_date(date)
    check_output_location(cfg.paths)
    try:
        faults = faults_from_env()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    pause_at = pause.requested()
    run_key = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
    layout = PartitionLayout(cfg.paths.output, date, run_key)
    timer = StageTimer(spark, job=f"recommend {date}")

    with DateLock(cfg.paths.output, date, run_key) as lock:
        for note in recover(layout):
            log.warning("recommend %s: %s", date, note)
        _remove_stale_work_dirs(cfg, date, run_key)
        with timer.stage("resolve_model", "resolve model") as c:
            model, unreachable = resolve_or_remembered(cfg.mlflow, cfg.paths.work)
            c.update(model=model.uri, version=model.version, resolution="remembered" if unreachable else "registry")

        published = read_manifest(cfg.paths.output, date)
        reason = skip_reason(published, model.version, cfg.digest())
        if reason is not None and not force:
            log.info("recommend %s: skipped: %s; pass --force to recompute it", date, reason)
            return NightlyResult(date, published.get("run_id"), layout.final_dir, published, status=SKIPPED,
                                 reason=reason)
        if published is not None:
            log.info("recommend %s: replacing the published partition (%s)", date,
                     "--force" if reason else _difference(published, model.version, cfg.digest()))

        recorder = tracking.RunRecorder(
            cfg.mlflow, run_name=f"recommend {date}", unavailable=unreachable,
            tags={"recsys.job": "nightly", "recsys.date": str(date), "recsys.version": __version__,
                  "recsys.job_run": run_key},
        )
        work_dir = rfs.join(cfg.paths.work, "runs", partition_name(date), run_key)
        try:
            result = _run(spark, cfg, date, timer, recorder, layout, work_dir,
                          model=model, unreachable=unreachable, lock=lock, faults=faults, pause_at=pause_at)
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


def skip_reason(published: dict[str, Any] | None, model_version: str, config_digest: str) -> str | None:
    """Why the published partition already is what this run would produce, or None if it is not."""
    if published is None:
        return None
    if str(published.get("model", {}).get("version")) == model_version and published.get("config_digest") == config_digest:
        return (f"already published at {published.get('published_at', '?')} by run "
                f"{published.get('run_id') or published.get('job_run') or '?'} with model version {model_version} "
                f"and config digest {config_digest}")
    return None


def _difference(published: dict[str, Any], model_version: str, config_digest: str) -> str:
    old_version = published.get("model", {}).get("version")
    if str(old_version) != model_version:
        return f"published with model version {old_version}, the alias now points at {model_version}"
    return f"published with config digest {published.get('config_digest')}, now {config_digest}"


def _observed(observation: Observation, recompute) -> dict[str, Any]:
    """``observation.get``, or the same figures recomputed when Spark lost them.

    With adaptive execution, a query whose first shuffle turns out empty (e.g. every event had a
    null id) is re-planned as an empty relation without its observed metrics, and
    ``Observation.get`` fails an assertion in ``PythonSQLUtils.toPyRow`` (seen with Spark 4.x).
    Recomputing costs one more pass over the input, only in that case.
    """
    try:
        return observation.get
    except Exception as exc:
        if "toPyRow" not in str(exc):
            raise
        log.info("Spark's adaptive execution dropped observed metrics of an empty query; recomputing them")
        return recompute()


def _remove_stale_work_dirs(cfg: Config, date: dt.date, run_key: str) -> None:
    """Scratch directories of this date's earlier runs: dead, since this run holds the date's lock."""
    base = rfs.join(cfg.paths.work, "runs", partition_name(date))
    fs, root = rfs.resolve(base)
    for path in rfs.list_dirs(fs, root):
        name = path.rsplit("/", 1)[1]
        if name != run_key:
            _cleanup(rfs.join(base, name))


def _run(spark: SparkSession, cfg: Config, date: dt.date, timer: StageTimer, recorder: tracking.RunRecorder,
         layout: PartitionLayout, work_dir: str, *, model: tracking.ResolvedModel, unreachable: str | None,
         lock: DateLock, faults: tuple[str, ...], pause_at: str | None) -> NightlyResult:
    metrics: dict[str, float] = {}
    vocab = Vocabulary(np.load(model.local_dir / "item_ids.npy", allow_pickle=False))
    recorder.log_params(_params(cfg, date, model))

    with timer.stage("read_catalog", "read the latest catalog snapshot") as c:
        catalog = read_catalog_snapshot(spark, cfg.paths.catalog, date, cfg.catalog.max_age_days)
        figures, available_ids = catalog_figures(catalog, cfg.paths.catalog)
        cand_index_all = vocab.index_of(available_ids)
        known = cand_index_all > 0
        order = np.argsort(cand_index_all[known], kind="stable")
        cand_index = cand_index_all[known][order]
        cand_ids = available_ids[known][order]
        figures["available_unknown_to_model"] = int((~known).sum())
        figures["candidate_items"] = int(len(cand_index))
        if len(cand_index) == 0:
            raise InputDataError(
                f"none of the {len(available_ids)} available items in catalog snapshot {catalog.date} is known to "
                f"model version {model.version}; retrain the model or check the catalog"
            )
        c.update(snapshot=str(catalog.date), **figures)
    metrics.update({f"catalog_{k}": v for k, v in figures.items()})
    recorder.log_params({"catalog_snapshot": str(catalog.date)})

    histories_dir = rfs.join(work_dir, "histories")
    with timer.stage("histories", "read events and build histories") as c:
        obs_events, obs_hist = Observation("events"), Observation("histories")
        raw = read_events_window(spark, cfg.paths.events, date, cfg.history.window_days, cfg.history.event_types)
        events = hist.drop_null_ids(raw.observe(obs_events, *hist.input_quality_metrics()))
        histories = hist.build_histories(events, max_items=cfg.history.max_items,
                                         tie_break_seed=cfg.history.tie_break_seed)
        with read_errors_as_input_errors("events", cfg.paths.events):
            histories.observe(obs_hist, *hist.history_metrics()).write.mode("overwrite").parquet(histories_dir)
            observed = {
                **_observed(obs_events, lambda: raw.agg(*hist.input_quality_metrics()).first().asDict()),
                **_observed(obs_hist, lambda: spark.read.parquet(histories_dir).agg(*hist.history_metrics()).first().asDict()),
            }
        event_figures = {k: int(v or 0) for k, v in observed.items()}
        c.update(event_figures)
        if event_figures["users_in_window"] == 0:
            start = date - dt.timedelta(days=cfg.history.window_days)
            raise InputDataError(
                f"no usable events between {start} and {date} (exclusive) under {cfg.paths.events!r} "
                f"({event_figures['events_read']} rows read, {event_figures['dropped_null_user_id']} without a user, "
                f"{event_figures['dropped_null_item_id']} without an item); check the events path, "
                f"history.window_days and history.event_types"
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
            max_tile_mb=cfg.scoring.max_tile_mb,
            cache_size=cfg.scoring.cache_size,
            faults=faults,
        )
        scored, obs_score = score_histories(histories, spec, cfg.scoring.partitions)
        if pause_at == "writing":
            scored = scored.mapInArrow(pause.hold_first_task_while_writing(), OUTPUT_SPARK_DDL)
        started = time.perf_counter()
        scored.write.mode("overwrite").parquet(staging)
        score_seconds = time.perf_counter() - started
        worker = worker_figures(obs_score)
        retried = worker["task_retries"]
        scoring_figures = {
            "users_scored": worker["model_users"],
            "fallback_users": worker["fallback_users"],
            "users_per_s": worker["users"] / score_seconds if score_seconds > 0 else 0.0,
            **{k: v for k, v in worker.items() if not isinstance(v, (list, dict, str))},
        }
        c.update(users=worker["users"], model_users=worker["model_users"], fallback=worker["fallback_users"],
                 users_per_s=round(scoring_figures["users_per_s"]), device=worker["device"],
                 model_loads=worker["model_misses"], workers=worker["workers"], retried_tasks=retried)
        if retried:
            log.warning("recommend %s: %d scoring task(s) succeeded only on a retry; their model was loaded again "
                        "(model_misses=%d)", date, retried, worker["model_misses"])
    metrics.update(scoring_figures)
    pause.pause_point("staged")

    with timer.stage("validate", "validate staged output") as c:
        staged = spark.read.parquet(staging)
        report = validate_recommendations(
            staged, histories, candidate_ids=cand_ids, top_n=cfg.scoring.top_n,
            fallback_name=fallback.name, fallback_len=len(fallback.item_ids), model_version=model.version,
            users_in_window=event_figures["users_in_window"],
        )
        c.update(passed=report.passed, rows=report.figures["rows"], coverage=round(report.figures["catalog_coverage"], 4))
        if not report.passed:
            raise ValidationFailed(
                f"validation failed for {date}, nothing published: " + "; ".join(report.failures()),
                report.as_dict(),
            )
    metrics.update({k: v for k, v in report.figures.items()})
    metrics["catalog_coverage"] = report.figures["catalog_coverage"]

    method = publish_method(layout)
    manifest = _manifest(cfg, date, model, catalog.date, recorder, metrics, timer, report,
                         job_run=layout.run_key, method=method, unreachable=unreachable)
    with timer.stage("publish", "publish partition") as c:
        lock.verify()
        final_dir = publish(layout, manifest, method)
        c.update(path=final_dir, method=method)

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
        "model_source": redact_uri(model.source),
        "top_n": cfg.scoring.top_n,
        "chunk_size": cfg.scoring.chunk_size,
        "device": cfg.scoring.device,
        "dtype": cfg.scoring.dtype,
        "item_tile": cfg.scoring.item_tile,
        "max_tile_mb": cfg.scoring.max_tile_mb,
        "arrow_batch_size": cfg.scoring.arrow_batch_size,
        "window_days": cfg.history.window_days,
        "max_history_items": cfg.history.max_items,
        "event_types": ",".join(cfg.history.event_types) or "all",
        "events_path": redact_uri(cfg.paths.events),
        "catalog_path": redact_uri(cfg.paths.catalog),
        "output_path": redact_uri(cfg.paths.output),
        "config_digest": cfg.digest(),
        "tracking_uri": redact_uri(cfg.mlflow.tracking_uri),
        "recsys_version": __version__,
    }


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
              report: ValidationReport, *, job_run: str, method: str, unreachable: str | None) -> dict[str, Any]:
    return {
        "format_version": 1,
        "date": str(date),
        "run_id": recorder.run_id,
        "job_run": job_run,
        "publish_method": method,
        "published_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "recsys_version": __version__,
        "model": {"uri": model.uri, "name": model.name, "alias": model.alias, "version": model.version,
                  "source": redact_uri(model.source),
                  "resolution": f"remembered: {unreachable}" if unreachable else "registry"},
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
    _close(fig)
    cand_ids, pop_counts = pop
    rec_ids, rec_times = report.item_counts
    times = np.zeros(len(cand_ids), dtype=np.int64)
    pos = np.searchsorted(cand_ids, rec_ids)
    ok = (pos < len(cand_ids)) & (cand_ids[np.minimum(pos, len(cand_ids) - 1)] == rec_ids)
    times[pos[ok]] = rec_times[ok]
    fig = plots.popularity_long_tail(times, pop_counts)
    recorder.log_figure(fig, "plots/popularity_long_tail.png")
    _close(fig)


def _close(fig: Any) -> None:
    """pyplot keeps every figure until closed: a backfill of many dates in one process would pile them up."""
    import matplotlib.pyplot as plt

    plt.close(fig)


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
