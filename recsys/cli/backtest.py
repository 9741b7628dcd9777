"""``recsys backtest``: replay nights through the job's own code, and measure each on the day after.

For every night ``D`` from ``--from`` to ``--to``, in order, in one Spark session:

1. **train** as the schedule would: ``recsys train --if-due`` decides with ``train.every_nights`` (or
   ``--train-every``), counting from the replay's own trainings (the first night always trains);
   :func:`recsys.pipelines.train.run_training` then trains on the events before ``D`` and its gate decides
   whether the alias moves, exactly as it does at night. ``--model-uri`` skips training: one model (a
   registered version of the configured tracking store, or a model directory) scores every night.
2. **recommend**: :func:`recsys.pipelines.nightly.run_nightly` publishes the lists for ``D`` (the guard's
   refusals are accepted and noted: a backtest measures the lists, it does not withhold them); on a night
   that trained, from the window training read and Spark kept, as ``recsys night`` does (one read a night);
3. **measure** (:mod:`recsys.evaluation.backtest`): what the returning users of ``D`` did that day, against
   the published lists and the baselines' lists for the same users.

Everything the replay writes goes under ``--work``: the published partitions, the model registry and the
MLflow runs (a SQLite store, ``--work/mlflow.db``), the executors' scratch, the per-user figures. The
configured output, registry, alias, experiments, output table and key-value export are never touched: the
scratch configuration (:func:`scratch_config`) points every one of them into ``--work`` or turns it off.
The backtest's own MLflow run is recorded there too, in the experiment ``<mlflow.experiment>-backtest``:
next to the replay's nightly and training runs it summarises, outside the store ``recsys runs`` reads.

A second run with the same ``--work`` and settings resumes: trainings that finished and nights already
published with the same model and configuration are not repeated (the job's own skip rules).
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys import __version__
from recsys.config import Config
from recsys.data.contracts import date_range
from recsys.data.partitions import list_partitions, with_files
from recsys.errors import ConfigError, InputDataError, first_line
from recsys.evaluation import backtest as measure
from recsys.evaluation.report import Bootstrap
from recsys.model.list_metrics import SHORT_K
from recsys.uris import is_local_path, local_path
from recsys.redaction import redact_uri

log = logging.getLogger("recsys.backtest")

SETTINGS_FILE = "backtest.json"           # in --work: what this backtest is (resume only the same one)
IDENTITY_KEYS = ("from", "train_every", "model_uri", "events", "catalog", "config_digest", "baselines")
MEASURED_FILE = "measured.json"           # beside a night's figures: which published run and settings they measure


@dataclass(frozen=True)
class BacktestRequest:
    """What ``recsys backtest`` was asked (the command's options)."""

    start: dt.date
    end: dt.date
    work: Path
    train_every: int | None = None        # default: train.every_nights
    model_uri: str | None = None          # one model for every night, no training
    json_path: Path | None = None
    overwrite: bool = False


@dataclass
class BacktestResult:
    summary: measure.BacktestSummary
    table: str
    doc: dict[str, Any]
    run_id: str | None
    tracking_uri: str                     # the scratch store holding the run
    experiment: str
    seconds: float
    nights: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# where the replay writes


def scratch_config(cfg: Config, work: Path, train_every: int | None = None) -> Config:
    """``cfg`` with everything a night writes pointed into ``work`` or turned off: the output and the executors'
    scratch, the driver's scratch, the MLflow store and its artifacts (so the registry and its alias, the nightly
    and training runs), the output table (off: paths only), the key-value export (off). Inputs, model and scoring
    settings are unchanged: the replay is the configured job."""
    work = Path(work).resolve()
    data = cfg.to_dict()
    data["paths"].update(output=str(work / "output"), work=str(work / "work"), driver_scratch=str(work / "driver"))
    data["mlflow"].update(tracking_uri=f"sqlite:///{work / 'mlflow.db'}", artifact_location=str(work / "mlartifacts"))
    data["output"].update(table=None, retention_days=None)
    data["output"]["metastore"].update(dir=str(work / "metastore"), url=None, uris=None, jars=[])
    data["export"].update(redis_url=None, after_publish=False)
    data["serve"]["backend_dir"] = str(work / "backend")
    if train_every is not None:
        data["train"]["every_nights"] = train_every
    return Config.model_validate(data)


def with_data(cfg: Config, data: Path) -> Config:
    """``cfg`` reading ``data/events`` and ``data/catalog`` (``--data``, as ``recsys evaluate`` takes it)."""
    root = Path(data).resolve()
    doc = cfg.to_dict()
    doc["paths"].update(events=str(root / "events"), catalog=str(root / "catalog"))
    return Config.model_validate(doc)


def check_work_dir(cfg: Config, work: Path) -> None:
    """Refuse a ``--work`` that overlaps a place the configured job reads or writes: the replay would write
    into it (or ``--overwrite`` remove it)."""
    work = Path(work).resolve()
    places = {"paths.events": cfg.paths.events, "paths.catalog": cfg.paths.catalog, "paths.output": cfg.paths.output,
              "paths.work": cfg.paths.work, "paths.driver_scratch": cfg.paths.driver_scratch}
    uri = cfg.mlflow.tracking_uri
    if uri.startswith("sqlite:///"):   # the database file
        places["mlflow.tracking_uri"] = str(Path(uri.removeprefix("sqlite:///").partition("?")[0]).resolve())
    elif is_local_path(uri):
        places["mlflow.tracking_uri"] = str(local_path(uri))
    if cfg.mlflow.artifact_location and is_local_path(cfg.mlflow.artifact_location):
        places["mlflow.artifact_location"] = str(local_path(cfg.mlflow.artifact_location))
    for key, value in places.items():
        if not is_local_path(value):
            continue
        place = local_path(value).resolve()
        if place == work or work in place.parents or place in work.parents:
            raise ConfigError(f"--work {work} overlaps {key} ({place}): the backtest writes only under --work and "
                              "never where the configured job reads or writes; choose a directory outside it")


def prepare_work(work: Path, settings: dict[str, Any], overwrite: bool) -> bool:
    """Create ``work`` (or resume it, or start it again with ``overwrite``); True when resuming.

    A directory holding anything but this backtest's files is refused: ``--overwrite`` only ever removes a
    directory that ``recsys backtest`` made."""
    work = Path(work)
    marker = work / SETTINGS_FILE
    if work.exists() and not work.is_dir():
        raise ConfigError(f"--work {work} is a file; give a directory (it is created if missing)")
    if work.is_dir() and any(work.iterdir()):
        if not marker.is_file():
            raise ConfigError(f"--work {work} is not empty and holds no backtest ({SETTINGS_FILE} is missing); "
                              "choose an empty or new directory")
        try:
            previous = json.loads(marker.read_text()).get("identity", {})
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--work {work}: cannot read {marker} ({first_line(exc)}); pass --overwrite to start "
                              "the backtest there again") from None
        if overwrite:
            log.info("[backtest] --overwrite: removing the earlier backtest under %s", work)
            shutil.rmtree(work)
        else:
            differ = [f"{k} {previous.get(k)!r} -> {settings['identity'].get(k)!r}" for k in IDENTITY_KEYS
                      if previous.get(k) != settings["identity"].get(k)]
            if differ:
                raise ConfigError(f"--work {work} holds a backtest with other settings ({'; '.join(differ)}); pass "
                                  "--overwrite to start it again there, or choose another --work")
            log.info("[backtest] resuming the backtest under %s: finished trainings and published nights are kept", work)
            marker.write_text(json.dumps(settings, indent=2) + "\n")
            return True
    work.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(settings, indent=2) + "\n")
    return False


