"""MLflow: runs, parameters, metrics, artifacts and the model registry, behind a few small functions.

One job run is one MLflow run, named after the date it produced, whose id is written into the
published manifest. Recording is deliberately fault-tolerant: if the tracking store is down the
recommendations are still published, the manifest still carries every figure, and the job exits
with TRACKING_FAILED so the scheduler can flag it (see :class:`RunRecorder`).
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from recsys.config import MlflowConfig
from recsys.errors import ModelNotFoundError, RunStatus, TrackingUnavailable, first_line
from recsys.tracking import tags
from recsys.uris import is_local_path, local_path
from recsys.redaction import redact_text, redact_uri, redact_values

log = logging.getLogger(__name__)

# An unreachable tracking server should cost seconds, not MLflow's default minutes of retries.
# MLflow reads these variables on every request; they are set (unless the user set them) when the
# job points MLflow at its store, never at import, so importing this module changes nothing.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}

# MLflow error codes that mean "the store answered: no such model or alias" (anything else: not reachable)
_NOT_FOUND_CODES = frozenset({"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"})


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    alias: str
    version: str
    run_id: str | None
    source: str        # artifact URI the version points at
    local_dir: Path    # where the model files can be read (downloaded if the source is remote)

    @property
    def uri(self) -> str:
        return f"models:/{self.name}@{self.alias}"


_DEFAULT_PORTS = {"http": 80, "https": 443}


def tracking_store_id(tracking_uri: str) -> str:
    """Which tracking store ``tracking_uri`` names, as one spelling, without credentials.

    What the remembered model resolution and the date's lock are bound to, so that something
    learnt from one store is never used with another: a registry's "version 1 of recsys-default"
    means nothing in another registry. Two spellings of one store give the same id: relative sqlite
    and file-store paths are made absolute (MLflow resolves them against the working directory, so
    ``sqlite:///.recsys/mlflow.db`` in two checkouts is two stores); scheme and host are lower-cased, a
    default port, a trailing slash, the query and the fragment are dropped; ``user:password@`` never
    appears. Safe to write to disk and to log.
    """
    uri = tracking_uri.strip()
    if uri in ("databricks", "databricks-uc"):
        return uri
    if uri.lower().startswith("sqlite:///"):
        path = uri[len("sqlite:///"):].partition("?")[0]   # "/abs/db" for sqlite:////abs/db, "rel/db" for sqlite:///rel/db
        return "sqlite:///" + (path if path == ":memory:" else str(Path(path).resolve()))
    if is_local_path(uri):
        return local_path(uri).resolve().as_uri()
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError:
        return redact_uri(uri)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"   # an IPv6 literal
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        host = f"{host}:{port}"
    return f"{scheme}://{host}{parts.path.rstrip('/')}"


def setup(cfg: MlflowConfig, experiment: str | None = None) -> str:
    """Point MLflow at the configured store and return the experiment id (created if missing)."""
    import mlflow

    point_at(cfg)
    name = experiment or cfg.experiment
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        if tags.EXPERIMENT_KIND not in found.tags:
            _mark_model_development(found.experiment_id)
        return found.experiment_id
    location = None
    if cfg.artifact_location:
        location = cfg.artifact_location
        if is_local_path(location):
            local_path(location).mkdir(parents=True, exist_ok=True)
            location = local_path(location).as_uri()
    return mlflow.create_experiment(name, artifact_location=location,
                                    tags={tags.EXPERIMENT_KIND: EXPERIMENT_KIND})


# Without it, MLflow 3's UI guesses the experiment's kind and opened ours as GenAI "evaluation runs"
# (traces, judges, an assistant panel) instead of model training (metrics, parameters, artifacts).
EXPERIMENT_KIND = "custom_model_development"


def _mark_model_development(experiment_id: str) -> None:
    from mlflow import MlflowClient

    try:
        MlflowClient().set_experiment_tag(experiment_id, tags.EXPERIMENT_KIND, EXPERIMENT_KIND)
    except Exception as exc:   # cosmetic: never worth failing a run for
        log.debug("could not tag experiment %s with its kind: %s", experiment_id, exc)


def point_at(cfg: MlflowConfig) -> None:
    """Use the configured store for tracking and the registry (no network call)."""
    import mlflow

    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    uri = cfg.tracking_uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)


def resolve_model(cfg: MlflowConfig, download_root: Path) -> ResolvedModel:
    """The model version behind ``models:/<model_name>@<alias>``, with its files available locally.

    Two failures are told apart because a scheduler must treat them differently: the store
    answered that there is no such model or alias (ModelNotFoundError, exit 2: fix the config or
    train), or the store could not be asked (TrackingUnavailable: the caller may fall back to the
    last resolution it remembers, see :mod:`recsys.tracking.last_model`).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    where = f"models:/{cfg.model_name}@{cfg.alias} in {redact_uri(cfg.tracking_uri)}"
    try:
        point_at(cfg)
        mv = MlflowClient().get_model_version_by_alias(cfg.model_name, cfg.alias)
    except MlflowException as exc:
        if exc.error_code in _NOT_FOUND_CODES:
            raise ModelNotFoundError(
                f"no model at {where} ({first_line(exc)}); run `recsys train` first, or set mlflow.model_name / "
                f"mlflow.alias"
            ) from None
        raise TrackingUnavailable(f"cannot resolve {where}: {first_line(exc)}") from None
    except Exception as exc:  # connection errors that MLflow did not wrap
        raise TrackingUnavailable(f"cannot resolve {where}: {first_line(exc, with_type=True)}") from None
    try:
        local_dir = local_model_dir(mv.source, download_root / cfg.model_name / str(mv.version))
    except Exception as exc:
        raise TrackingUnavailable(f"cannot download the files of {where} version {mv.version}: "
                                  f"{first_line(exc, with_type=True)}") from None
    return ResolvedModel(
        name=cfg.model_name,
        alias=cfg.alias,
        version=str(mv.version),
        run_id=mv.run_id,
        source=mv.source,
        local_dir=local_dir,
    )


def model_version_dir(model_name: str, version: str, download_root: Path) -> Path:
    """The files of a registered model version (by number, not alias), downloaded under ``download_root`` if remote."""
    from mlflow import MlflowClient

    mv = MlflowClient().get_model_version(model_name, version)
    return local_model_dir(mv.source, download_root / model_name / str(version))


def local_model_dir(source: str, target: Path) -> Path:
    """A local directory with the files at ``source``: the source itself when local, else a download to ``target``."""
    from recsys.model.io import CONFIG_FILE  # here: model.io imports torch, which recording a run does not need

    if source.startswith("file://") or "://" not in source:
        path = local_path(source)
        if path.is_dir():
            return path
    if target.is_dir() and (target / CONFIG_FILE).is_file():
        return target  # model versions are immutable: a previous download is still valid
    import mlflow

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    downloaded = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp)))
    downloaded.rename(target)
    return target


