"""Each night against the previous one and against what users did with it: the figures the guard judges.

The comparison is one stage object, :class:`Comparison`, found once (:func:`previous_night`) before the
histories are read; the stages after it use its parts, in the order data flows through the nightly job
(:func:`recsys.pipelines.nightly.run_nightly`):

1. :func:`previous_night`: the latest published partition P before the date D
   (:func:`recsys.publish.published.latest_published`: the one place that knows where a date's night is,
   the run directory that ``output.table`` or the date's pointer names), and what its
   manifest kept for tonight: P's popularity ranking and P's score deciles.
2. The histories stage also collects, per user, the distinct items touched since P
   (``touched_items``, same aggregation, no second pass over the window; :attr:`Comparison.touched_since`),
   which of them the user had before P (``touched_known_items``) and the user's personal-frequency list as of P.
3. The scoring stage puts :attr:`Comparison.spec` in the scoring spec and scores
   :meth:`Comparison.join`: P's lists (item ids only, read with nested-column pruning) brought next to
   the histories in the one exchange that hash-partitions them by user into the scoring tasks. The
   scoring tasks compare each user's new list with the previous one
   and the previous one with what the user touched (:mod:`recsys.scoring.compare`).
4. :func:`guard_stage`: the run's figures from the tasks' totals and the validation's per-item counts
   (:func:`figures`), judged (:mod:`recsys.pipelines.guard`); a ``fail`` raises before publishing.
5. The manifest's ``quality`` section (:func:`manifest_section`) and the MLflow record
   (:func:`record`, :func:`record_refusal`): every figure, the verdict, ``guard_report.json`` and a
   plot of the last :data:`TREND_NIGHTS` nights.

The realized hit rate is an offline proxy: P's lists shaped what users did on the days they were live,
so it measures the lists together with their effect, not what users would have done without them.
"""
from __future__ import annotations

import datetime as dt
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from recsys.config import Config
from recsys.data.contracts import HISTORY_COLUMN, PREVIOUS_COLUMN
from recsys.data.readers import window_start
from recsys.errors import GuardRefused
from recsys.model import list_metrics as lm
from recsys.pipelines import guard as guard_rules
from recsys.publish import published as published_nights
from recsys.publish.manifest import Manifest, NextNight, PreviousRef, Quality
from recsys.publish.validate import ValidationReport
from recsys.scoring.compare import CompareSpec
from recsys.scoring.core import counts_per_candidate, popularity_fallback
from recsys.tracking import tags
from recsys.tracking.store import RunRecorder

log = logging.getLogger(__name__)

TREND_NIGHTS = 30
GUARD, GUARD_CROSSED, GUARD_ACCEPTED = tags.GUARD, tags.GUARD_CROSSED, tags.GUARD_ACCEPTED


