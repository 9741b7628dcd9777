"""The stages of the nightly path, each a function with typed inputs and a small frozen result.

    read_catalog -> (the previous night) -> read_histories -> popularity_fallback_stage -> score -> validate
    -> (the guard) -> manifest -> publish -> retain -> record

``recsys.pipelines.nightly.run_nightly`` calls them in that order, one call each, under the date's lock and
an MLflow run; the comparison with the previous night is one stage object
(:class:`recsys.pipelines.nightly_compare.Comparison`) that the histories, the scoring pass and the guard
use. An on-demand request for a few users calls the same functions: ``read_catalog``,
``popularity_fallback_stage``, and ``scoring_spec`` + ``score_users`` score any histories DataFrame
without writing or publishing anything. Data flows one way: a stage reads only the results handed to it.

The figures of a run (MLflow metrics, the manifest's ``metrics`` and ``counts``) are assembled from
the stage results in one place, :func:`run_metrics`; the per-stage log lines show the same numbers.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import io
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from recsys import __version__
from recsys import fs as rfs
from recsys.config import Config, PathsConfig, RecommendConfig
from recsys.data import history as hist
from recsys.data import rules as data_rules
from recsys.data.contracts import HISTORY_COLUMN, OUTPUT_SPARK_DDL, partition_name, start_of_day_us
from recsys.data.readers import (CatalogSnapshot, KeptWindow, catalog_figures, events_window_once,
                                 read_catalog_snapshot, read_errors_as_input_errors, window_start)
from recsys.errors import ConfigError, InputDataError, RunStatus, ValidationFailed, first_line
from recsys.hooks import NO_HOOKS, Hooks
from recsys.model.io import read_item_ids, read_new_item_ids
from recsys.pipelines import nightly_compare as compare
from recsys.pipelines.nightly_compare import Comparison, GuardStage
from recsys.pipelines.timing import StageTimer
from recsys.publish import manifest as manifest_file
from recsys.publish import retention
from recsys.publish.lock import DateLock
from recsys.publish.manifest import Counts, FallbackList, Manifest, ModelRef, TrackingNote
from recsys.publish.published import PublishedPartition
from recsys.publish.publisher import PartitionLayout, publish_method
from recsys.publish.publisher import publish as publish_partition
from recsys.publish.table import OutputTable
from recsys.publish.validate import ValidationReport, in_pass_report, row_checks
from recsys.scoring.compare import CompareSpec
from recsys.scoring.core import (Candidates, Fallback, UnsupportedDtype, candidate_set, counts_per_candidate,
                                 popularity_fallback)
from recsys.scoring.figures import WorkerFigures
from recsys.scoring.params import RuleParams, ScoringParams
from recsys.scoring.shipping import ShippedModel, ship_model
from recsys.scoring.stage import score_histories, scoring_tasks, worker_figures
from recsys.scoring.udf import ScoringSpec
from recsys.sequences import Vocabulary
from recsys.spark.session import default_parallelism
from recsys.tracking import run_notes
from recsys.tracking import store as tracking
from recsys.tracking import tags
from recsys.redaction import redact_text, redact_uri

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# the run


@dataclass(frozen=True)
class NightlyRun:
    """One date's run as the stages after the model's resolution see it: the context handed down
    once instead of the same ten loose parameters at every call. Built by
    :func:`recsys.pipelines.nightly.run_nightly` under the date's lock, once the MLflow run exists."""

    spark: SparkSession
    cfg: Config
    date: dt.date
    model: tracking.ResolvedModel
    model_resolution_error: str | None   # MLflow was unreachable: the remembered resolution is used
    config_digest: str
    layout: PartitionLayout               # staging and final directories; its run key names this attempt
    lock: DateLock
    recorder: tracking.RunRecorder
    timer: StageTimer
    hooks: Hooks = NO_HOOKS
    table: OutputTable | None = None      # output.table; None: the paths only
    accept_guard: bool = False            # publish even if the guard refuses the night (--accept-guard), recorded
    kept: KeptWindow | None = None        # the events window this process keeps for the night (recsys night)

    @property
    def work_dir(self) -> str:
        """This attempt's scratch directory (histories), removed when the run ends."""
        return rfs.join(date_work_root(self.cfg.paths.work, self.date), self.layout.run_key)


