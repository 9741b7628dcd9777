"""``recsys runs``: the nightly runs as an operator asks about them, read back from the tracking store.

What a scheduler shows is an exit code per night; what the MLflow UI shows is one run at a time.
This lists the nights (date, status, exit code, model version, users, throughput, seconds per
stage, problems counted) in one table, from whatever store ``mlflow.tracking_uri`` names (the
sqlite default or a server), and shows one run with its note, inputs, manifest and plots.

A run whose recording failed half-way (exit code 5: published, but the store went away) stays
RUNNING in MLflow forever; the published partition's manifest names its run id and the tracking
error, so it is shown as ``published, not recorded`` with exit code 5.

A run whose process was killed cannot end its MLflow run; the next run of its date takes over its
lock and ends it as KILLED, tagged with who found it dead and when (``recsys.pipelines.nightly``).
It is shown as ``killed``, without an exit code (the process never returned one), the error column
saying what the next run found. Until a next run comes, it shows as ``running``.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from recsys.config import Config
from recsys.errors import ConfigError, ExitCode, RunStatus, TrackingUnavailable, first_line, first_line_of
from recsys.publish.lock import BEST_EFFORT
from recsys.publish.manifest import Manifest
from recsys.publish.manifest import parse as parse_manifest
from recsys.publish.manifest import read as read_manifest
from recsys.tracking import tags
from recsys.redaction import redact_uri

# the trend `recsys runs` shows beside the guard's verdict: the previous night's lists' realized HR@10
# (model, popularity baseline, personal-frequency baseline; the model's over repeats and over new items),
# the overlap with the previous night and catalog coverage
TREND_METRICS = ("realized_hr_at_10", "realized_pop_hr_at_10", "realized_pfreq_hr_at_10", "realized_hr_at_10_repeat",
                 "realized_hr_at_10_new", "jaccard_at_n_mean", "catalog_coverage")
TREND_NIGHTS = 30
PROBLEM_METRICS = ("dropped_null_user_id", "dropped_null_item_id", "unknown_items", "nonfinite_users",
                   "task_retries", "fallback_users")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def _client(cfg: Config):
    from mlflow import MlflowClient

    from recsys.tracking import store as tracking

    tracking.point_at(cfg.mlflow)
    return MlflowClient()


def _experiment_id(client, cfg: Config) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    except MlflowException as exc:
        raise TrackingUnavailable(f"cannot read runs from {redact_uri(cfg.mlflow.tracking_uri)}: "
                                  f"{first_line(exc)}") from None
    except Exception as exc:
        raise TrackingUnavailable(f"cannot read runs from {redact_uri(cfg.mlflow.tracking_uri)}: "
                                  f"{type(exc).__name__}") from None
    return experiment.experiment_id if experiment else None


def list_runs(cfg: Config, *, last: int = 20, date: dt.date | None = None) -> list[dict[str, Any]]:
    """The newest ``last`` nightly runs (of ``date`` only, if given), newest first, as plain dicts."""
    if last < 1:
        raise ConfigError(f"--last must be 1 or more, got {last}")
    client = _client(cfg)
    experiment_id = _experiment_id(client, cfg)
    if experiment_id is None:
        return []
    query = tags.search_filter(tags.NIGHTLY_JOB, date)
    try:
        runs = client.search_runs([experiment_id], filter_string=query, order_by=["attributes.start_time DESC"],
                                  max_results=last)
    except Exception as exc:
        raise TrackingUnavailable(f"cannot search runs in {redact_uri(cfg.mlflow.tracking_uri)}: "
                                  f"{first_line(exc, with_type=True)}") from None
    return [summarise(run, _published_manifest(cfg, run.data.tags.get(tags.DATE))) for run in runs]


def summarise(run: Any, manifest: Manifest | None = None) -> dict[str, Any]:
    """One run as the row ``recsys runs`` prints (and ``--json`` emits)."""
    run_tags, metrics = run.data.tags, run.data.metrics
    status, exit_code = _status(run, manifest)
    start = run.info.start_time
    return {
        "run_id": run.info.run_id,
        "date": run_tags.get(tags.DATE),
        "started": dt.datetime.fromtimestamp(start / 1000, dt.timezone.utc).isoformat(timespec="seconds")
        if start else None,
        "status": status,
        "exit_code": exit_code,
        "model_version": run_tags.get(tags.MODEL_VERSION),
        "users": _int(metrics.get("rows", metrics.get("users_in_window"))),
        "users_per_s": round(metrics["users_per_s"], 1) if "users_per_s" in metrics else None,
        "wall_s": round(metrics["total_s"], 1) if "total_s" in metrics else None,
        "stages_s": {k.removeprefix("stage_").removesuffix("_s"): round(v, 1) for k, v in sorted(metrics.items())
                     if k.startswith("stage_") and k.endswith("_s")},
        "problems": {k: _int(metrics[k]) for k in PROBLEM_METRICS if metrics.get(k)},
        "error": first_line_of(run_tags.get(tags.ERROR) or "")[:300] or None,
        "note": run_tags.get(tags.NOTE),
        "found_dead_by": run_tags.get(tags.FOUND_DEAD_BY),   # a killed run: the run key that found it dead, and when
        "found_dead_at": run_tags.get(tags.FOUND_DEAD_AT),
        "guard": run_tags.get(tags.GUARD),                   # the guard's verdict, and what crossed a threshold
        "guard_crossed": run_tags.get(tags.GUARD_CROSSED),
        "lock": run_tags.get(tags.LOCK),                     # what the date's lock promised (absent in older runs)
        "training_failed": run_tags.get(tags.TRAINING_FAILED),   # recsys night: why its training failed
        **{name: _round(metrics.get(name)) for name in TREND_METRICS},
    }


def _status(run: Any, manifest: Manifest | None) -> tuple[str, int | None]:
    run_tags = run.data.tags
    code = run_tags.get(tags.EXIT_CODE)
    if run.info.status == "FINISHED":
        return run_tags.get(tags.STATUS, "finished"), int(code) if code is not None else 0
    if run.info.status == "FAILED":
        return RunStatus.FAILED.value, int(code) if code is not None else None
    if manifest is not None and manifest.run_id == run.info.run_id:
        if manifest.tracking.error:
            return f"{RunStatus.PUBLISHED}, not recorded", int(ExitCode.TRACKING_FAILED)
        return f"{RunStatus.PUBLISHED}, recording unfinished", None
    if run.info.status == "KILLED":   # found dead by a later run of its date, which ended it (see the error column)
        return RunStatus.KILLED.value, None
    return run.info.status.lower(), None   # RUNNING: in progress, or killed and not yet found dead


def _published_manifest(cfg: Config, date: str | None) -> Manifest | None:
    if not date:
        return None
    try:
        return read_manifest(cfg.paths.output, dt.date.fromisoformat(date))
    except (OSError, ValueError):
        return None


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 4)


def _figure(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _hit_rates(r: dict[str, Any]) -> str:
    """model/popularity/personal frequency; empty when none was measured."""
    names = ("realized_hr_at_10", "realized_pop_hr_at_10", "realized_pfreq_hr_at_10")
    if all(r.get(name) is None for name in names):
        return ""
    return "/".join(_figure(r.get(name)) for name in names)


def _repeat_new(r: dict[str, Any]) -> str:
    """The model's HR@10 over repeats/over new items; '-' for a kind no user had."""
    names = ("realized_hr_at_10_repeat", "realized_hr_at_10_new")
    if all(r.get(name) is None for name in names):
        return ""
    return "/".join(_figure(r.get(name)) for name in names)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table, newest first; stage seconds and problems in the last columns."""
    if not rows:
        return "no nightly runs recorded"
    header = ["date", "status", "exit", "guard", "HR@10 model/pop/pfreq", "rep/new", "overlap", "coverage", "model",
              "users", "users/s", "wall s", "run", "stages (s)", "problems / error"]
    lines = [header]
    for r in rows:
        stages = " ".join(f"{k}={v:g}" for k, v in r["stages_s"].items())
        problems = ", ".join(f"{k}={v:,}" for k, v in r["problems"].items())
        lines.append([
            r["date"] or "?", r["status"], "" if r["exit_code"] is None else str(r["exit_code"]),
            r.get("guard") or "", _hit_rates(r), _repeat_new(r),
            "" if r.get("jaccard_at_n_mean") is None else _figure(r["jaccard_at_n_mean"]),
            "" if r.get("catalog_coverage") is None else _figure(r["catalog_coverage"]),
            r["model_version"] or "", "" if r["users"] is None else f"{r['users']:,}",
            "" if r["users_per_s"] is None else f"{r['users_per_s']:,.0f}",
            "" if r["wall_s"] is None else f"{r['wall_s']:.1f}", r["run_id"][:8], stages,
            "; ".join(x for x in (r["error"] or problems, _lock_warning(r), (r.get("training_failed") or "")[:200])
                      if x),
        ])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
                     for row in lines).rstrip()


def _lock_warning(r: dict[str, Any]) -> str:
    """What the table says about a run's lock: only a best-effort one is worth a word there."""
    return f"lock: {r['lock']}" if r.get("lock") == BEST_EFFORT else ""


