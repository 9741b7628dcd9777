"""The measuring half of ``recsys backtest``: what users did the day after each night, set against the lists
the job published for that night and against the baselines' lists, on the same users.

For a night ``D`` (its lists are computed from the events before ``D``):

- the **returning users** are the users with an event on ``D`` and at least one in the history window
  before it (``history.window_days``, the history the job reads);
- their **targets** are the distinct items they touched on ``D``: **repeat** targets are those the user had
  touched before ``D`` (in that window), **new** ones the rest;
- every system's list is measured for them by the pure core
  (:func:`recsys.model.list_metrics.next_day_figures`) inside ``mapInArrow`` tasks: per user, HR@k, NDCG@k and
  recall@N over all, repeat and new targets, and the repeat share of the list. The per-user figures are
  written under the backtest's work directory, one ``dt=D`` partition a night.

The summary reads the nights back: means over (user, night) pairs by Spark aggregation, 95% intervals by a
two-way bootstrap over users and nights (:class:`recsys.evaluation.report.TwoWayDraws`) on the collected
figures (a few floats a pair; past ``evaluation.backtest.max_bootstrap_pairs`` pairs, on a seeded sample of
whole users), and the paired difference of the job to every baseline.

The baselines' lists are :mod:`recsys.evaluation.baselines`' DataFrame code; nothing per user is collected
to the driver except those figures.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from recsys import __version__
from recsys.config import BacktestConfig, HistoryConfig, MlflowConfig
from recsys.data import history as hist
from recsys.data.contracts import PARTITION_COLUMN
from recsys.data.readers import events_window, read_catalog_snapshot, read_events
from recsys.errors import InputDataError
from recsys.evaluation import baselines
from recsys.evaluation.report import Bootstrap, TwoWayDraws, cell, interval, plain
from recsys.model.list_metrics import NEXT_DAY_PARTS, next_day_names
from recsys.tracking import store as tracking
from recsys.tracking import tags
from recsys.redaction import redact_uri

log = logging.getLogger(__name__)

JOB = "job"
PERSONAL, PADDED = "pfreq", "pfreq+pop"
POPULAR, POPULAR_MASKED = "pop", "pop-masked"
ALS, ALS_MASKED = "als", "als-masked"
SYSTEMS = (JOB, PERSONAL, PADDED, POPULAR_MASKED, POPULAR, ALS_MASKED, ALS)
BASELINES = SYSTEMS[1:]
PART_TITLES = {"": "all next-day items", ".repeat": "repeat items, which the user had touched before the night",
               ".new": "items new to the user"}


def describe(system: str, settings: BacktestConfig) -> str:
    """What each row of the table is, in words (the table's legend and the JSON's ``systems``)."""
    return {
        JOB: "the job's published lists (recsys night: training on the schedule, then the lists)",
        PERSONAL: f"personal frequency: the user's own items by event count, each event weighing "
                  f"2^(-age in days / {settings.half_life_days:g})",
        PADDED: f"personal frequency, its free places filled with the last {settings.popularity_days} days' "
                "popularity",
        POPULAR_MASKED: f"popularity of the last {settings.popularity_days} days (users per item), the user's "
                        "history masked",
        POPULAR: f"popularity of the last {settings.popularity_days} days, history not masked",
        ALS_MASKED: f"Spark ALS implicit (rank {settings.als_rank}, reg {settings.als_reg_param:g}, alpha "
                    f"{settings.als_alpha:g}, {settings.als_max_iter} iterations) on event counts, history masked",
        ALS: "the same ALS, history not masked",
    }.get(system, system)


# ------------------------------------------------------------------------------------------------
# a night's inputs


def read_log(spark: SparkSession, events_root: str, until: dt.date, event_types: tuple[str, ...] = ()) -> DataFrame:
    """Every event of the partitions up to ``until`` (each file's footer checked, as the job reads them),
    null ids dropped, ``history.event_types`` applied: the one log every night is cut from."""
    events = read_events(spark, events_root, lambda d: d <= until)
    if events is None:
        raise InputDataError(f"no events on or before {until} under {redact_uri(events_root)!r}; nothing to backtest")
    events = hist.drop_null_ids(events)
    if event_types:
        events = events.where(F.col("event_type").isin(list(event_types)))
    return events.select("user_id", "item_id", "event_type", "ts", PARTITION_COLUMN)


@dataclass(frozen=True)
class NightInputs:
    """What every system is measured with on one night."""

    date: dt.date
    past: DataFrame               # user_id, item_id, event_type, ts: the history window before the night
    users: DataFrame              # user_id, targets, seen (array<bigint>): the returning users, written and read back
    available: DataFrame          # item_id: available in the newest catalog snapshot on or before the night
    catalog_snapshot: dt.date
    max_seen: int                 # the longest history among the returning users (how far to over-fetch)


def night_inputs(spark: SparkSession, log_events: DataFrame, catalog_root: str, date: dt.date,
                 history: HistoryConfig, catalog_max_age_days: int, out_dir: str) -> NightInputs:
    """The returning users of ``date`` with their targets and history, and the night's available items."""
    past = events_window(log_events, date, history.window_days)
    start = dt.datetime.combine(date, dt.time())
    today = log_events.where((F.col(PARTITION_COLUMN) == F.lit(date)) & (F.col("ts") >= F.lit(start))
                             & (F.col("ts") < F.lit(start + dt.timedelta(days=1))))
    targets = today.groupBy("user_id").agg(F.array_sort(F.collect_set("item_id")).alias("targets"))
    seen = past.groupBy("user_id").agg(F.array_sort(F.collect_set("item_id")).alias("seen"))
    targets.join(seen, "user_id").write.mode("overwrite").parquet(out_dir)
    users = spark.read.parquet(out_dir)
    max_seen = users.agg(F.max(F.size("seen"))).first()[0] or 0
    snapshot = read_catalog_snapshot(spark, catalog_root, date, catalog_max_age_days)
    available = snapshot.frame.where(F.col("available")).select("item_id").distinct()
    return NightInputs(date, past, users, available, snapshot.date, int(max_seen))


def job_lists(published: DataFrame) -> DataFrame:
    """A published partition (the output contract) -> ``user_id, items``."""
    return published.select("user_id", F.transform("recommendations", lambda r: r["item_id"]).alias(baselines.LIST_COLUMN))


@dataclass(frozen=True)
class BaselineLists:
    lists: dict[str, DataFrame]
    notes: dict[str, Any] = field(default_factory=dict)


def baseline_lists(night: NightInputs, n: int, settings: BacktestConfig, seed: int, als_seed: int,
                   out_dir: str) -> BaselineLists:
    """Every baseline's lists for the night's returning users (:data:`BASELINES`, in that order); ``out_dir``:
    where ALS's fetched lists are kept for the night."""
    users, past, available = night.users, night.past, night.available
    personal = baselines.personal_frequency_lists(past, users, available, night.date, n, settings.half_life_days, seed)
    ranking = baselines.popularity_ranking(past, available, night.date, settings.popularity_days,
                                           n + min(night.max_seen, baselines.MAX_OVERFETCH), seed)
    params = baselines.ALSParams(settings.als_rank, settings.als_reg_param, settings.als_alpha, settings.als_max_iter,
                                 als_seed, settings.als_blocks)
    als = baselines.als_lists(past, users, available, n, params, night.max_seen, out_dir)
    lists = {PERSONAL: personal, PADDED: baselines.padded_lists(users, personal, ranking, n),
             POPULAR_MASKED: baselines.popularity_lists(users, ranking, n, masked=True),
             POPULAR: baselines.popularity_lists(users, ranking, n, masked=False),
             ALS_MASKED: als.masked, ALS: als.unmasked}
    return BaselineLists(lists, {"als_fetched": als.fetched, "als_ids_remapped": als.ids_remapped})


# ------------------------------------------------------------------------------------------------
# per-user figures


def figure_column(system: str, figure: str) -> str:
    """The Parquet column of one system's figure (``pfreq+pop``, ``hr@10.repeat`` -> ``pfreq_pop__hr_10_repeat``)."""
    clean = partial(re.sub, r"[^A-Za-z0-9]+", "_")
    return f"{clean(system)}__{clean(figure)}"


def measure(users: DataFrame, lists: Mapping[str, DataFrame], k: int, n: int) -> DataFrame:
    """Per returning user, every system's figures (:func:`next_day_figures`) and the user's target counts.

    A user a system has no list for scores 0 on every figure it covers (``listed`` 0). Computed in the
    executors' ``mapInArrow`` tasks, a batch of users at a time."""
    systems = list(lists)
    frame = users
    for i, system in enumerate(systems):
        frame = frame.join(lists[system].select("user_id", F.col(baselines.LIST_COLUMN).alias(f"_l{i}")), "user_id",
                           "left")
    names = next_day_names(k, n)
    schema = ", ".join(["user_id BIGINT", "targets INT", "repeat_targets INT", "new_targets INT"]
                       + [f"{figure_column(s, f)} DOUBLE" for s in systems for f in names])
    return frame.mapInArrow(partial(_figure_batches, tuple(systems), k, n), schema)


def _figure_batches(systems: tuple[str, ...], k: int, n: int, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    from recsys.model.list_metrics import Lists, member, next_day_figures

    for batch in batches:
        targets = Lists.from_arrow(batch.column("targets"))
        seen = Lists.from_arrow(batch.column("seen"))
        repeat = member(targets.rows(), targets.ids, seen.rows(), seen.ids, targets.n_rows)
        repeats = np.bincount(targets.rows()[repeat], minlength=targets.n_rows)
        columns = {"user_id": batch.column("user_id"),
                   "targets": pa.array(targets.lengths.astype(np.int32)),
                   "repeat_targets": pa.array(repeats.astype(np.int32)),
                   "new_targets": pa.array((targets.lengths - repeats).astype(np.int32))}
        for i, system in enumerate(systems):
            figures = next_day_figures(Lists.from_arrow(batch.column(f"_l{i}")), targets, seen, k, n)
            for name, values in figures.items():
                columns[figure_column(system, name)] = pa.array(values, pa.float64(), from_pandas=True)   # NaN -> null
        yield pa.RecordBatch.from_pydict(columns)


# ------------------------------------------------------------------------------------------------
# the summary


@dataclass(frozen=True)
class Measurement:
    """What a backtest's figures are of: the systems, the nights ``start..end``, HR and NDCG at ``k``, recall at
    ``n`` (the lists' length)."""

    systems: tuple[str, ...]
    start: dt.date
    end: dt.date
    k: int
    n: int


@dataclass
class BacktestSummary:
    """Everything the table, the JSON and the MLflow run show."""

    start: dt.date
    end: dt.date
    k: int
    n: int
    systems: list[str]
    counts: dict[str, int]                                         # user_nights, users, repeat_user_nights, ...
    means: dict[str, dict[str, float]]                             # system -> figure -> mean over the pairs it covers
    intervals: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    best_baseline: str | None = None                               # by HR@k over all next-day items
    differences: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)   # job - baseline
    nights: list[dict[str, Any]] = field(default_factory=list)     # per night: date, counts, means, the replay's notes
    bootstrap: dict[str, Any] = field(default_factory=dict)        # resamples, seed, pairs drawn from, sampled
    descriptions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return next_day_names(self.k, self.n)

    def to_json(self) -> dict[str, Any]:
        return {
            "from": str(self.start), "to": str(self.end), "k": self.k, "n": self.n,
            "systems": {s: self.descriptions.get(s, "") for s in self.systems},
            "counts": self.counts,
            "figures": {s: {f: plain(v) for f, v in m.items()} for s, m in self.means.items()},
            "intervals": {s: {f: [plain(a), plain(b)] for f, (a, b) in v.items()} for s, v in self.intervals.items()},
            "best_baseline": self.best_baseline,
            "differences": {f"{JOB} - {b}": {f: [plain(x) for x in t] for f, t in v.items()}
                            for b, v in self.differences.items()},
            "nights": [_plain_tree(night) for night in self.nights],
            "bootstrap": self.bootstrap,
            "notes": self.notes,
        }


def summarize(spark: SparkSession, figures_dir: str, what: Measurement, *, bootstrap: Bootstrap,
              settings: BacktestConfig) -> BacktestSummary:
    """Read every night's per-user figures back; means, intervals (resampling at most
    ``settings.max_bootstrap_pairs`` pairs), paired differences and the nights."""
    systems, start, end, k, n = list(what.systems), what.start, what.end, what.k, what.n
    frame = spark.read.parquet(figures_dir).where(F.col(PARTITION_COLUMN).between(F.lit(start), F.lit(end)))
    names = next_day_names(k, n)
    columns = {(s, f): figure_column(s, f) for s in systems for f in names}
    aggs = [F.count(F.lit(1)).alias("user_nights"), F.countDistinct("user_id").alias("users"),
            F.count_if(F.col("repeat_targets") > 0).alias("repeat_user_nights"),
            F.count_if(F.col("new_targets") > 0).alias("new_user_nights"),
            F.sum("targets").alias("targets"), F.sum("repeat_targets").alias("repeat_targets")]
    aggs += [F.avg(c).alias(c) for c in columns.values()]
    overall = frame.agg(*aggs).first().asDict()
    if not overall["user_nights"]:
        raise InputDataError(f"no returning user on any night {start}..{end}: no user with an event on a night had "
                             "events before it; nothing to measure")
    counts = {key: int(overall[key] or 0) for key in ("user_nights", "users", "repeat_user_nights",
                                                       "new_user_nights", "targets", "repeat_targets")}
    means = {s: {f: _float(overall[columns[s, f]]) for f in names} for s in systems}
    out = BacktestSummary(start, end, k, n, list(systems), counts, means,
                          descriptions={s: describe(s, settings) for s in systems})
    per_night = frame.groupBy(PARTITION_COLUMN).agg(*aggs).orderBy(PARTITION_COLUMN).collect()
    for row in per_night:
        r = row.asDict()
        out.nights.append({"date": str(r[PARTITION_COLUMN]),
                           **{key: int(r[key] or 0) for key in ("user_nights", "repeat_user_nights", "new_user_nights")},
                           "figures": {s: {f: _float(r[columns[s, f]]) for f in names} for s in systems}})
    baselines_here = [s for s in systems if s != JOB]
    if baselines_here:
        out.best_baseline = max(baselines_here, key=lambda s: _sortable(means[s][f"hr@{k}"]))
    if bootstrap.resamples > 0:
        _intervals(out, frame, columns, bootstrap, settings.max_bootstrap_pairs)
    return out


def _intervals(out: BacktestSummary, frame: DataFrame, columns: dict[tuple[str, str], str], bootstrap: Bootstrap,
               max_pairs: int) -> None:
    """Bootstrap intervals of every mean and of the job's paired difference to every baseline."""
    pairs = out.counts["user_nights"]
    sampled = frame
    share = 1.0
    if pairs > max_pairs:   # whole users, by a seeded hash: a user is in for every night or for none
        share = max_pairs / pairs
        bucket = F.pmod(F.xxhash64(F.col("user_id"), F.lit(bootstrap.seed)), F.lit(1_000_000))
        sampled = frame.where(bucket < F.lit(int(share * 1_000_000)))
    table = sampled.select("user_id", F.col(PARTITION_COLUMN).cast("string").alias("night"),
                           *columns.values()).toArrow()
    draws = TwoWayDraws(table.column("user_id").to_numpy(), table.column("night").to_numpy(zero_copy_only=False),
                        bootstrap.resamples, bootstrap.seed)
    keys = list(columns)
    values = np.column_stack([table.column(columns[key]).to_numpy(zero_copy_only=False).astype(np.float64)
                              for key in keys]) if table.num_rows else np.zeros((0, len(keys)))
    resampled = draws.means_many(values)                                                # [R, C]
    at = {key: i for i, key in enumerate(keys)}
    for (system, figure), i in at.items():
        out.intervals.setdefault(system, {})[figure] = interval(resampled[:, i])
    if JOB in out.systems:
        for baseline in out.systems:
            if baseline == JOB:
                continue
            out.differences[baseline] = {
                f: (out.means[JOB][f] - out.means[baseline][f],
                    *interval(resampled[:, at[JOB, f]] - resampled[:, at[baseline, f]]))
                for f in out.names if f != "listed"}
    out.bootstrap = {"resamples": bootstrap.resamples, "seed": bootstrap.seed, "pairs": int(table.num_rows),
                     "sampled": share < 1.0, "over": "users and nights (two-way)"}


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _sortable(value: float) -> float:
    return -math.inf if not math.isfinite(value) else value


def _plain_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_tree(v) for v in value]
    if isinstance(value, float):
        return plain(value)
    return value