def date_work_root(work: str, date: dt.date) -> str:
    """Where every attempt of ``date`` keeps its scratch directory, under ``paths.work``."""
    return rfs.join(work, "runs", partition_name(date))


# ------------------------------------------------------------------------------------------------
# read the catalog


@dataclass(frozen=True)
class CatalogStage:
    """The catalog snapshot the run uses and the candidate set it yields for the model."""

    snapshot: CatalogSnapshot
    candidates: Candidates            # available in the snapshot, let in by the catalog rules and known to the
                                      # model, model-index order
    figures: Mapping[str, int]        # rows, null_item_ids, distinct_items, available_items, rule_excluded_items,
                                      # available_unknown_to_model, candidate_items

    @property
    def digest(self) -> str:
        """Identifies the candidate set in the workers' scorer cache key."""
        values = np.ascontiguousarray(self.candidates.index)
        return f"{self.snapshot.date}:{hashlib.sha256(values.tobytes()).hexdigest()[:16]}"


def load_vocabulary(model: tracking.ResolvedModel) -> Vocabulary:
    """The resolved model's item vocabulary, read from its files without loading the weights."""
    return Vocabulary(read_item_ids(model.local_dir))


def read_catalog(spark: SparkSession, paths: PathsConfig, catalog_max_age_days: int, date: dt.date,
                 vocab: Vocabulary, model_version: str, rules: RecommendConfig | None = None) -> CatalogStage:
    """The newest catalog snapshot on or before ``date``, checked, and its candidates for the model.

    ``rules``: the operators' catalog rules (``recommend.exclude.catalog``, ``recommend.include.catalog``) keep
    items out of the candidates here, on the snapshot the driver reads anyway; a column the snapshot lacks, or a
    value its type cannot hold, stops the run (exit 2) naming it."""
    columns = rules.catalog_columns if rules is not None else ()
    snapshot = read_catalog_snapshot(spark, paths.catalog, date, catalog_max_age_days, columns=columns)
    where = f"catalog snapshot {snapshot.date} under {redact_uri(paths.catalog)!r}"
    if columns:
        data_rules.check_catalog_columns(rules, list(snapshot.frame.columns), where)
    figures, available_ids = catalog_figures(snapshot, paths.catalog)
    rule_excluded = 0
    if columns:
        allowed = snapshot.table.column("item_id").to_numpy()[data_rules.catalog_rule_mask(snapshot.table, rules, where)]
        kept = available_ids[np.isin(available_ids, allowed)]
        rule_excluded = int(len(available_ids) - len(kept))
        if len(kept) == 0:
            raise InputDataError(f"the catalog rules (recommend.exclude.catalog, recommend.include.catalog) leave none "
                                 f"of the {len(available_ids)} available items of {where} a candidate; check their "
                                 "columns and values")
        available_ids = kept
    figures = {**figures, "rule_excluded_items": rule_excluded}
    candidates, unknown = candidate_set(available_ids, vocab)
    if len(candidates.index) == 0:
        raise InputDataError(
            f"none of the {len(available_ids)} available items in catalog snapshot {snapshot.date} is known to "
            f"model version {model_version}; retrain the model or check the catalog"
        )
    figures = {**figures, "available_unknown_to_model": unknown, "candidate_items": int(len(candidates.index))}
    return CatalogStage(snapshot, candidates, figures)


# ------------------------------------------------------------------------------------------------
# read events, build histories


@dataclass(frozen=True)
class HistoryStage:
    """Per-user histories of the window (``user_id``, ``history``), and the counts seen building them."""

    histories: DataFrame              # read back from where they were written: computed once
    figures: Mapping[str, int]        # events_read, dropped_null_*, users_in_window, history_items, history_max_len
    window_start: dt.date             # first day of the window; the window ends before the run date