def register_version(model_name: str, run_id: str, artifact_uri: str, description: str = "") -> str:
    """Register the model files logged by a training run as a new version; returns the version."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient()
    try:
        client.get_registered_model(model_name)
    except MlflowException:
        client.create_registered_model(model_name, description="recsys sequence recommender")
    mv = client.create_model_version(model_name, source=artifact_uri, run_id=run_id, description=description)
    return str(mv.version)


def alias_holder(model_name: str, alias: str) -> tuple[str, str | None] | None:
    """(version, run_id) currently holding the alias, or None."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        mv = MlflowClient().get_model_version_by_alias(model_name, alias)
    except MlflowException:
        return None
    return str(mv.version), mv.run_id


def training_experiment(cfg: MlflowConfig) -> str:
    """The experiment training runs are recorded in, next to the nightly runs' ``mlflow.experiment``."""
    return f"{cfg.experiment}-training"


@dataclass(frozen=True)
class FinishedTraining:
    """A training run that finished: the date it trained for, its kind and what the gate said."""

    date: dt.date
    kind: str            # full | warm (a run that records none trained in full)
    gate_verdict: str    # promoted | worse | close | undecided | forced ("" for runs that record none)


def finished_trainings(cfg: MlflowConfig, max_results: int = 200) -> list[FinishedTraining]:
    """The training runs of ``cfg.model_name`` that finished (a version was registered), newest date first,
    from the training experiment; failed trainings are left out. Reads at most ``max_results`` runs, the newest
    started.

    Several models may share one experiment (an A/B pair, a second model name for a test): each one's cadence
    and warm plan count only its own trainings. A run that records no model name (written before the name was
    tagged) counts for every name, as it did then."""
    from mlflow import MlflowClient

    try:
        point_at(cfg)
        client = MlflowClient()
        experiment = client.get_experiment_by_name(training_experiment(cfg))
        if experiment is None:
            return []
        runs = client.search_runs([experiment.experiment_id],
                                  filter_string=f"{tags.search_filter(tags.TRAIN_JOB)} and attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=max_results)
    except Exception as exc:
        raise TrackingUnavailable(f"cannot read the training runs from {redact_uri(cfg.tracking_uri)}: "
                                  f"{first_line(exc, with_type=True)}") from None
    found = [FinishedTraining(dt.date.fromisoformat(r.data.tags[tags.DATE]), r.data.tags.get(tags.TRAINING_KIND, "full"),
                              r.data.tags.get(tags.GATE_VERDICT, "")) for r in runs
             if tags.DATE in r.data.tags and r.data.tags.get(tags.MODEL_NAME, cfg.model_name) == cfg.model_name]
    return sorted(found, key=lambda t: t.date, reverse=True)    # stable: of one date, the newest started first


def last_training_date(cfg: MlflowConfig) -> dt.date | None:
    """The newest date a training run of ``cfg.model_name`` finished for (its ``recsys.date`` tag: it trained on
    the events before it), in the training experiment; None when none has. A failed training does not count."""
    trainings = finished_trainings(cfg, max_results=100)
    return trainings[0].date if trainings else None


def set_alias(model_name: str, alias: str, version: str) -> None:
    from mlflow import MlflowClient

    MlflowClient().set_registered_model_alias(model_name, alias, version)


_RUN_KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")   # what may go into a search filter unquoted


def end_killed_run(cfg: MlflowConfig, *, mlflow_run_id: str | None, job_run: str, found_by: str, why: str,
                   last_alive: dt.datetime | None = None) -> str | None:
    """End the MLflow run of a nightly run found dead: status KILLED, tagged with who found it and when.

    A killed process cannot end its own run, which would otherwise stay RUNNING in the UI and in
    ``recsys runs`` forever. ``mlflow_run_id`` is the id the dead run left in the date's lock; without
    one (an older lock, or a kill between the MLflow run's start and the lock's update) the RUNNING run
    tagged ``recsys.job_run = job_run`` in ``cfg.experiment`` is ended instead. ``found_by`` is the run
    key of the run that found it, ``why`` the lock's stale reason, ``last_alive`` the dead run's last
    heartbeat (its end time, never before its start). Returns the id of the run ended, or None when no
    such run is RUNNING (it ended, or never started). MLflow errors propagate: the caller decides.
    """
    from mlflow import MlflowClient

    point_at(cfg)
    client = MlflowClient()
    if mlflow_run_id:
        runs = [client.get_run(mlflow_run_id)]
    elif _RUN_KEY.match(job_run):
        experiment = client.get_experiment_by_name(cfg.experiment)
        runs = [] if experiment is None else client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`{tags.JOB_RUN}` = '{job_run}'", max_results=5)
    else:
        return None
    runs = [r for r in runs if r.info.status == "RUNNING"]
    if not runs:
        return None
    run = runs[0]
    found_at = dt.datetime.now(dt.timezone.utc)
    at = found_at.isoformat(timespec="seconds")
    date = run.data.tags.get(tags.DATE, "its date")
    _end_as_killed(client, run, last_alive or found_at, {
        tags.FOUND_DEAD_BY: found_by, tags.FOUND_DEAD_AT: at,
        tags.ERROR: f"killed: {why}; found dead by run {found_by} at {at}",
        tags.NOTE: (f"Killed while running for {date}: the process died before the run could end ({why}). Found "
                    f"dead at {at} by run {found_by}, which took over the date's lock and ended this MLflow run as "
                    f"KILLED."),
    })
    return run.info.run_id


def _end_as_killed(client: Any, run: Any, ended_at: dt.datetime, run_tags: Mapping[str, str]) -> None:
    """Tag ``run`` ``recsys.status=killed`` with ``run_tags`` (redacted) and end it as KILLED at ``ended_at``
    (never before its start): the one way a run whose process died is ended, by whoever found it dead."""
    from mlflow.entities import RunTag

    found = {tags.STATUS: RunStatus.KILLED.value, **run_tags}
    client.log_batch(run.info.run_id, tags=[RunTag(k, redact_text(v)) for k, v in found.items()])
    end_ms = int(ended_at.timestamp() * 1000)
    client.set_terminated(run.info.run_id, status="KILLED", end_time=max(end_ms, run.info.start_time or 0))


def end_dead_trainings(cfg: MlflowConfig, date: dt.date, started_after: dt.datetime, why: str) -> list[str]:
    """End as KILLED the training runs of ``cfg.model_name`` for ``date`` still RUNNING that started after
    ``started_after``: those of a training whose process died (``recsys night`` finds it by the mark that
    training left; :class:`recsys.pipelines.night.TrainingAttempt`). A killed process cannot end its own run,
    which would otherwise stay RUNNING in the MLflow UI forever. Returns the ids ended; MLflow errors propagate.
    """
    from mlflow import MlflowClient

    point_at(cfg)
    client = MlflowClient()
    experiment = client.get_experiment_by_name(training_experiment(cfg))
    if experiment is None:
        return []
    running = f"{tags.search_filter(tags.TRAIN_JOB, date)} and attributes.status = 'RUNNING'"
    runs = client.search_runs([experiment.experiment_id], filter_string=running, max_results=20)
    since_ms = int(started_after.timestamp() * 1000) - 1000     # the mark's time has whole seconds
    ended = []
    for run in runs:
        mine = run.data.tags.get(tags.MODEL_NAME, cfg.model_name) == cfg.model_name
        if not mine or (run.info.start_time or 0) < since_ms:
            continue
        found_at = dt.datetime.now(dt.timezone.utc)
        at = found_at.isoformat(timespec="seconds")
        _end_as_killed(client, run, found_at, {
            tags.FOUND_DEAD_AT: at, tags.ERROR: f"killed: {why}; found at {at}",
            tags.NOTE: f"Killed while training for {date}: {why}. Found at {at} by the next attempt of the night, "
                       f"which ended this MLflow run as KILLED.",
        })
        ended.append(run.info.run_id)
    return ended


def note_on_run(cfg: MlflowConfig, run_id: str, metrics: Mapping[str, float], run_tags: Mapping[str, str]) -> str | None:
    """Add metrics and tags to an existing (usually finished) run, e.g. the export of the partition it
    published; returns the error in one line if the store failed (the caller decides what that costs)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    try:
        point_at(cfg)
        now = int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)
        MlflowClient().log_batch(
            run_id,
            metrics=[Metric(metric_name(k), float(v), now, 0) for k, v in metrics.items() if _is_number(v)],
            tags=[RunTag(k, redact_text(str(v))[:5000]) for k, v in run_tags.items()])
    except Exception as exc:
        return first_line(exc, with_type=True)
    return None


class RunRecorder:
    """An MLflow run that degrades instead of failing the job when the tracking store misbehaves.

    Every call is attempted; the first failure is logged as a warning and later calls are skipped.
    ``failed`` tells the caller to exit with TRACKING_FAILED after publishing.
    """

    def __init__(self, cfg: MlflowConfig | None, run_name: str, *, experiment: str | None = None,
                 tags: Mapping[str, str] | None = None, unavailable: str | None = None):
        self.run_id: str | None = None
        self.error: str | None = None
        self._mlflow = None
        if unavailable is not None or cfg is None:   # already known to be down: do not wait for it again
            self.error = unavailable or "tracking disabled"
            log.warning("MLflow tracking failed, continuing without it: %s", self.error)
            return
        try:
            import mlflow

            experiment_id = setup(cfg, experiment)
            run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=dict(tags or {}))
            self.run_id = run.info.run_id
            self._mlflow = mlflow
        except Exception as exc:  # the store is down or misconfigured: publish anyway, say so
            self._fail(exc)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = f"{first_line(exc, with_type=True)}"
            log.warning("MLflow tracking failed, continuing without it: %s", self.error)

    def _call(self, fn_name: str, *args: Any, **kwargs: Any) -> None:
        if self._mlflow is None or self.failed:
            return
        try:
            getattr(self._mlflow, fn_name)(*args, **kwargs)
        except Exception as exc:
            self._fail(exc)

    # Everything below passes through redaction: whatever a caller hands over (an error message, a
    # path, a config), credentials in URIs never reach the tracking store.

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._call("log_params", {k: _param_value(v) for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        clean = {metric_name(k): float(v) for k, v in metrics.items() if v is not None and _is_number(v)}
        self._call("log_metrics", clean, step=step)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._call("set_tags", {k: redact_text(str(v))[:5000] for k, v in tags.items()})

    def log_dict(self, data: Mapping[str, Any], name: str) -> None:
        self._call("log_dict", redact_values(dict(data)), name)

    def log_text(self, text: str, name: str) -> None:
        self._call("log_text", redact_text(text), name)

    def log_figure(self, figure: Any, name: str) -> None:
        """Log a matplotlib figure and close it, logged or not: pyplot keeps every figure until closed, and a
        process that runs night after night (``recsys night``, a backfill, the backtest) would pile them up."""
        try:
            self._call("log_figure", figure, name)
        finally:
            import matplotlib.pyplot as plt

            plt.close(figure)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call("log_artifact", str(path), artifact_path)

    def log_artifacts(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call("log_artifacts", str(path), artifact_path)

    def log_input(self, dataset: Any, context: str | None = None) -> None:
        self._call("log_input", dataset, context=context)

    def call(self, fn: Any) -> None:
        """Run ``fn()`` (another MLflow call, e.g. on the registry) with the same degrade-don't-fail rule."""
        if self._mlflow is None or self.failed:
            return
        try:
            fn()
        except Exception as exc:
            self._fail(exc)

    def artifact_uri(self, sub: str = "") -> str | None:
        if self._mlflow is None or self.failed:
            return None
        try:
            return self._mlflow.get_artifact_uri(sub) if sub else self._mlflow.get_artifact_uri()
        except Exception as exc:
            self._fail(exc)
            return None

    def end(self, status: str = "FINISHED") -> None:
        if self._mlflow is None:
            return
        try:
            self._mlflow.end_run(status=status)
        except Exception as exc:
            self._fail(exc)


def metric_name(name: str) -> str:
    """MLflow allows only [A-Za-z0-9_-. :/] in metric names: ``ndcg@10`` is logged as ``ndcg_at_10``."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", name.replace("@", "_at_"))


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return redact_text(text)[:6000]


def _is_number(value: Any) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False