@dataclass(frozen=True)
class PreviousNight:
    """The published partition tonight is compared with, and what its manifest kept for tonight."""

    published: published_nights.PublishedPartition

    @property
    def date(self) -> dt.date:
        return self.published.date

    @property
    def path(self) -> str:
        """P's run directory (never the path view ``dt=P/``, which a rerun of P relinks under the reader)."""
        return self.published.path

    @property
    def manifest(self) -> Manifest:
        return self.published.manifest

    @property
    def rows(self) -> int:
        return self.manifest.counts.rows or 0

    @property
    def _kept(self) -> NextNight:
        return self.manifest.quality.for_next_night if self.manifest.quality is not None else NextNight()

    @property
    def popularity_ranking(self) -> np.ndarray:
        return np.asarray(self._kept.popularity_ranking, dtype=np.int64)

    @property
    def score_edges(self) -> np.ndarray:
        return np.asarray(self._kept.score_deciles or (), dtype=np.float64)

    @property
    def score_shares(self) -> np.ndarray:
        return np.asarray(self._kept.score_decile_shares or (), dtype=np.float64)

    def metric(self, name: str) -> float | None:
        value = self.manifest.metrics.get(name)
        return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class Comparison:
    """Tonight against the previous published night: the stage whose parts the histories
    (:attr:`touched_since`), the scoring pass (:attr:`spec`, :meth:`join`) and the guard
    (:func:`guard_stage`) use. ``previous`` None: the first night, or ``guard.compare`` off."""

    cfg: Config
    date: dt.date
    previous: PreviousNight | None

    @property
    def enabled(self) -> bool:
        return self.cfg.guard.compare

    @property
    def touched_since(self) -> dt.date | None:
        """From which day the histories collect what users touched: P's date, if the events window reaches back
        that far (the job reads no event outside its window, so an older P's hit rate is not measured). The
        guard's realized hit rate belongs to the lists of that date."""
        previous = self.previous
        if previous is None or previous.date < window_start(self.date, self.cfg.history.window_days):
            return None
        return previous.date

    @property
    def spec(self) -> CompareSpec | None:
        """What the scoring tasks need; None with ``guard.compare`` off. On the first night the tasks still
        sample the scores (tomorrow's bins)."""
        if not self.enabled:
            return None
        top_n = self.cfg.scoring.top_n
        if self.previous is None:
            return CompareSpec(top_n, np.zeros(0, np.int64), np.zeros(0))
        return CompareSpec(top_n, self.previous.popularity_ranking, self.previous.score_edges)

    @property
    def joins(self) -> bool:
        """Whether the scoring pass reads the previous night's lists (:meth:`join`)."""
        return self.previous is not None

    def join(self, histories: DataFrame, tasks: int) -> DataFrame:
        """The histories with each user's previous list (``previous``), in ``tasks`` partitions by user.

        The two are unioned and hash-partitioned by user into the scoring tasks in one exchange (the one
        the histories were to go through anyway), then folded to one row per user of the histories (a
        sort within each task). A join would not do: Spark plans both sides of a join into
        ``spark.sql.shuffle.partitions`` partitions whatever they were repartitioned into (measured with
        Spark 4: 200 tasks where 6 were asked for), which would change the scoring tasks, and it costs an
        exchange per side. Only the item ids of P's lists are read (Parquet nested-column pruning).
        """
        if self.previous is None:
            raise ValueError("no previous night to join: the first night scores its histories as they are")
        lists = histories.sparkSession.read.parquet(self.previous.path).select(
            "user_id", F.col("recommendations.item_id").alias(PREVIOUS_COLUMN))
        both = histories.unionByName(lists, allowMissingColumns=True).repartition(tasks, "user_id")
        columns = [c for c in histories.columns if c != "user_id"] + [PREVIOUS_COLUMN]
        folded = both.groupBy("user_id").agg(*[F.first(c, ignorenulls=True).alias(c) for c in columns])
        return folded.filter(F.col(HISTORY_COLUMN).isNotNull())   # users of P without a history tonight: lost


def previous_night(cfg: Config, date: dt.date, table: published_nights.TableView | None = None) -> Comparison:
    """The comparison stage: the latest night published before ``date`` as its readers see it (``table``:
    ``output.table``'s partitions decide), none on the first night or with ``guard.compare`` off."""
    found = published_nights.latest_published(cfg.paths.output, before=date, table=table) if cfg.guard.compare else None
    return Comparison(cfg, date, PreviousNight(found) if found is not None else None)


# ------------------------------------------------------------------------------------------------
# figures