def read_histories(run: NightlyRun, touched_since: dt.date | None = None,
                   users: Iterable[int] | None = None, frequency_items: int | None = None) -> HistoryStage:
    """Events of the ``history.window_days`` days before the run's date -> histories written to the run's
    scratch directory (``histories``), read back from there.

    ``touched_since``: the histories also hold each user's items touched from that day on
    (``touched_items``, :func:`recsys.data.history.build_histories`): the previous night's realized hits
    (:attr:`recsys.pipelines.nightly_compare.Comparison.touched_since`), which of them the user knew before
    (``touched_known_items``) and, given ``frequency_items`` (scoring.top_n), the user's personal-frequency
    list as of that day (``personal_frequency_items``), the baseline beside popularity. ``users``: only these
    user ids; None: every user with events in the window. With event rules (``recommend.exclude.events``), the
    histories also hold each user's ``excluded_items``, from the same aggregation; a rule whose event type
    the window never holds stops the run (exit 2) naming it, before anything is scored. Refuses a window
    without usable events, naming the path and the settings to check.
    """
    spark, paths, history, rules, date = run.spark, run.cfg.paths, run.cfg.history, run.cfg.recommend, run.date
    out_dir = rfs.join(run.work_dir, "histories")
    obs_events, obs_hist = Observation("events"), Observation("histories")
    raw = events_window_once(spark, paths.events, date, history.window_days, history.event_types, run.kept)
    if users is not None:
        raw = raw.filter(F.col("user_id").isin([int(u) for u in users]))
    exclude = data_rules.exclusion_since(rules, date)
    event_metrics = [*hist.input_quality_metrics(), *(data_rules.event_type_counts(rules) if exclude else [])]
    history_metrics = hist.history_metrics(excluded=bool(exclude))
    events = hist.drop_null_ids(raw.observe(obs_events, *event_metrics))
    since = dt.datetime.combine(touched_since, dt.time()) if touched_since is not None else None
    histories = hist.build_histories(events, max_items=history.max_items, tie_break_seed=history.tie_break_seed,
                                     touched_since=since, frequency_items=frequency_items, exclude=exclude)
    with read_errors_as_input_errors("events", paths.events):
        histories.observe(obs_hist, *history_metrics).write.mode("overwrite").parquet(out_dir)
        observed = {
            **_observed(obs_events, lambda: raw.agg(*event_metrics).first().asDict()),
            **_observed(obs_hist, lambda: spark.read.parquet(out_dir).agg(*history_metrics).first().asDict()),
        }
    figures = {k: int(v or 0) for k, v in observed.items()}
    start = window_start(date, history.window_days)
    if figures["users_in_window"] == 0 and users is None:
        raise InputDataError(
            f"no usable events between {start} and {date} (exclusive) under {redact_uri(paths.events)!r} "
            f"({figures['events_read']} rows read, {figures['dropped_null_user_id']} without a user, "
            f"{figures['dropped_null_item_id']} without an item); check the events path, "
            f"history.window_days and history.event_types"
        )
    if exclude and users is None:   # a few users' events say nothing about the window's types
        data_rules.check_event_types(
            rules, figures, lambda: sorted(r[0] for r in raw.select("event_type").distinct().limit(1000).collect()
                                           if r[0] is not None),
            f"the events between {start} and {date} (exclusive) under {redact_uri(paths.events)!r}")
    figures = {k: v for k, v in figures.items() if not k.startswith("rule_events_")}
    return HistoryStage(spark.read.parquet(out_dir), figures, start)


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


# ------------------------------------------------------------------------------------------------
# popularity fallback


@dataclass(frozen=True)
class FallbackStage:
    """The list users get when the model cannot score them, and the popularity it was ranked by."""

    fallback: Fallback
    popularity: np.ndarray            # [C] users per candidate in the window, aligned with candidates.item_ids
    recent_users: np.ndarray | None = None   # [C] of them, those who had it on the day before the lists' day