# ------------------------------------------------------------------------------------------------
# the range


def check_range(cfg: Config, start: dt.date, end: dt.date) -> tuple[dt.date, dt.date]:
    """The first and the last date with events; refuses a range the data cannot replay (exit 2), naming the
    bound and the dates that would work."""
    try:
        nights = date_range(start, end, names=("--from", "--to"))
    except ValueError as exc:
        raise ConfigError(f"backtest: {exc}") from None
    fs, parts = list_partitions(cfg.paths.events, "events")
    with_data = [p for p in parts if with_files(fs, p).files]
    if not with_data:
        raise InputDataError(f"no events under {redact_uri(cfg.paths.events)!r}: no dt= partition holds files; "
                             "nothing to backtest")
    first, last = with_data[0].date, with_data[-1].date
    if first >= start:
        raise InputDataError(f"no events before --from {start} under {redact_uri(cfg.paths.events)!r} (the first "
                             f"partition is {first}): the first night needs a history; choose --from "
                             f"{first + dt.timedelta(days=1)} or later")
    if end > last:
        raise InputDataError(f"--to {end} is beyond the data: the newest event partition under "
                             f"{redact_uri(cfg.paths.events)!r} is {last}, and each night is measured on the events "
                             f"of its own day; choose --to {last} or earlier")
    _, catalogs = list_partitions(cfg.paths.catalog, "catalog")
    if not any(p.date <= start for p in catalogs):
        raise InputDataError(f"no catalog snapshot on or before --from {start} under {redact_uri(cfg.paths.catalog)!r}"
                             f"{f' (the first is {catalogs[0].date})' if catalogs else ''}; choose a later --from")
    log.debug("backtest: %d night(s) %s..%s; events from %s to %s", len(nights), start, end, first, last)
    return first, last