def show_run(cfg: Config, which: str) -> dict[str, Any]:
    """One run by run id, or the newest run of a date (YYYY-MM-DD): summary, params, metrics, inputs, manifest, plots."""
    from mlflow.exceptions import MlflowException

    client = _client(cfg)
    if _RUN_ID.match(which):
        try:
            run = client.get_run(which)
        except MlflowException as exc:
            raise ConfigError(f"no run {which} in {redact_uri(cfg.mlflow.tracking_uri)} "
                              f"({first_line(exc)}); list runs with `recsys runs`") from None
    else:
        try:
            date = dt.date.fromisoformat(which)
        except ValueError:
            raise ConfigError(f"{which!r} is neither a date (YYYY-MM-DD) nor a run id (32 hex digits)") from None
        found = list_runs(cfg, last=1, date=date)
        if not found:
            raise ConfigError(f"no nightly run for {date} in experiment {cfg.mlflow.experiment!r} of "
                              f"{redact_uri(cfg.mlflow.tracking_uri)}; list runs with `recsys runs`")
        run = client.get_run(found[0]["run_id"])
    manifest_published = _published_manifest(cfg, run.data.tags.get(tags.DATE))
    out = summarise(run, manifest_published)
    out["trend"] = _trend(cfg, out["date"])
    artifacts = _list_artifacts(client, run.info.run_id)
    manifest = None
    if "manifest.json" in artifacts:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                manifest = parse_manifest(Path(client.download_artifacts(run.info.run_id, "manifest.json", tmp))
                                          .read_text())
            except Exception:
                manifest = None
    if manifest is None and manifest_published is not None and manifest_published.run_id == run.info.run_id:
        manifest = manifest_published
    base = run.info.artifact_uri.rstrip("/")
    out.update(
        experiment_id=run.info.experiment_id,
        run_name=run.info.run_name,
        mlflow_status=run.info.status,
        params=dict(sorted(run.data.params.items())),
        metrics=dict(sorted(run.data.metrics.items())),
        tags={k: v for k, v in sorted(run.data.tags.items()) if k.startswith(tags.PREFIX)},
        inputs=[{"name": d.dataset.name, "digest": d.dataset.digest, "source": _source(d.dataset.source),
                 "context": next((t.value for t in d.tags if t.key == tags.DATASET_CONTEXT), None)}
                for d in (run.inputs.dataset_inputs if run.inputs else [])],
        manifest=manifest.as_dict() if manifest is not None else None,
        artifacts=[f"{base}/{a}" for a in artifacts],
        plots=[f"{base}/{a}" for a in artifacts if a.endswith(".png")],
        ui=_ui_link(cfg, run),
    )
    return out