# ------------------------------------------------------------------------------------------------
# text


def format_table(summary: BacktestSummary, *, digits: int = 3) -> str:
    """The backtest as Markdown tables: one per part (all, repeat, new next-day items), the paired differences
    of the job to the best baseline, and HR@k night by night."""
    k, n, c = summary.k, summary.n, summary.counts
    nights = len(summary.nights)
    lines = [f"backtest of {nights} night{'s' if nights != 1 else ''} {summary.start}..{summary.end}: each night's "
             f"lists computed from the events before it, measured on what returning users did that day.",
             f"{c['user_nights']:,} user-nights of returning users ({c['users']:,} distinct users; "
             f"{c['repeat_user_nights']:,} touched items they had before, {c['new_user_nights']:,} items new to them; "
             f"{c['repeat_targets'] / max(1, c['targets']):.0%} of their (user, item) pairs were repeats)."]
    if summary.bootstrap:
        b = summary.bootstrap
        lines.append(f"[95% interval: bootstrap over users and nights, {b['resamples']} resamples"
                     + (f", on a sample of {b['pairs']:,} user-nights" if b.get("sampled") else "") + "]")
    covered = {"": c["user_nights"], ".repeat": c["repeat_user_nights"], ".new": c["new_user_nights"]}
    for part in NEXT_DAY_PARTS:
        figures = [f"hr@{k}{part}", f"ndcg@{k}{part}", f"recall@{n}{part}"] + ([f"repeat_share@{k}"] if not part else [])
        headers = [f"HR@{k}", f"NDCG@{k}", f"recall@{n}"] + (["repeat share@10" if k == 10 else f"repeat share@{k}"]
                                                             if not part else [])
        lines += ["", f"{PART_TITLES[part][0].upper()}{PART_TITLES[part][1:]}, {covered[part]:,} user-nights:", "",
                  "| system | " + " | ".join(headers) + " |", "|---|" + "---|" * len(headers)]
        for system in summary.systems:
            label = f"**{system}**" if system == JOB else system
            cells = [cell(summary.means[system][f], summary.intervals.get(system, {}).get(f), digits, f)
                     for f in figures]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    best = summary.best_baseline
    if best and best in summary.differences:
        diffs = summary.differences[best]
        lines += ["", f"Paired difference {JOB} - {best} (the best baseline by HR@{k}), 95% interval:", "",
                  "| figure | all | repeat | new |", "|---|---|---|---|"]
        for base in (f"hr@{k}", f"ndcg@{k}", f"recall@{n}"):
            cells = [cell(*_diff(diffs.get(base + part)), digits, base, signed=True) for part in NEXT_DAY_PARTS]
            lines.append(f"| {base} | " + " | ".join(cells) + " |")
    lines += ["", f"HR@{k} night by night (all next-day items; user-nights: returning / with repeats / with new items):",
              "", "| night | users | " + " | ".join(summary.systems) + " | notes |",
              "|---|---|" + "---|" * len(summary.systems) + "---|"]
    for night in summary.nights:
        values = [cell(night["figures"][s][f"hr@{k}"], None, digits, "hr") for s in summary.systems]
        users = f"{night['user_nights']:,} / {night['repeat_user_nights']:,} / {night['new_user_nights']:,}"
        lines.append(f"| {night['date']} | {users} | " + " | ".join(values) + f" | {night.get('note', '')} |")
    lines += ["", "Systems:", *[f"- {s}: {summary.descriptions.get(s, '')}" for s in summary.systems]]
    if summary.notes:
        lines += ["", *[f"- {note}" for note in summary.notes]]
    return "\n".join(lines)


