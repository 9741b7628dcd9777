"""The nightly job: read catalog -> histories -> fallback -> score -> validate -> guard -> publish -> record.

``run_dates`` is what ``jobs/nightly_recommendations.py`` (spark-submit) and ``recsys recommend``
both call; it runs ``run_nightly`` per date. The stages themselves live in :mod:`recsys.pipelines.nightly_stages`
(one call each in ``_run``, each returning a small frozen result); this module adds what makes
them a scheduled job: the date's lock, recovery, the skip check, the MLflow run and the exit code.
Nothing is visible to readers until validation has passed and the guard (tonight against the previous
published night and what users did with it, :mod:`recsys.pipelines.nightly_compare`) has not refused it.

Scheduler semantics, in the order a run meets them: the date's lock (a second run exits with
LOCK_HELD; a lock left by a killed run is taken over), recovery of whatever a killed run of the
date left behind, model resolution (falling back to the last remembered version if MLflow is
unreachable), the killed run's MLflow run ended as KILLED (its id is in the lock it left), and the
skip check (a date already published with the same model version and config digest is left alone
unless forced). Only then is an MLflow run started, and its id written into the date's lock.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Sequence

from pyspark.sql import SparkSession

from recsys import __version__
from recsys import fs as rfs
from recsys.config import Config
from recsys.data.contracts import parse_date
from recsys.data.readers import KeptWindow
from recsys.errors import ExitCode, GuardRefused, RunStatus, ValidationFailed, first_line
from recsys.hooks import NO_HOOKS, Hooks
from recsys.pipelines import nightly_compare as compare
from recsys.pipelines import nightly_stages as stages
from recsys.pipelines.timing import StageTimer
from recsys.publish import manifest as manifest_file
from recsys.publish.lock import DateLock, Holder
from recsys.publish.manifest import Manifest
from recsys.publish.published import find_published, new_run_key
from recsys.publish.publisher import (PartitionLayout, check_output_location, discard_staging, publish_method, recover,
                                      register_dates)
from recsys.publish.table import OutputTable, open_table
from recsys.spark import metastore
from recsys.spark.failures import recorded_error, spark_cause
from recsys.spark.session import job_description
from recsys.spark.task_progress import LiveProgress
from recsys.spark.workdir import check_executors_can_write
from recsys.tracking import run_notes as run_record
from recsys.tracking import store as tracking
from recsys.tracking import tags
from recsys.tracking.last_model import resolve_or_remembered
from recsys.redaction import redact_text

if TYPE_CHECKING:   # the export pipeline is imported where it runs: it imports this module (nightly.output_table)
    from recsys.pipelines.export import ExportResult

log = logging.getLogger(__name__)

STAGE_BREAKDOWN = "seconds by stage:"   # the run's last figures; benchmarks/scale_test.py reads this line


@dataclass
class NightlyResult:
    date: dt.date
    run_id: str | None
    output_dir: str                  # the path view dt=D/
    manifest: Manifest
    metrics: dict[str, float] = field(default_factory=dict)
    exit_code: ExitCode = ExitCode.OK
    status: RunStatus = RunStatus.PUBLISHED   # or SKIPPED: the date was already published the same way
    reason: str | None = None        # why it was skipped
    location: str | None = None      # the published run's directory (what output.table's partition points at)
    export: ExportResult | None = None   # the last stage's result when export.after_publish is set


def run_dates(spark: SparkSession, cfg: Config, dates: Sequence[dt.date], *, force: bool = False,
              hooks: Hooks = NO_HOOKS, accept_guard: dt.date | None = None,
              kept: KeptWindow | None = None) -> list[NightlyResult]:
    """Run the job for each date in order, in one Spark session (a backfill, or one date).

    One session keeps the Python workers, and so the model cache, warm from date to date. The
    first date that fails stops the backfill and its error propagates (so the exit code is that
    date's): later dates are not attempted, because a backfill that carries on past a failure
    leaves a hole that is easy to miss, and rerunning the same range is cheap since published
    dates are skipped. A date that is published but not recorded in MLflow (exit 5) does not stop it.
    ``accept_guard``: the one date whose night is published even if the guard refuses it (recorded).
    ``kept``: an events window the process keeps (``recsys night``: training's), used by the date it is for.
    """
    results: list[NightlyResult] = []
    for i, date in enumerate(dates):
        try:
            results.append(run_nightly(spark, cfg, date, force=force, hooks=hooks, accept_guard=date == accept_guard,
                                       kept=kept))
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
    published = [str(r.date) for r in results if r.status == RunStatus.PUBLISHED]
    skipped = [str(r.date) for r in results if r.status == RunStatus.SKIPPED]
    parts = []
    if published:
        parts.append(f"published {len(published)} ({', '.join(published)})")
    if skipped:
        parts.append(f"skipped {len(skipped)} as already published ({', '.join(skipped)})")
    return "; ".join(parts)


def run_nightly(spark: SparkSession, cfg: Config, date: dt.date | str, *, force: bool = False,
                hooks: Hooks = NO_HOOKS, accept_guard: bool = False, kept: KeptWindow | None = None) -> NightlyResult:
    """Publish the date (:func:`publish_nightly`), then, with ``export.after_publish``, export it as the last
    stage (:func:`recsys.pipelines.export.run_export`; a date older than the one served is skipped, not
    refused). A failed export raises its error (the partition stays published): a rerun skips the publish
    and exports again."""
    result = publish_nightly(spark, cfg, date, force=force, hooks=hooks, accept_guard=accept_guard, kept=kept)
    if cfg.export.after_publish:
        from recsys.pipelines.export import run_export

        result.export = run_export(spark, cfg, result.date, older_is_error=False, hooks=hooks)
        result.exit_code = max(result.exit_code, result.export.exit_code)
    return result


def publish_nightly(spark: SparkSession, cfg: Config, date: dt.date | str, *, force: bool = False,
                    hooks: Hooks = NO_HOOKS, accept_guard: bool = False,
                    kept: KeptWindow | None = None) -> NightlyResult:
    """Produce and publish ``recommendations/dt=<date>/`` and its MLflow run, under the date's lock.

    A date already published with the same model version and config digest is skipped (no MLflow
    run is created; the log says why) unless ``force``. Raises a RecsysError subclass for expected
    failures (bad input, validation, a held lock) after marking the MLflow run FAILED and removing
    everything staged; the published partition, if any, is untouched. ``hooks``: test and game-day
    pause points and faults (:mod:`recsys.hooks`), off by default. ``accept_guard``: publish the night even
    if the guard refuses it (:mod:`recsys.pipelines.guard`); the run records that it was accepted. A
    forced run still obeys the guard. ``kept``: the events window the process keeps for this night, whose
    histories then come from it rather than from a read of their own (:class:`recsys.data.readers.KeptWindow`).
    """
    date = parse_date(date)
    check_output_location(cfg.paths)
    config_digest = cfg.digest()
    run_key = new_run_key()
    layout = PartitionLayout(cfg.paths.output, date, run_key)
    timer = StageTimer(partial(job_description, spark), job=f"recommend {date}",
                       progress=partial(LiveProgress, spark, interval_s=cfg.progress.interval_s))

    with DateLock(cfg.paths.output, date, run_key) as lock:
        log.info("recommend %s: holding the date's lock (%s)", date, lock.kind)
        table = output_table(spark, cfg)
        for note in recover(layout, table, publish_method(layout)):
            log.warning("recommend %s: %s", date, note)
        _remove_stale_work_dirs(cfg, date, run_key)
        with timer.stage("resolve_model", "resolve model") as c:
            model, resolution_error = resolve_or_remembered(cfg.mlflow, cfg.paths.driver_dir)
            c.update(model=model.uri, version=model.version,
                     resolution="remembered" if resolution_error else "registry")
        if lock.took_over is not None:
            _end_dead_run(cfg, date, lock.took_over, lock.took_over_reason or "its lock was stale", run_key,
                          resolution_error)

        found = find_published(cfg.paths.output, date, table)
        published = found.manifest if found else None
        reason = skip_reason(published, model.version, config_digest)
        if reason is not None and not force:
            log.info("recommend %s: skipped: %s; pass --force to recompute it", date, reason)
            return NightlyResult(date, published.run_id, layout.final_dir, published, status=RunStatus.SKIPPED,
                                 reason=reason, location=found.path)
        if published is not None:
            log.info("recommend %s: replacing the published partition (%s)", date,
                     "--force" if reason else _difference(published, model.version, config_digest))

        recorder = tracking.RunRecorder(
            cfg.mlflow, run_name=f"recommend {date}", unavailable=resolution_error,
            tags={tags.JOB: tags.NIGHTLY_JOB, tags.DATE: str(date), tags.VERSION: __version__,
                  tags.JOB_RUN: run_key, tags.MODEL_VERSION: model.version, tags.LOCK: lock.kind},
        )
        if recorder.run_id is not None:
            _note_mlflow_run(lock, cfg, date, recorder.run_id)
        run = stages.NightlyRun(spark=spark, cfg=cfg, date=date, model=model, model_resolution_error=resolution_error,
                                config_digest=config_digest, layout=layout, lock=lock, recorder=recorder, timer=timer,
                                hooks=hooks, table=table, accept_guard=accept_guard, kept=kept)
        try:
            check_executors_can_write(spark, run.work_dir, configured=cfg.paths.work)
            result = _run(run)
        except BaseException as exc:
            discard_staging(layout, table)
            _cleanup(run.work_dir)
            cause = spark_cause(exc)
            recorder.set_tags({tags.STATUS: RunStatus.FAILED.value,
                               tags.ERROR: redact_text(recorded_error(exc, cause))[:4000],
                               **run_record.failure_tags(date, exc, cause)})
            if isinstance(exc, GuardRefused):
                compare.record_refusal(recorder, cfg, date, exc, table)
            elif isinstance(exc, ValidationFailed):
                recorder.log_dict(exc.report, "validation_report.json")
            recorder.end("FAILED")
            raise
        _cleanup(run.work_dir)
        recorder.end("FINISHED")
        if recorder.failed:
            result.exit_code = ExitCode.TRACKING_FAILED
            result.manifest = manifest_file.mark_unrecorded([d for d in (result.location, result.output_dir) if d],
                                                            result.manifest, recorder.error)
            log.warning("recommendations for %s are published, but the MLflow run could not be recorded (%s); "
                        "the manifest holds the run's figures", date, recorder.error)
        return result


def output_table(spark: SparkSession, cfg: Config) -> OutputTable | None:
    """``output.table``, created if missing (then every date a pointer names is registered in it), or None."""
    table = open_table(spark, cfg.output.table, cfg.paths.output, metastore.resolve(cfg.output.metastore).hint())
    if table is not None and table.created:
        for note in register_dates(cfg.paths.output, table):
            log.info("%s", note)
    return table


def _note_mlflow_run(lock: DateLock, cfg: Config, date: dt.date, mlflow_run_id: str) -> None:
    """Put this run's MLflow run id in the date's lock: if this process dies, the run that takes the lock
    over ends that MLflow run (KILLED) instead of leaving it RUNNING forever. Losing the note costs only that."""
    try:
        lock.annotate(mlflow_run_id=mlflow_run_id, tracking_store=tracking.tracking_store_id(cfg.mlflow.tracking_uri))
    except OSError as exc:
        log.warning("recommend %s: could not record MLflow run %s in the lock %s (%s); if this run dies, its MLflow "
                    "run stays RUNNING", date, mlflow_run_id, lock.path, exc)


def _end_dead_run(cfg: Config, date: dt.date, dead: Holder, why: str, run_key: str, tracking_down: str | None) -> None:
    """End the MLflow run of the run whose stale lock this one took over: KILLED, with who found it dead and when.

    Never fails this run: the dead run's MLflow record is bookkeeping, tonight's partition is not. What
    cannot be done (MLflow down, the dead run recorded in another store) is logged, naming the run left
    RUNNING, so that an operator can end it by hand.
    """
    here = tracking.tracking_store_id(cfg.mlflow.tracking_uri)
    which = f"MLflow run {dead.mlflow_run_id}" if dead.mlflow_run_id else f"the MLflow run tagged {tags.JOB_RUN}={dead.run}"
    if dead.tracking_store and dead.tracking_store != here:
        log.warning("recommend %s: the dead run %s recorded %s in another tracking store (%s, this run uses %s); "
                    "it stays RUNNING there", date, dead.run, which, dead.tracking_store, here)
        return
    if tracking_down is not None:
        log.warning("recommend %s: MLflow is unreachable, so %s of the dead run %s stays RUNNING", date, which, dead.run)
        return
    last_alive = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=dead.heartbeat_age_s)
    try:
        ended = tracking.end_killed_run(cfg.mlflow, mlflow_run_id=dead.mlflow_run_id, job_run=dead.run,
                                        found_by=run_key, why=why,
                                        last_alive=last_alive)
    except Exception as exc:   # MLflow misbehaving: never worth failing the night for
        log.warning("recommend %s: could not end %s of the dead run %s: %s; it stays RUNNING", date, which, dead.run,
                    first_line(exc, with_type=True))
        return
    if ended is not None:
        log.warning("recommend %s: ended MLflow run %s of the dead run %s as KILLED (found dead by run %s)", date,
                    ended, dead.run, run_key)


def skip_reason(published: Manifest | None, model_version: str, config_digest: str) -> str | None:
    """Why the published partition already is what this run would produce, or None if it is not."""
    if published is None:
        return None
    if published.model.version == model_version and published.config_digest == config_digest:
        return (f"already published at {published.published_at or '?'} by run "
                f"{published.run_id or published.job_run or '?'} with model version {model_version} "
                f"and config digest {config_digest}")
    return None


def _difference(published: Manifest, model_version: str, config_digest: str) -> str:
    old_version = published.model.version
    if old_version != model_version:
        return f"published with model version {old_version}, the alias now points at {model_version}"
    return f"published with config digest {published.config_digest}, now {config_digest}"


def _remove_stale_work_dirs(cfg: Config, date: dt.date, run_key: str) -> None:
    """Scratch directories of this date's earlier runs: dead, since this run holds the date's lock."""
    base = stages.date_work_root(cfg.paths.work, date)
    fs, root = rfs.resolve(base)
    for path in rfs.list_dirs(fs, root):
        name = path.rsplit("/", 1)[1]
        if name != run_key:
            _cleanup(rfs.join(base, name))


def _run(run: stages.NightlyRun) -> NightlyResult:
    """The stages in the order data flows through them; each takes the frozen results of the ones before."""
    cfg, date, model, timer, recorder = run.cfg, run.date, run.model, run.timer, run.recorder
    recorder.log_params(stages.run_params(cfg, date, model, run.config_digest))
    with timer.stage("read_catalog", "read the latest catalog snapshot") as c:
        catalog = stages.read_catalog(run.spark, cfg.paths, cfg.catalog.max_age_days, date,
                                      stages.load_vocabulary(model), model.version, cfg.recommend)
        c.update(snapshot=str(catalog.snapshot.date), **catalog.figures)
    recorder.log_params({"catalog_snapshot": str(catalog.snapshot.date)})

    with timer.stage("previous", "find the previous published partition") as c:
        previous = compare.previous_night(cfg, date, run.table)
        c.update(previous=str(previous.previous.date) if previous.previous else "none")

    with timer.stage("histories", "read events and build histories") as c:
        history = stages.read_histories(run, touched_since=previous.touched_since,
                                        frequency_items=cfg.scoring.top_n)
        c.update(history.figures)

    with timer.stage("fallback", "popularity fallback") as c:
        fallback = stages.popularity_fallback_stage(history.histories, catalog.candidates, cfg.scoring.top_n,
                                                    lists_for=date)
        c.update(items=len(fallback.fallback.item_ids),
                 items_of_the_last_day=int((fallback.recent_users > 0).sum()))

    with timer.stage("score", "score users", expected_users=history.figures["users_in_window"]) as c:
        scored = stages.score(run, catalog, history, fallback, previous)
        w = scored.worker
        c.update(users=w.users, model_users=w.totals.chunks.model_users, fallback=w.totals.chunks.fallback_users,
                 users_per_s=round(scored.users_per_s), device=w.device, model_loads=w.totals.model.misses,
                 workers=len(w.workers), tasks=w.tasks, retried_tasks=w.task_retries)
        if w.task_retries:
            log.warning("recommend %s: %d scoring task(s) succeeded only on a retry; their model was loaded again "
                        "(model_misses=%d)", date, w.task_retries, w.totals.model.misses)
    run.hooks.pause("staged")

    with timer.stage("validate", "validate staged output") as c:
        report = stages.validate(scored, history, catalog, date)
        c.update(passed=report.passed, rows=report.figures["rows"], coverage=round(report.figures["catalog_coverage"], 4))

    with timer.stage("guard", "judge the night against the previous one") as c:
        guard = compare.guard_stage(previous, scored.worker.compare, report, catalog.candidates.item_ids,
                                    fallback.popularity, run.accept_guard)
        c.update(verdict=guard.verdict.verdict)

    results = stages.StageResults(catalog, history, fallback, scored, report, guard)
    metrics = stages.run_metrics(results)
    manifest = stages.manifest(run, results, metrics)
    with timer.stage("publish", "publish partition") as c:
        night = stages.publish(run, manifest)
        c.update(path=run.layout.final_dir, run_dir=night.path, table=cfg.output.table or "none",
                 method=manifest.publish_method)
    with timer.stage("retention", "remove what output.keep_runs and output.retention_days no longer keep") as c:
        removed = stages.retain(run)
        c.update(removed=len(removed))

    metrics = {**metrics, **timer.as_metrics(), **timer.shares(), "total_s": timer.total}
    with timer.stage("record", "record the run"):
        stages.record(run, results, night, manifest, metrics)
    log.info("recommend %s: %s %s", date, STAGE_BREAKDOWN, json.dumps(timer.breakdown()))
    log.info("recommend %s: published %s rows to %s in %.1fs (run %s)", date, report.figures["rows"], night.path,
             timer.total, recorder.run_id or "untracked")
    return NightlyResult(date, recorder.run_id, run.layout.final_dir, manifest, metrics, location=night.path)


def _cleanup(work_dir: str) -> None:
    try:
        fs, path = rfs.resolve(work_dir)
        rfs.delete_dir_if_exists(fs, path)
    except OSError as exc:  # leftover scratch data is not worth failing a published run for
        log.warning("could not remove work directory %s: %s", work_dir, exc)