# ------------------------------------------------------------------------------------------------
# one model for every night (--model-uri)


def import_model(cfg: Config, scratch: Config, uri: str, work: Path, start: dt.date) -> str:
    """Register the model at ``uri`` in the scratch registry under the alias (once); a note for the table.

    ``uri``: ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` of the configured tracking store (read only),
    or a directory of model files (``recsys.model.io``). A model trained on events after ``--from`` has seen
    nights it is judged on: the note says so, and the log warns."""
    from recsys.model.io import CONFIG_FILE
    from recsys.tracking import store as tracking

    target = Path(work) / "models" / "imported"
    if not (target / CONFIG_FILE).is_file():
        source = _model_files(cfg, uri, Path(work) / "driver" / "download")
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target)
    try:
        trained_before = json.loads((target / CONFIG_FILE).read_text()).get("metadata", {}).get("trained_before")
    except (OSError, ValueError) as exc:
        raise InputDataError(f"--model-uri {uri}: {target / CONFIG_FILE} is not a readable model config "
                             f"({first_line(exc)})") from None
    tracking.point_at(scratch.mlflow)
    if tracking.alias_holder(scratch.mlflow.model_name, scratch.mlflow.alias) is None:
        from mlflow import MlflowClient

        client = MlflowClient()
        try:
            client.get_registered_model(scratch.mlflow.model_name)
        except Exception:
            client.create_registered_model(scratch.mlflow.model_name, description="recsys backtest: imported model")
        version = client.create_model_version(scratch.mlflow.model_name, source=str(target),
                                              description=f"imported from {redact_uri(uri)}").version
        tracking.set_alias(scratch.mlflow.model_name, scratch.mlflow.alias, str(version))
    note = f"one model for every night, from {redact_uri(uri)}"
    if trained_before is None:
        note += " (it records no training date: whether it saw the nights it is judged on is unknown)"
        log.warning("[backtest] --model-uri %s records no training date: it may have trained on the nights it is "
                    "judged on", redact_uri(uri))
    elif dt.date.fromisoformat(str(trained_before)) > start:
        note += (f", trained on events before {trained_before}: it has seen the nights before that, so their figures "
                 "are flattered")
        log.warning("[backtest] --model-uri %s trained on events before %s, after --from %s: it has seen nights it is "
                    "judged on", redact_uri(uri), trained_before, start)
    else:
        note += f", trained on events before {trained_before}"
    return note