def popularity_fallback_stage(histories: DataFrame, candidates: Candidates, top_n: int,
                              lists_for: dt.date | None = None) -> FallbackStage:
    """Users per item in ``histories``, restricted to the candidates -> the popularity fallback. With
    ``lists_for``, in the same pass, the users whose latest event with the item falls on the day before it or
    later: the new items' recent-popularity prior (:func:`recsys.model.repeats.popularity_prior`), counted as the
    repeat blend's fit counted it on its validation days (:mod:`recsys.learning.repeats`)."""
    entry = F.explode(F.zip_with(HISTORY_COLUMN, hist.HISTORY_LAST_US_COLUMN,
                                 lambda item, last: F.struct(item.alias("item_id"), last.alias("last_us"))))
    since = None if lists_for is None else start_of_day_us(lists_for - dt.timedelta(days=1))
    recent = F.lit(0) if since is None else (F.col("e.last_us") >= F.lit(since)).cast("long")
    counted = (histories.select(entry.alias("e")).groupBy(F.col("e.item_id").alias("item_id"))
               .agg(F.count(F.lit(1)).alias("count"), F.sum(recent).alias("recent")).toArrow())
    item_ids = counted.column("item_id").to_numpy()
    per_candidate = counts_per_candidate(candidates.item_ids, item_ids, counted.column("count").to_numpy())
    recent_users = (None if since is None else
                    counts_per_candidate(candidates.item_ids, item_ids, counted.column("recent").to_numpy()))
    return FallbackStage(popularity_fallback(candidates.item_ids, per_candidate, top_n), per_candidate, recent_users)


# ------------------------------------------------------------------------------------------------
# score


def scoring_spec(model: ShippedModel, catalog: CatalogStage, fallback: FallbackStage, cfg: Config, *,
                 lists_for: dt.date | None, hooks: Hooks = NO_HOOKS, compare: CompareSpec | None = None) -> ScoringSpec:
    """What every scoring task needs, minted once on the driver; ``model``: the files handed to Spark
    (:func:`recsys.scoring.shipping.ship_model`), never a driver path. ``fallback``: the fallback list and the
    popularity ranking that lists the operators' rules (``cfg.recommend``) left short are filled from.
    ``lists_for``: the date the lists are for, from whose start known items' ages are counted (the repeat
    blend; None: no ages, known items masked). ``compare``: what the tasks compare tonight's lists with
    (:attr:`recsys.pipelines.nightly_compare.Comparison.spec`), None: nothing."""
    return ScoringSpec(
        model=model,
        model_version=model.version,
        candidates_index=catalog.candidates.index.astype(np.int64),
        candidates_item_ids=catalog.candidates.item_ids.astype(np.int64),
        candidates_digest=catalog.digest,
        fallback_item_ids=fallback.fallback.item_ids,
        fallback_scores=fallback.fallback.scores,
        fallback_name=fallback.fallback.name,
        params=ScoringParams.from_config(cfg.scoring),
        hooks=hooks,
        compare=compare,
        lists_for_us=None if lists_for is None else start_of_day_us(lists_for),
        rules=RuleParams.from_config(cfg.recommend),
        popularity=np.asarray(fallback.popularity, dtype=np.int64),
        recent_users=None if fallback.recent_users is None else np.asarray(fallback.recent_users, dtype=np.int64),
    )


def score_users(histories: DataFrame, spec: ScoringSpec, partitions: int = 0) -> tuple[DataFrame, Observation]:
    """Any histories DataFrame -> scored rows (lazy) and the Observation of the workers' figures.

    The nightly job writes the rows (:func:`score`); an on-demand request may collect them instead.
    """
    return score_histories(histories, spec, partitions)


@dataclass(frozen=True)
class ScoreStage:
    """The scored rows written to ``output_dir`` (staging), and what the workers reported."""

    output_dir: str
    worker: WorkerFigures
    write_seconds: float
    rows: Mapping[str, int]           # recsys.publish.validate.row_checks, observed on the rows as written
    new_items: Mapping[str, int] = field(default_factory=dict)   # new_item_figures: the model's new items in the lists

    @property
    def users_per_s(self) -> float:
        return self.worker.users / self.write_seconds if self.write_seconds > 0 else 0.0