def figures(comparison: Comparison, compare: Mapping[str, Any] | None, report_figures: Mapping[str, Any],
            per_candidate: np.ndarray) -> dict[str, float]:
    """The night's figures: the previous night's realized hit rate, the drift against it, and tonight's
    concentration. ``compare``: the tasks' merged totals (:func:`recsys.scoring.compare.merge`);
    ``report_figures``: the validation report's (rows, fallback rows, coverage); ``per_candidate``: times
    each candidate was recommended tonight (zeros included)."""
    previous, realized_from, date = comparison.previous, comparison.touched_since, comparison.date
    rows, fallback_rows = int(report_figures["rows"]), int(report_figures["fallback_rows"])
    coverage, top_n = float(report_figures["catalog_coverage"]), comparison.cfg.scoring.top_n
    out: dict[str, float] = {"rows": float(rows), "catalog_coverage": coverage,
                             "fallback_share": fallback_rows / rows if rows else math.nan,
                             "exposure_gini": lm.gini(per_candidate),
                             "top1pct_slot_share": lm.top_share(per_candidate, lm.top_percent_items(len(per_candidate))),
                             "head_slot_share": lm.top_share(per_candidate, top_n)}
    if compare is not None:
        out["compare_s"] = float(compare["compare_s"])
    if previous is None:
        return out
    out["previous_rows"] = float(previous.rows)
    out["previous_age_days"] = float((date - previous.date).days)
    previous_coverage = previous.metric("catalog_coverage")
    if previous_coverage:
        out["catalog_coverage_previous"] = previous_coverage
        out["catalog_coverage_ratio"] = coverage / previous_coverage
    if compare is None:
        return out
    both = compare["both"]
    out["overlap_users"] = both
    out["users_gained"] = rows - both
    out["users_lost"] = previous.rows - both
    out["users_gained_share"] = (rows - both) / rows if rows else math.nan
    out["users_lost_share"] = (previous.rows - both) / previous.rows if previous.rows else math.nan
    if both:
        out["jaccard_at_n_mean"] = compare["jaccard_n_sum"] / both
        out["jaccard_at_10_mean"] = compare["jaccard_k_sum"] / both
        for q in (10, 50, 90):
            out[f"jaccard_at_n_p{q}"] = lm.histogram_quantile(compare["jaccard_n_hist"], q / 100)
            out[f"jaccard_at_10_p{q}"] = lm.histogram_quantile(compare["jaccard_k_hist"], q / 100)
        out["first_item_changed_share"] = compare["first_changed"] / both
        out["identical_lists_share"] = compare["identical"] / both
    shares, counts = previous.score_shares, compare.get("score_bins")
    if counts is not None and len(shares) == len(counts):
        out["score_psi"] = lm.psi(shares, counts)
    if realized_from is not None:
        out["realized_touched_users"] = compare["touched_users"]
        users, pop_users = compare["realized_users"], compare["realized_pop_users"]
        out["realized_users"] = users
        out["realized_pop_users"] = pop_users
        out.update(_per_user(compare, "", users, "realized_{m}_at_{at}"))
        out.update(_per_user(compare, "pop_", pop_users, "realized_pop_{m}_at_{at}"))
        out.update(_ratios(out, "realized_pop_hr_at_{at}", "realized_hr_ratio_at_{at}"))
        out.update(repeat_and_personal_figures(compare, out))
    return out


# the tasks' totals per cut-off: k is the short one (the figures' "10"), n is scoring.top_n
_CUTS = (("10", "k"), ("n", "n"))


def _per_user(compare: Mapping[str, Any], source: str, users: float, name: str) -> dict[str, float]:
    """HR and NDCG at each cut-off: the tasks' totals ``{source}hr_k``, ``{source}ndcg_n``, ... over ``users``
    (nothing when there were none); ``name`` spells a figure's key from the metric ``m`` and the cut-off ``at``."""
    if not users:
        return {}
    return {name.format(m=m, at=at): compare[f"{source}{m}_{key}"] / users for at, key in _CUTS for m in ("hr", "ndcg")}


def _ratios(figures: Mapping[str, float], baseline: str, name: str) -> dict[str, float]:
    """The model's realized HR over a baseline's at each cut-off, where both were measured and the baseline's
    is not 0."""
    out: dict[str, float] = {}
    for at, _ in _CUTS:
        model, base = figures.get(f"realized_hr_at_{at}"), figures.get(baseline.format(at=at))
        if model is not None and base:
            out[name.format(at=at)] = model / base
    return out


def repeat_and_personal_figures(compare: Mapping[str, Any], model: Mapping[str, float]) -> dict[str, float]:
    """The previous lists' realized hits over the repeat targets (items the user had touched before the list
    was made) and over the new ones apart, each over the users who had such a target, and the personal-frequency
    baseline's (each user's most touched items as of then) on the same users as the model, with the model's HR
    over it. On a repeat-heavy log the overall figure hides the balance: a list of new items only scores 0 on
    repeats, and personal frequency is the baseline a list that also repeats must be held against.
    ``model``: the figures so far (the model's overall HR, for the ratio)."""
    out: dict[str, float] = {}
    for who in ("repeat", "new"):
        users = float(compare.get(f"realized_{who}_users", 0.0))
        out[f"realized_{who}_users"] = users
        out.update(_per_user(compare, f"{who}_", users, "realized_{m}_at_{at}_" + who))
    users = float(compare.get("realized_pfreq_users", 0.0))
    out["realized_pfreq_users"] = users
    out.update(_per_user(compare, "pfreq_", users, "realized_pfreq_{m}_at_{at}"))
    out.update(_ratios({**model, **out}, "realized_pfreq_hr_at_{at}", "realized_hr_pfreq_ratio_at_{at}"))
    return out