def _model_files(cfg: Config, uri: str, download: Path) -> Path:
    from recsys.model.io import CONFIG_FILE
    from recsys.tracking import store as tracking

    if not uri.startswith("models:/"):
        path = Path(uri)
        if not (path / CONFIG_FILE).is_file():
            raise ConfigError(f"--model-uri {uri}: neither models:/NAME@ALIAS, models:/NAME/VERSION nor a directory "
                              f"holding a model ({CONFIG_FILE} missing)")
        return path
    from mlflow import MlflowClient

    rest = uri[len("models:/"):]
    name, sep, which = rest.partition("@") if "@" in rest else rest.partition("/")
    if not name or not sep or not which:
        raise ConfigError(f"--model-uri {uri}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    client = MlflowClient(tracking_uri=cfg.mlflow.tracking_uri, registry_uri=cfg.mlflow.tracking_uri)
    try:
        mv = client.get_model_version_by_alias(name, which) if sep == "@" else client.get_model_version(name, which)
    except Exception as exc:
        raise ConfigError(f"--model-uri {uri}: not found in {redact_uri(cfg.mlflow.tracking_uri)} "
                          f"({first_line(exc)})") from None
    return tracking.local_model_dir(mv.source, download / name / str(mv.version))


# ------------------------------------------------------------------------------------------------
# the replay


def check_request(cfg: Config, request: BacktestRequest) -> list[dt.date]:
    """Everything that can be refused before any Spark work (exit 2): the options, the range against the
    data, ``--work`` against the configured places; the nights to replay."""
    if request.train_every is not None and request.train_every < 1:
        raise ConfigError(f"--train-every must be at least 1 night, got {request.train_every}")
    if request.train_every is not None and request.model_uri is not None:
        raise ConfigError("--train-every and --model-uri exclude each other: --model-uri scores every night with "
                          "one model and trains nothing")
    check_range(cfg, request.start, request.end)
    check_work_dir(cfg, request.work)
    return date_range(request.start, request.end, names=("--from", "--to"))


def run_backtest(spark, cfg: Config, request: BacktestRequest) -> BacktestResult:
    """Replay the nights ``request.start``..``request.end`` into ``request.work`` and measure them."""
    from recsys.learning.shards import training_window
    from recsys.pipelines.nightly import run_nightly
    from recsys.pipelines.train import run_training, training_due
    from recsys.tracking import store as tracking

    started = time.perf_counter()
    nights = check_request(cfg, request)
    work = Path(request.work).resolve()
    log.info("[backtest] %d night(s) %s..%s into %s", len(nights), request.start, request.end, work)
    scratch = scratch_config(cfg, work, request.train_every)
    identity = {"from": str(request.start), "train_every": scratch.train.every_nights if not request.model_uri else None,
                "model_uri": request.model_uri, "events": redact_uri(cfg.paths.events),
                "catalog": redact_uri(cfg.paths.catalog), "config_digest": cfg.digest(),
                "baselines": cfg.evaluation.backtest.model_dump(mode="json")}
    prepare_work(work, {"identity": identity, "to": str(request.end), "recsys_version": __version__}, request.overwrite)
    model_note = import_model(cfg, scratch, request.model_uri, work, request.start) if request.model_uri else None

    settings, ev = cfg.evaluation.backtest, cfg.evaluation
    what = measure.Measurement(measure.SYSTEMS, request.start, request.end, k=SHORT_K, n=cfg.scoring.top_n)
    k, n = what.k, what.n
    log_events = measure.read_log(spark, cfg.paths.events, request.end, tuple(cfg.history.event_types))
    replay: list[dict[str, Any]] = []
    for i, night in enumerate(nights):
        t0 = time.perf_counter()
        row: dict[str, Any] = {"date": str(night)}
        # a night that trains reads its window once for training and the lists, as `recsys night` does
        with training_window(spark, scratch, night) as kept:
            if model_note is None:
                reason = training_due(scratch, night)
                if reason is None:
                    log.info("[backtest] %s (%d/%d): training on the events before it (train.every_nights=%d)",
                             night, i + 1, len(nights), scratch.train.every_nights)
                    trained = run_training(spark, scratch, night, kept=kept)
                    row.update(trained_version=trained.version, training_kind=trained.kind, gate=trained.decision,
                               promoted=trained.promoted)
                else:
                    row["training"] = f"not due: {reason}"
            row["train_s"] = round(time.perf_counter() - t0, 1)
            t1 = time.perf_counter()
            result = run_nightly(spark, scratch, night, accept_guard=True, kept=kept if kept.read else None)
        manifest = result.manifest
        version = manifest.model.version or "?"
        guard = manifest.quality.guard.get("verdict") if manifest.quality is not None else None
        row.update(model_version=version, guard=guard, published=result.status.value,
                   lists=manifest.counts.rows or 0, recommend_s=round(time.perf_counter() - t1, 1))
        t2 = time.perf_counter()
        row.update(_measure_night(spark, cfg, work, night, result, log_events, what))
        row.update(measure_s=round(time.perf_counter() - t2, 1), seconds=round(time.perf_counter() - t0, 1))
        replay.append(row)
        _progress(spark, work, night, i, len(nights), row, k)

    summary = measure.summarize(spark, str(work / "figures"), what,
                                bootstrap=Bootstrap(ev.bootstrap_resamples, ev.bootstrap_seed), settings=settings)
    by_date = {r["date"]: r for r in replay}
    for night_row in summary.nights:
        replayed = by_date.get(night_row["date"], {})
        night_row.update(replay={key: v for key, v in replayed.items() if key != "date"}, note=_night_note(replayed))
    summary.notes += _notes(scratch, request, model_note, replay)
    seconds = time.perf_counter() - started
    table = measure.format_table(summary)
    doc = {**summary.to_json(), "seconds": round(seconds, 1), "work": str(work),
           "tracking_uri": redact_uri(scratch.mlflow.tracking_uri),
           "settings": {"train_every": None if model_note else scratch.train.every_nights,
                        "model_uri": request.model_uri, "top_n": n, "k": k, **settings.model_dump(mode="json"),
                        "events": redact_uri(cfg.paths.events), "catalog": redact_uri(cfg.paths.catalog),
                        "window_days": cfg.history.window_days, "event_types": list(cfg.history.event_types),
                        "config_digest": cfg.digest(), "recsys_version": __version__}}
    if request.json_path is not None:
        measure.write_json(doc, request.json_path)
    experiment = f"{cfg.mlflow.experiment}-backtest"
    tracking.point_at(scratch.mlflow)
    run_id = measure.record(scratch.mlflow, experiment, summary, table, doc,
                            {key: value for key, value in doc["settings"].items() if value is not None})
    return BacktestResult(summary, table, doc, run_id, scratch.mlflow.tracking_uri, experiment, seconds, replay)


def _measure_night(spark, cfg: Config, work: Path, night: dt.date, result, log_events,
                   what: measure.Measurement) -> dict[str, Any]:
    """The night's per-user figures under ``work/figures/dt=NIGHT`` (at ``what.k`` and ``what.n``); kept from an
    earlier run when that run measured the same published lists with the same settings (a resumed backtest
    measures only what changed)."""
    from recsys.errors import RunStatus

    k, n = what.k, what.n

    place = work / "measure" / f"dt={night}"
    figures = work / "figures" / f"dt={night}"
    location = result.location or result.output_dir
    key = {"location": location, "k": k, "n": n, "baselines": cfg.evaluation.backtest.model_dump(mode="json")}
    marker = place / MEASURED_FILE
    if result.status == RunStatus.SKIPPED and marker.is_file() and figures.is_dir():
        try:
            previous = json.loads(marker.read_text())
        except (OSError, ValueError):
            previous = None
        if previous is not None and previous.get("key") == key:
            return {"measured": "kept from the earlier run", **previous.get("notes", {})}
    marker.unlink(missing_ok=True)
    inputs = measure.night_inputs(spark, log_events, cfg.paths.catalog, night, cfg.history, cfg.catalog.max_age_days,
                                  str(place / "users"))
    lists = {measure.JOB: measure.job_lists(spark.read.parquet(location))}
    made = measure.baseline_lists(inputs, n, cfg.evaluation.backtest, cfg.history.tie_break_seed,
                                  cfg.evaluation.als.seed, str(place / "als"))
    lists.update(made.lists)
    measure.measure(inputs.users, lists, k, n).write.mode("overwrite").parquet(str(figures))
    marker.write_text(json.dumps({"key": key, "notes": made.notes}) + "\n")
    return {"measured": "now", **made.notes}


def _progress(spark, work: Path, night: dt.date, i: int, total: int, row: dict[str, Any], k: int) -> None:
    """One line a night: what ran, how long, and the night's HR@k of the job and the baselines."""
    from pyspark.sql import functions as F

    figures = spark.read.parquet(str(work / "figures" / f"dt={night}"))
    cols = [measure.figure_column(s, f"hr@{k}{p}") for s in measure.SYSTEMS for p in ("", ".repeat", ".new")]
    got = figures.agg(F.count(F.lit(1)).alias("users"), *[F.avg(c).alias(c) for c in cols]).first().asDict()

    def hr(system: str) -> str:
        parts = [got[measure.figure_column(system, f"hr@{k}{p}")] for p in ("", ".repeat", ".new")]
        return "/".join("-" if v is None else f"{v:.3f}" for v in parts)

    trained = (f"trained version {row['trained_version']} ({row.get('training_kind', 'full')}; "
               f"{'alias moved' if row.get('promoted') else 'alias kept'})"
               if "trained_version" in row else "no training" + (f" ({row['training']})" if "training" in row else ""))
    log.info("[backtest] %s (%d/%d) in %.0f s (train %.0f s, recommend %.0f s, measure %.0f s): %s; lists of model "
             "version %s (%s, guard %s); %d returning users; HR@%d all/repeat/new: job %s, pfreq %s, als %s, "
             "als-masked %s, pop-masked %s", night, i + 1, total, row["seconds"], row["train_s"], row["recommend_s"],
             row["measure_s"], trained, row["model_version"], row["published"], row.get("guard") or "-",
             got["users"], k, hr(measure.JOB), hr(measure.PERSONAL), hr(measure.ALS), hr(measure.ALS_MASKED),
             hr(measure.POPULAR_MASKED))


def _night_note(row: dict[str, Any]) -> str:
    parts = [f"model v{row.get('model_version', '?')}"]
    if "trained_version" in row:
        parts.append(f"trained v{row['trained_version']} ({row.get('training_kind', 'full')})"
                     f"{'' if row.get('promoted') else ', gate kept the holder'}")
    if row.get("guard") not in (None, "pass"):
        parts.append(f"guard {row['guard']}")
    return "; ".join(parts)


def _notes(scratch: Config, request: BacktestRequest, model_note: str | None, replay: list[dict[str, Any]]) -> list[str]:
    if model_note:
        schedule = model_note
    else:
        trainings = sum("trained_version" in r for r in replay)
        kept = sum("trained_version" in r and not r.get("promoted") for r in replay)
        warm = sum(r.get("training_kind") == "warm" for r in replay)
        schedule = (f"trained every {scratch.train.every_nights} night(s) (train.every_nights"
                    f"{', --train-every' if request.train_every else ''}): {trainings} training(s)"
                    + (f", {warm} of them warm (train.warm_start)" if warm else "")
                    + (f", {kept} of them not promoted by the gate (the nights after kept the alias holder)" if kept else ""))
    refused = [r["date"] for r in replay if r.get("guard") in ("fail", "accepted")]
    notes = [f"the job: {schedule}"]
    if refused:
        notes.append(f"the guard refused the night(s) {', '.join(refused)}; the backtest published and measured them "
                     "anyway (--accept-guard)")
    return notes