def _trend(cfg: Config, date: str | None) -> list[dict[str, Any]]:
    """The published nights up to ``date`` (the newest run of each), oldest first, at most :data:`TREND_NIGHTS`."""
    if not date:
        return []
    newest: dict[str, dict[str, Any]] = {}
    for row in list_runs(cfg, last=3 * TREND_NIGHTS):
        if row["date"] and row["date"] <= date and row["status"].startswith(RunStatus.PUBLISHED.value):
            newest.setdefault(row["date"], row)
    return [newest[d] for d in sorted(newest)[-TREND_NIGHTS:]]


def _list_artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for item in client.list_artifacts(run_id, path):
        if item.is_dir:
            out.extend(_list_artifacts(client, run_id, item.path))
        else:
            out.append(item.path)
    return sorted(out)


def _source(source: str) -> str:
    try:
        return json.loads(source).get("path", source)
    except (ValueError, AttributeError):
        return source


def _ui_link(cfg: Config, run: Any) -> str | None:
    uri = redact_uri(cfg.mlflow.tracking_uri)
    if uri.startswith(("http://", "https://")):
        # MLflow 3's UI opens in its GenAI view (traces, judges) unless asked for the model-training one
        return (f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
                "?workflowType=machine_learning")
    return None


def format_run(run: dict[str, Any]) -> str:
    """``recsys runs show``: the run in sections an operator reads top to bottom."""
    lines = [
        f"run {run['run_id']} ({run['run_name']}), date {run['date']}: {run['status']}, exit code "
        f"{'?' if run['exit_code'] is None else run['exit_code']}, model version {run['model_version']}",
    ]
    if run.get("note"):
        lines += ["", run["note"]]
    if run.get("error"):
        lines += ["", f"error: {run['error']}"]
    if run.get("lock"):
        lines += ["", f"lock: {run['lock']}" + (" (the store has no conditional writes: runs of one date must not "
                                                  "overlap there)" if run["lock"] == BEST_EFFORT else "")]
    if run.get("guard"):
        lines += ["", f"guard: {run['guard']}" + (f" ({run['guard_crossed']})" if run.get("guard_crossed") else "")]
    if run.get("trend"):
        lines += ["", "last nights (realized HR@10 of the previous night's lists, model/popularity/personal "
                      "frequency, and the model's over repeats/new items; overlap with the previous night; "
                      "catalog coverage):"]
        lines += [f"  {t['date']}  {(t.get('guard') or '-'):8}  HR@10 {_hit_rates(t) or '-':17}  rep/new "
                  f"{_repeat_new(t) or '-':11}  overlap {_figure(t.get('jaccard_at_n_mean'))}  coverage "
                  f"{_figure(t.get('catalog_coverage'))}" for t in run["trend"]]
    lines += ["", f"users {run['users']}, {run['users_per_s']} users/s, {run['wall_s']} s in all"]
    if run["stages_s"]:
        lines.append("stages (s): " + ", ".join(f"{k} {v:g}" for k, v in run["stages_s"].items()))
    if run["problems"]:
        lines.append("counted: " + ", ".join(f"{k} {v:,}" for k, v in run["problems"].items()))
    if run["inputs"]:
        lines += ["", "inputs:"] + [f"  {d['context'] or 'input'}: {d['name']} digest {d['digest']} from {d['source']}"
                                    for d in run["inputs"]]
    lines += ["", "plots:"] + ([f"  {p}" for p in run["plots"]] or ["  none recorded"])
    if run.get("ui"):
        lines += ["", f"MLflow UI: {run['ui']}"]
    lines += ["", "manifest:", json.dumps(run["manifest"], indent=2) if run["manifest"] else "  none recorded"]
    return "\n".join(lines)


def to_json(value: Any) -> str:
    return json.dumps(value, indent=2, default=str)