@dataclass(frozen=True)
class GuardStage:
    """The night's figures, the guard's verdict, and what the next night compares with."""

    figures: Mapping[str, float]
    verdict: guard_rules.Verdict
    comparison: Comparison
    for_next_night: NextNight

    @property
    def previous(self) -> PreviousNight | None:
        return self.comparison.previous

    @property
    def realized_from(self) -> dt.date | None:
        """The date of the lists whose realized hit rate the figures hold (None: not measured)."""
        return self.comparison.touched_since

    def manifest_section(self) -> Quality:
        return manifest_section(self)

    def metrics(self) -> dict[str, float]:
        """The figures as run metrics (NaN, what could not be measured, left out)."""
        return {k: v for k, v in {**self.figures, **self.verdict.metrics()}.items()
                if isinstance(v, (int, float)) and not math.isnan(v) and k != "rows"}


def guard_stage(comparison: Comparison, compare: Mapping[str, Any] | None, report: ValidationReport,
                candidate_ids: np.ndarray, popularity: np.ndarray, accept: bool) -> GuardStage:
    """Figures -> verdict; raises :class:`GuardRefused` on ``fail`` unless ``accept``.

    ``compare``: the scoring tasks' merged comparison (None with ``guard.compare`` off); ``report``: the
    validation's (rows, fallback rows, coverage, and the times each item was recommended);
    ``popularity``: users per candidate in the window (the fallback's), aligned with ``candidate_ids``.
    """
    cfg, date, previous = comparison.cfg, comparison.date, comparison.previous
    item_ids, times = report.item_counts or (np.zeros(0, np.int64), np.zeros(0, np.int64))
    per_candidate = counts_per_candidate(candidate_ids, item_ids, times)
    figs = figures(comparison, compare, report.figures, per_candidate)
    verdict = guard_rules.judge(figs, cfg.guard, first_night=previous is None and cfg.guard.compare, accepted=accept)
    if compare is not None and compare.get("blend_score_count"):
        log.info("recommend %s: score_psi is not measured: known items compete in tonight's lists, whose scores are "
                 "then the repeat blend's (known items' counts and ages, new items' ranks), not the model's", date)
    if previous is not None and comparison.touched_since is None and cfg.guard.compare:
        log.info("recommend %s: the previous partition (%s) is older than the history window, so its realized hit "
                 "rate is not measured", date, previous.date)
    for check in verdict.crossed("fail") + verdict.crossed("warn"):
        log.warning("recommend %s: guard %s: %s", date, check.level, check.why)
    if verdict.accepted:
        log.warning("recommend %s: the guard refused this night and it is published anyway (--accept-guard)", date)
    log.info("recommend %s: %s", date, verdict.summary())
    next_night = _for_next_night(candidate_ids, popularity, compare, cfg)
    stage = GuardStage(figs, verdict, comparison, next_night)
    try:
        guard_rules.enforce(verdict, date)
    except GuardRefused as exc:
        exc.report.update({k: v for k, v in manifest_section(stage).as_dict().items() if k != "guard"})
        raise
    return stage


def _for_next_night(candidate_ids: np.ndarray, popularity: np.ndarray, compare: Mapping[str, Any] | None,
                    cfg: Config) -> NextNight:
    """What tomorrow's run compares with, kept in tonight's manifest: the popularity ranking (long enough
    that N items remain after a user's seen items are removed) and the deciles of tonight's scores."""
    ranking = popularity_fallback(candidate_ids, popularity, cfg.scoring.top_n + cfg.history.max_items).item_ids
    sample = np.asarray(compare["score_sample"]) if compare is not None else np.zeros(0)
    edges = lm.decile_edges(sample)
    if not len(edges):
        return NextNight(popularity_ranking=tuple(int(i) for i in ranking))
    return NextNight(popularity_ranking=tuple(int(i) for i in ranking), score_deciles=tuple(float(e) for e in edges),
                     score_decile_shares=tuple(float(c) / len(sample) for c in lm.bin_counts(sample, edges)))