def score(run: NightlyRun, catalog: CatalogStage, history: HistoryStage, fallback: FallbackStage,
          previous: Comparison) -> ScoreStage:
    """Score every user of the histories and write the rows to the run's staging directory (overwritten).

    The scoring spec is built here, once: the model shipped through Spark, tonight's candidates and
    fallback, and the comparison the tasks make (``previous.spec``). So is the number of tasks
    (:func:`recsys.scoring.stage.scoring_tasks`): the histories are split by user into them, together
    with the previous night's lists when there is one (``previous.join``, the same exchange).
    Validation happens in this pass: the tasks check their own rows (``recsys.scoring.checks``) and
    the row checks are observed on the rows as they are written; :func:`validate` only adds up.
    """
    spark, cfg, model = run.spark, run.cfg, run.model
    shipped = ship_model(spark, model.local_dir, name=model.name, version=model.version, scratch=cfg.paths.driver_dir)
    spec = scoring_spec(shipped, catalog, fallback, cfg, lists_for=run.date, hooks=run.hooks, compare=previous.spec)
    tasks = scoring_tasks(history.figures["users_in_window"], partitions=cfg.scoring.partitions,
                          users_per_task=cfg.scoring.users_per_task, cores=default_parallelism(spark),
                          exchange=previous.joins)
    if previous.joins:   # split into the tasks together with the previous lists: the scoring pass keeps that split
        scored = _score_and_write(previous.join(history.histories, tasks), spec, 0, run.layout.staging_dir, run.hooks)
    else:
        scored = _score_and_write(history.histories, spec, tasks, run.layout.staging_dir, run.hooks)
    figures = new_item_figures(read_new_item_ids(model.local_dir), scored.worker.checks.item_ids,
                               scored.worker.checks.item_times)
    return dataclasses.replace(scored, new_items=figures)


def new_item_figures(new_item_ids: np.ndarray | None, item_ids: np.ndarray, item_times: np.ndarray) -> dict[str, int]:
    """How the lists carry the items the model is the first version to know (``new_item_ids``, recorded at
    training; None: not recorded, no figures): ``model_new_items`` (how many it knows), ``new_items_recommended``
    (how many of them are in at least one list) and ``new_item_slots`` (the list places they fill), from the
    tasks' per-item counts of what they recommended (``item_ids`` with ``item_times``).

    >>> new_item_figures(np.array([5, 9]), np.array([1, 5, 7]), np.array([10, 3, 1]))
    {'model_new_items': 2, 'new_items_recommended': 1, 'new_item_slots': 3}
    """
    if new_item_ids is None:
        return {}
    new = np.isin(np.asarray(item_ids), np.asarray(new_item_ids))
    times = np.asarray(item_times)[new]
    return {"model_new_items": int(len(new_item_ids)), "new_items_recommended": int((times > 0).sum()),
            "new_item_slots": int(times.sum())}


def _score_and_write(histories: DataFrame, spec: ScoringSpec, partitions: int, output_dir: str,
                     hooks: Hooks) -> ScoreStage:
    """Score ``histories`` (split into ``partitions`` by user first; 0: as they are) and write the rows."""
    scored, observation = score_users(histories, spec, partitions)
    if hooks.holds_while_writing():
        scored = scored.mapInArrow(_hold_first_task_while_writing(hooks.pause_max_s), OUTPUT_SPARK_DDL)
    checks = row_checks(top_n=spec.params.top_n, fallback_name=spec.fallback_name, model_version=spec.model_version)
    rows = Observation("row_checks")
    started = time.perf_counter()
    try:
        scored.observe(rows, *checks).write.mode("overwrite").parquet(output_dir)
    except Exception as exc:
        refusal = workers_refusal(exc)
        if refusal is None:
            raise
        raise ConfigError(f"the executors refused scoring.dtype={spec.params.dtype}: {refusal}") from None
    seconds = time.perf_counter() - started
    observed = _observed(rows, lambda: histories.sparkSession.read.parquet(output_dir).agg(*checks).first().asDict())
    return ScoreStage(output_dir, worker_figures(observation), seconds, {k: int(v or 0) for k, v in observed.items()})


def workers_refusal(exc: BaseException) -> str | None:
    """The reason an executor gave for refusing the scoring configuration (the first line of its
    :class:`~recsys.scoring.core.UnsupportedDtype`, found in Spark's error text), or None if the
    failure was anything else. The executors' device decides (a GPU, or a CPU with or without bf16),
    so the driver cannot check this up front."""
    marker = f"{UnsupportedDtype.__name__}: "
    text = str(exc)
    if marker not in text:
        return None
    return redact_text(text.split(marker, 1)[1].splitlines()[0].strip())[:500]