def _diff(value: tuple[float, float, float] | None) -> tuple[float, tuple[float, float] | None]:
    if value is None:
        return math.nan, None
    return value[0], (value[1], value[2])


def write_json(doc: Mapping[str, Any], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------
# MLflow


def record(mlflow_cfg: MlflowConfig, experiment: str, summary: BacktestSummary, table: str, doc: Mapping[str, Any],
           params: Mapping[str, Any]) -> str | None:
    """One MLflow run in ``experiment``: the figures with their intervals, per-night series (step = night),
    the table, the JSON and the per-night plot (HR@k of every system, all / repeat / new)."""
    from recsys.tracking import plots

    recorder = tracking.RunRecorder(mlflow_cfg, run_name=f"backtest {summary.start}..{summary.end}",
                                    experiment=experiment,
                                    tags={tags.JOB: tags.BACKTEST_JOB, tags.VERSION: __version__,
                                          tags.DATE: str(summary.end)})
    recorder.log_params({**params, "from": str(summary.start), "to": str(summary.end), "k": summary.k,
                         "top_n": summary.n, "best_baseline": summary.best_baseline})
    metrics: dict[str, float] = {f"counts.{key}": v for key, v in summary.counts.items()}
    for system, values in summary.means.items():
        metrics.update({f"{system}.{f}": v for f, v in values.items()})
        for f, (lo, hi) in summary.intervals.get(system, {}).items():
            metrics.update({f"{system}.{f}.lo": lo, f"{system}.{f}.hi": hi})
    for baseline, diffs in summary.differences.items():
        for f, (d, lo, hi) in diffs.items():
            metrics.update({f"{JOB}.{f}.diff_to_{baseline}": d, f"{JOB}.{f}.diff_to_{baseline}.lo": lo,
                            f"{JOB}.{f}.diff_to_{baseline}.hi": hi})
    recorder.log_metrics({key: v for key, v in metrics.items() if math.isfinite(v)})
    for step, night in enumerate(summary.nights):
        recorder.log_metrics({f"night.{s}.hr@{summary.k}{part}": night["figures"][s][f"hr@{summary.k}{part}"]
                              for s in summary.systems for part in NEXT_DAY_PARTS
                              if math.isfinite(night["figures"][s][f"hr@{summary.k}{part}"])}, step=step)
    recorder.log_text(table + "\n", "backtest.md")
    recorder.log_dict(dict(doc), "backtest.json")
    fig = plots.backtest_nights([night["date"] for night in summary.nights],
                                {s: {part: [night["figures"][s][f"hr@{summary.k}{part}"] for night in summary.nights]
                                     for part in NEXT_DAY_PARTS} for s in summary.systems},
                                f"HR@{summary.k}", (("", "all next-day items"), (".repeat", "repeat items"),
                                                    (".new", "items new to the user")), highlight=JOB)
    recorder.log_figure(fig, "plots/backtest_nights.png")
    recorder.end("FINISHED")
    if recorder.failed:
        log.warning("the backtest could not be recorded in %s: %s", redact_uri(mlflow_cfg.tracking_uri), recorder.error)
    return recorder.run_id


__all__ = ["BASELINES", "BacktestSummary", "JOB", "Measurement", "NightInputs", "SYSTEMS", "baseline_lists", "describe",
           "figure_column", "format_table", "job_lists", "measure", "night_inputs", "read_log", "record", "summarize",
           "write_json"]