def manifest_section(stage: GuardStage) -> Quality:
    """The manifest's ``quality`` section (its figures are also in ``metrics``)."""
    previous = stage.previous
    return Quality(
        previous=None if previous is None else PreviousRef(
            date=str(previous.date), run=previous.published.run, run_id=previous.manifest.run_id, rows=previous.rows,
            model_version=previous.manifest.model.version),
        realized_for=str(stage.realized_from) if stage.realized_from else None,
        guard=stage.verdict.as_dict(),
        for_next_night=stage.for_next_night,
    )


# ------------------------------------------------------------------------------------------------
# record


TREND_FIGURES = ("realized_hr_at_10", "realized_pop_hr_at_10", "realized_pfreq_hr_at_10", "realized_users",
                 "jaccard_at_n_mean", "catalog_coverage")


def trend(cfg: Config, date: dt.date, tonight: Mapping[str, Any], verdict: str,
          realized_from: dt.date | None, table: published_nights.TableView | None = None) -> list[dict[str, Any]]:
    """The last :data:`TREND_NIGHTS` nights up to tonight, oldest first: date, verdict, the trend's figures
    and the date of the lists their realized hit rate belongs to (from the published manifests, found as the
    previous night is: ``output.table`` or the dates' pointers)."""
    rows = []
    for published in reversed(published_nights.recent_published(cfg.paths.output, TREND_NIGHTS - 1, before=date,
                                                                table=table)):
        m = published.manifest
        quality = m.quality or Quality()
        rows.append({"date": str(published.date), "verdict": quality.guard.get("verdict"),
                     "realized_for": quality.realized_for, **{f: m.metrics.get(f) for f in TREND_FIGURES}})
    rows.append({"date": str(date), "verdict": verdict, "realized_for": str(realized_from) if realized_from else None,
                 **{f: tonight.get(f) for f in TREND_FIGURES}})
    return rows


def record(recorder: RunRecorder, stage: GuardStage, coverage: float,
           table: published_nights.TableView | None = None) -> None:
    """Tags, ``guard_report.json`` and the trend plot of a published night (each call degrades, never raises)."""
    cfg, date, verdict = stage.comparison.cfg, stage.comparison.date, stage.verdict
    crossed = verdict.crossed("fail") + verdict.crossed("warn")
    recorder.set_tags({GUARD: verdict.verdict, **({GUARD_CROSSED: "; ".join(c.why for c in crossed)} if crossed else {}),
                       **({GUARD_ACCEPTED: "true"} if verdict.accepted else {})})
    recorder.log_dict(verdict.as_dict(), "guard_report.json")
    _log_trend(recorder, cfg, date, {**stage.figures, "catalog_coverage": coverage}, verdict.verdict,
               stage.realized_from, table)


def record_refusal(recorder: RunRecorder, cfg: Config, date: dt.date, exc: GuardRefused,
                   table: published_nights.TableView | None = None) -> None:
    """A refused night's MLflow run: its figures, the guard's report and tag, and the trend with tonight's
    refused point (the run itself is marked FAILED by the caller)."""
    figs = dict(exc.figures)
    recorder.log_metrics({k: v for k, v in figs.items() if not (isinstance(v, float) and math.isnan(v)) and k != "rows"})
    crossed = [c["why"] for c in exc.report.get("checks", []) if c.get("level") in ("fail", "warn")]
    recorder.set_tags({GUARD: "fail", GUARD_CROSSED: "; ".join(crossed)})
    recorder.log_dict(exc.report, "guard_report.json")
    realized = exc.report.get("realized_for")
    _log_trend(recorder, cfg, date, figs, "fail", dt.date.fromisoformat(realized) if realized else None, table)


def _log_trend(recorder: RunRecorder, cfg: Config, date: dt.date, tonight: Mapping[str, Any], verdict: str,
               realized_from: dt.date | None, table: published_nights.TableView | None) -> None:
    if recorder.failed or recorder.run_id is None:
        return
    from recsys.tracking import plots

    try:
        rows = trend(cfg, date, tonight, verdict, realized_from, table)
    except Exception as exc:   # earlier manifests unreadable: the trend is a convenience, never the run's failure
        log.warning("recommend %s: could not read the earlier nights for the trend plot: %s", date, exc)
        return
    recorder.log_dict({"nights": rows}, "guard_trend.json")
    fig = plots.night_trend(rows, guard_thresholds={name: t.model_dump() for name, t in cfg.guard.thresholds.items()},
                            min_users=cfg.guard.min_users)
    recorder.log_figure(fig, "plots/guard_trend.png")