def _hold_first_task_while_writing(max_s: float):
    """A ``mapInArrow`` pass-through holding partition 0's first attempt after its first batch (the
    ``writing`` pause point, :mod:`recsys.hooks`); in the plan only when that pause is asked for."""

    def passthrough(batches):
        from pyspark import TaskContext

        from recsys.hooks import hold

        ctx = TaskContext.get()
        holding = ctx is not None and ctx.partitionId() == 0 and ctx.attemptNumber() == 0
        for batch in batches:
            yield batch
            if holding:
                hold("writing", max_s)
                holding = False
        if holding:   # an empty partition: hold anyway, the other tasks are writing
            hold("writing", max_s)

    return passthrough


# ------------------------------------------------------------------------------------------------
# validate


def validate(scored: ScoreStage, history: HistoryStage, catalog: CatalogStage, date: dt.date) -> ValidationReport:
    """The report of the checks the scoring pass ran; raises ValidationFailed (nothing is published)
    when one failed. No pass over the output: the tasks' counts and the observed row checks are added
    up, and rows out are compared with the users counted while the histories were built.
    """
    checks = scored.worker.checks
    report = in_pass_report(scored.rows, checks.counts, (checks.item_ids, checks.item_times),
                            candidate_ids=catalog.candidates.item_ids,
                            users_in_window=history.figures["users_in_window"])
    if not report.passed:
        raise ValidationFailed(
            f"validation failed for {date}, nothing published: " + "; ".join(report.failures()),
            report.as_dict(),
        )
    return report


# ------------------------------------------------------------------------------------------------
# the run's figures, in one place


@dataclass(frozen=True)
class StageResults:
    """What the stages up to the guard handed on: everything the manifest and the record are made of."""

    catalog: CatalogStage
    history: HistoryStage
    fallback: FallbackStage
    scored: ScoreStage
    report: ValidationReport
    guard: GuardStage                 # tonight against the last night, judged


def run_metrics(results: StageResults) -> dict[str, float]:
    """Every figure of a run that MLflow and the manifest carry, from the stage results.

    Later entries win on a shared name, in stage order (e.g. ``short_lists`` is the validation's
    count of the written rows, not the workers').
    """
    worker = results.scored.worker
    return {
        **{f"catalog_{k}": v for k, v in results.catalog.figures.items()},
        **results.history.figures,
        "users_scored": worker.totals.chunks.model_users,
        "fallback_users": worker.totals.chunks.fallback_users,
        "users_per_s": results.scored.users_per_s,
        **worker.metrics(),
        **results.scored.new_items,
        **results.report.figures,
        **results.guard.metrics(),
    }


def run_params(cfg: Config, date: dt.date, model: tracking.ResolvedModel, config_digest: str) -> dict[str, Any]:
    """The run's MLflow parameters: what it was asked to do (paths and URIs without credentials)."""
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
        **rule_params(cfg.recommend),
        "events_path": redact_uri(cfg.paths.events),
        "catalog_path": redact_uri(cfg.paths.catalog),
        "output_path": redact_uri(cfg.paths.output),
        "config_digest": config_digest,
        "tracking_uri": redact_uri(cfg.mlflow.tracking_uri),
        "recsys_version": __version__,
    }


def rule_params(rules: RecommendConfig) -> dict[str, Any]:
    """The operators' rules as MLflow parameters (``rules_*``), each readable alone; a catalog rule longer than
    MLflow keeps is cut short, saying so (the manifest's ``rules`` holds them whole)."""
    def cut(text: str, limit: int = 500) -> str:
        return text if len(text) <= limit else text[:limit] + "... (cut; the manifest holds it whole)"

    def catalog(rule: Mapping[str, Any]) -> str:
        return cut(";".join(f"{column}={','.join(map(str, values))}" for column, values in rule.items()) or "none")

    return {
        "rules_exclude_touched": rules.exclude.touched,
        "rules_exclude_events": ",".join(f"{r.event_type}:{r.within_days}d" for r in rules.exclude.events) or "none",
        "rules_exclude_catalog": catalog(rules.exclude.catalog),
        "rules_include_catalog": catalog(rules.include.catalog),
        "rules_min_new_items": rules.min_new_items,
        "rules_fill": rules.fill,
    }


def manifest(run: NightlyRun, results: StageResults, metrics: Mapping[str, float]) -> Manifest:
    """``_manifest.json`` from the run and its stage results, finished (format fields, redaction) by
    :func:`recsys.publish.manifest.finish`: written into the partition as it is published (by the method
    it names, :func:`recsys.publish.publisher.publish_method`), and logged to MLflow unchanged. The timings
    are the stage timer's at this moment (before publish)."""
    cfg, model, model_resolution_error, report = run.cfg, run.model, run.model_resolution_error, results.report
    fallback = results.fallback.fallback
    return manifest_file.finish(Manifest(
        date=run.date,
        run_id=run.recorder.run_id,
        job_run=run.layout.run_key,
        publish_method=publish_method(run.layout),
        model=ModelRef(uri=model.uri, name=model.name, alias=model.alias, version=model.version,
                       source=redact_uri(model.source),
                       resolution=f"remembered: {model_resolution_error}" if model_resolution_error else "registry"),
        catalog_snapshot=results.catalog.snapshot.date,
        config_digest=run.config_digest,
        rules=cfg.recommend.summary(),              # what the operators' rules excluded, included, filled
        counts=Counts(
            rows=report.figures["rows"],
            users_in_window=int(metrics.get("users_in_window", 0)),
            model_users=int(metrics.get("users_scored", 0)),
            fallback_users=int(metrics.get("fallback_users", 0)),
            candidate_items=int(metrics.get("catalog_candidate_items", 0)),
            events_read=int(metrics.get("events_read", 0)),
        ),
        validation=report.as_dict()["violations"],
        fallback=FallbackList(name=fallback.name,    # what users without a row get (recsys export)
                              item_ids=tuple(int(i) for i in fallback.item_ids),
                              scores=tuple(float(x) for x in fallback.scores)),
        metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        timings={**run.timer.as_metrics(), **run.timer.shares()},
        tracking=TrackingNote(uri=redact_uri(cfg.mlflow.tracking_uri), experiment=cfg.mlflow.experiment,
                              error=run.recorder.error),
        workers=tuple(worker_summary(results.scored)),
        quality=results.guard.manifest_section(),
    ))


def worker_summary(scored: ScoreStage) -> list[dict[str, Any]]:
    """Who scored, for the manifest: each Python worker's interpreter, GPU addresses, tasks and model loads."""
    return [{"host": w.host, "pid": w.pid, "python": w.python, "gpus": w.gpus, "tasks": w.tasks,
             "model_misses": w.sums.model.misses, "model_hits": w.sums.model.hits}
            for w in scored.worker.workers]


# ------------------------------------------------------------------------------------------------
# publish, retention


def publish(run: NightlyRun, published_manifest: Manifest) -> PublishedPartition:
    """The validated, judged night published with its manifest, by the manifest's method, if this run
    still holds the date's lock (checked after the pointer is read, before the first switch); returns what
    is now published (its path: the run directory)."""
    return publish_partition(run.layout, published_manifest, published_manifest.publish_method, run.hooks,
                             run.table, still_ours=run.lock.verify)


def retain(run: NightlyRun) -> list[str]:
    """Retention after a publish (``output.keep_runs``, ``output.retention_days``); what it removed.

    A failure only warns: the night is published, the next run tries again."""
    out, date = run.cfg.output, run.date
    try:
        notes = retention.trim_runs(run.cfg.paths.output, date, out.keep_runs, run.hooks)
        notes += retention.retire_dates(run.cfg.paths.output, date, out.retention_days, run.table, run.layout.run_key,
                                        run.hooks)
    except Exception as exc:   # never worth failing a published night for
        log.warning("recommend %s: retention stopped: %s; the next run tries again", date, first_line(exc, with_type=True))
        return []
    for note in notes:
        log.info("recommend %s: %s", date, note)
    return notes


# ------------------------------------------------------------------------------------------------
# record


SCORE_SAMPLE = 20_000   # scores (with their ranks) plotted in the score distribution


def record(run: NightlyRun, results: StageResults, night: PublishedPartition, published_manifest: Manifest,
           metrics: Mapping[str, float]) -> None:
    """The run in MLflow: metrics, per-worker cache figures, artifacts and plots, the guard's report and
    trend (:func:`recsys.pipelines.nightly_compare.record`), the run's note and input datasets
    (:func:`recsys.tracking.run_notes.record`); each call degrades, never raises."""
    _record_run(run, results, night.path, published_manifest, metrics)
    compare.record(run.recorder, results.guard, results.report.figures["catalog_coverage"], run.table)
    run_notes.record(run.recorder, published_manifest.as_dict(), metrics, run_notes.Inputs.of(run.cfg.paths,
                                                                                              run.cfg.history))


def _record_run(run: NightlyRun, results: StageResults, published_dir: str, published_manifest: Manifest,
                metrics: Mapping[str, float]) -> None:
    import yaml

    from recsys.tracking import plots

    recorder, spark, cfg = run.recorder, run.spark, run.cfg
    scored, report, catalog, fallback = results.scored, results.report, results.catalog, results.fallback

    recorder.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    for step, w in enumerate(scored.worker.workers):   # one point per worker: a per-worker series in the UI
        recorder.log_metrics({"worker_model_misses": w.sums.model.misses, "worker_model_hits": w.sums.model.hits,
                              "worker_model_load_s": w.sums.model.load_s, "worker_tasks": w.tasks}, step=step)
    recorder.log_dict(published_manifest.as_dict(), "manifest.json")
    recorder.log_text(yaml.safe_dump(cfg.redacted_dict(), sort_keys=False), "config.yaml")
    recorder.log_dict({"workers": [w.as_dict() for w in scored.worker.workers]}, "worker_stats.json")
    recorder.log_dict(report.as_dict(), "validation_report.json")
    recorder.set_tags({tags.STATUS: RunStatus.PUBLISHED.value, tags.OUTPUT: redact_uri(published_dir),
                       tags.MODEL_VERSION: published_manifest.model.version})
    if recorder.failed or recorder.run_id is None:
        return
    # Samples from the first rows Spark reads (a limit without an order stops after the first file):
    # users are hash-split by id across the files, so the first rows are as good a sample as any, and
    # this reads one file where ordering or sampling all rows took two passes over the output
    # (measured: docs/performance.md, "The job around the scoring stage").
    published = spark.read.parquet(published_dir)
    recorder.log_text(_recommendation_sample(published, catalog.snapshot), "recommendations_sample.csv")
    sample_users = max(1, -(-SCORE_SAMPLE // cfg.scoring.top_n))
    sample_scores = published.limit(sample_users).select(
        F.posexplode(F.transform("recommendations", lambda x: x["score"])).alias("rank", "score")).toArrow()
    fig = plots.score_distribution(sample_scores.column("score").to_numpy(), sample_scores.column("rank").to_numpy(),
                                   cfg.scoring.top_n)
    recorder.log_figure(fig, "plots/score_distribution.png")
    rec_ids, rec_times = report.item_counts
    times = counts_per_candidate(catalog.candidates.item_ids, rec_ids, rec_times)
    fig = plots.popularity_long_tail(times, fallback.popularity)
    recorder.log_figure(fig, "plots/popularity_long_tail.png")


def _recommendation_sample(published: DataFrame, catalog: CatalogSnapshot, users: int = 20) -> str:
    """A CSV of a few users' lists with item titles, for eyeballing a run in the MLflow UI (the first
    ``users`` rows read, ordered by user id)."""
    rows = published.limit(users).select(
        "user_id", "source", F.posexplode("recommendations").alias("rank", "rec")
    ).select("user_id", "source", (F.col("rank") + 1).alias("rank"), "rec.item_id", "rec.score")
    described = [c for c in ("title", "category") if c in catalog.frame.columns]
    if described:
        rows = rows.join(catalog.frame.select("item_id", *described).dropDuplicates(["item_id"]), "item_id", "left")
    pdf = rows.orderBy("user_id", "rank").toPandas()
    buf = io.StringIO()
    pdf.to_csv(buf, index=False)
    return buf.getvalue()


__all__ = ["CatalogStage", "FallbackStage", "HistoryStage", "NightlyRun", "ScoreStage", "StageResults",
           "load_vocabulary", "manifest", "popularity_fallback_stage", "publish", "read_catalog", "read_histories",
           "record", "retain", "rule_params", "run_metrics", "run_params", "score", "score_users", "scoring_spec",
           "validate"]
