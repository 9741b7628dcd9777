"""``recsys serve``: the HTTP frontend (FastAPI on uvicorn): published lists from a store, and the warm Spark
Connect backend for the rest.

Endpoints (the OpenAPI description is at ``/openapi.json``, browsable at ``/docs``):

- ``GET /v1/users/{user_id}/recommendations?top_n=N&fresh=false``: one user's list, from the store
  ``serve.store`` names (Redis, or the embedded index of the newest published partition; docs/export.md);
- ``POST /v1/recommendations`` ``{"user_ids": [...], "top_n": N?, "timeout_ms": T?, "fresh": false}``: the
  same for many users. Users the store does not list, every user of a request asking for ``fresh`` lists,
  and every user while the store is down go to the on-demand backend when it runs: the row the nightly
  job would write, computed now (docs/on-demand.md). Each row says where it came from (``served_from``);
- ``POST /v1/jobs`` ``{"date": "YYYY-MM-DD"}`` or ``{"start_date": ..., "end_date": ...}``: the nightly
  job for those dates on the warm backend (``recsys.pipelines.nightly.run_dates``: same lock, skip and publish
  rules as ``recsys recommend``); ``GET /v1/jobs/{id}``: its state;
- ``GET /metrics`` (Prometheus), ``GET /healthz`` (the process is up), ``GET /readyz`` (the store answers,
  or the backend answers and the model is warm; says which store serves which version).

Nothing a client sends reaches a shell, a file path or a SQL string: ids are validated as 64-bit
integers and travel to Spark as an Arrow column; dates are parsed into ``datetime.date``.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from recsys.config import Config
from recsys.data.contracts import date_range
from recsys.errors import RunStatus, first_line
from recsys.serve.batching import Batcher, BatchSettings, DeadlineExceeded, QueueFull, ShuttingDown
from recsys.serve.lists import Found, StoreDown, aclose, make_store
from recsys.serve.lookup_route import INT64, LookupRoute
from recsys.serve.metrics import ServeMetrics
from recsys.serve.ondemand import BackendUnavailable, BatchFailed, OnDemand, is_backend_unavailable
from recsys.redaction import redact_text

# What a request's batch can fail with -> (HTTP status, metrics reason, problem type)
_REQUEST_FAILURES: dict[type[Exception], tuple[int, str, str]] = {
    QueueFull: (429, "queue_full", "queue_full"),
    DeadlineExceeded: (504, "deadline", "deadline_exceeded"),
    BackendUnavailable: (503, "backend_unavailable", "backend_unavailable"),
    ShuttingDown: (503, "shutting_down", "shutting_down"),
    BatchFailed: (500, "batch_failed", "batch_failed"),
}

log = logging.getLogger(__name__)



class RecommendationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_ids: list[StrictInt] = Field(description="users to recommend for (64-bit integers); repeated ids are answered once",
                                json_schema_extra={"example": [1, 2, 3]})
    top_n: StrictInt | None = Field(default=None, description="items per user, 1..scoring.top_n (default scoring.top_n)")
    timeout_ms: StrictInt | None = Field(default=None, description="this request's deadline in ms, at most "
                                                             "serve.request_timeout_s (default that)")
    fresh: StrictBool = Field(default=False, description="compute every user's list now on the on-demand backend "
                                                         "instead of looking it up in the published lists")


class Recommendation(BaseModel):
    item_id: int
    score: float


class UserRow(BaseModel):
    user_id: int
    recommendations: list[Recommendation]
    source: str = Field(description="'model', or the fallback's name (e.g. 'popularity') for users the model "
                                    "cannot score: no history, or none of its items known to the model")
    model_version: str
    served_from: str = Field(description="'redis' or 'embedded' (the published lists of serve.store), or "
                                         "'on_demand' (computed now by the backend)")
    date: str = Field(description="the published date of the list, or the date an on-demand list was computed as of")


class UserRecommendation(UserRow):
    catalog_snapshot: str
    version: str | None = Field(description="the store's version the list came from (null: computed on demand)")


class RecommendationResponse(BaseModel):
    rows: list[UserRow]
    model_version: str
    catalog_snapshot: str
    as_of: str = Field(description="histories hold events before this date from the cached window, plus the "
                                   "events of the partitions from this date on; for published lists, their date")
    served_from: str = Field(description="the rows' served_from when they share one, else 'mixed'")
    lists: dict[str, Any] | None = Field(default=None, description="the published lists' store, version, date and "
                                                                    "model version, when rows came from them")


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    date: dt.date | None = None
    start_date: dt.date | None = None
    end_date: dt.date | None = None
    force: bool = False


class JobState(BaseModel):
    id: str
    dates: list[str]
    state: Literal["queued", "running", "succeeded", "failed"]
    exit_code: int | None = None
    run_ids: list[str | None] = []
    published: list[str] = []
    skipped: list[str] = []
    error: str | None = None
    submitted_at: str
    finished_at: str | None = None


class Problem(BaseModel):
    error: str
    detail: str


def _problem(code: int, error: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=code, headers=headers)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


MAX_BODY_BYTES = 8 * 1024 * 1024   # 10,000 ids of 20 digits are 210 kB


@dataclass
class Service:
    """What the app's handlers share: the config, the backend side, the queue, the metrics, the jobs."""

    cfg: Config
    url_provider: Callable[[], str]
    hooks: Any = None                 # recsys.hooks.Hooks for game days (docs/faults.md); None: none
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    backend: OnDemand | None = None
    batcher: Batcher | None = None
    lists: Any = None                 # recsys.serve.lists.RedisLists | EmbeddedLists; None: serve.store is none
    ready: bool = False
    not_ready_reason: str = "starting"
    jobs: dict[str, JobState] = field(default_factory=dict)
    _maint_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "recsys-maintain"))
    _jobs_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "recsys-nightly"))
    _lists_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "recsys-lists"))
    _wake: asyncio.Event | None = None
    _wake_loop: asyncio.AbstractEventLoop | None = None   # mark_down() wakes the maintenance loop from job threads
    _last_batch: float = 0.0
    _stop: bool = False

    def run_batch(self, users: list[int]):
        backend = self.backend
        if backend is None or not self.ready:
            raise BackendUnavailable(f"the backend is not ready: {self.not_ready_reason}")
        try:
            result = backend.score(users)
        except BackendUnavailable as exc:
            self.mark_down(str(exc))
            raise
        self._last_batch = time.monotonic()
        return result

    def mark_down(self, reason: str, wake: bool = True) -> None:
        """The backend is gone: not ready, and (from a request's or a job's thread) the maintenance loop woken to
        reconnect now. The loop itself passes ``wake=False``: waking itself would retry at once, forever, while
        no backend runs (a busy loop that took CPU from every lookup in store-only serving)."""
        if self.ready:
            log.warning("backend unavailable: %s", reason)
        self.ready = False
        self.not_ready_reason = reason
        self.metrics.ready.set(0)
        if wake and self._wake is not None:
            self._wake_loop.call_soon_threadsafe(self._wake.set)

    # -- maintenance: connect, refresh, keep warm, reconnect --------------------------------------

    def _maintain_step(self) -> None:
        """Blocking: (re)connect if needed, refresh window/model/catalog, warm the workers."""
        cfg = self.cfg
        if self.backend is None or not self.ready:
            if self.backend is not None:
                self.backend.close()
            backend = OnDemand(cfg, self.url_provider(), self.hooks)
            backend.connect()
            self.metrics.backend_reconnects.inc()
            self.backend = backend
            backend.refresh(force_model=True)
            self._warm(backend)
            self.metrics.window_users.set(backend.window.users)
            self.ready = True
            self.not_ready_reason = ""
            self.metrics.ready.set(1)
            log.info("ready: %d users in the warm window, model version %s", backend.window.users,
                     backend.context.model_version)
            return
        self.backend.ping()
        if self.backend.refresh():
            self._warm(self.backend)
            self.metrics.window_users.set(self.backend.window.users)
        elif time.monotonic() - self._last_batch > 30:
            self._warm(self.backend)   # idle Python workers exit after about a minute

    def _warm(self, backend: OnDemand) -> None:
        """One tiny job per concurrent slot, so every worker a batch may land on has the model loaded."""
        n = self.cfg.serve.max_concurrent_jobs
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda _: backend.score([0]), range(n)))
        for r in results:
            self.metrics.cache_hits.inc(r.model_cache.hits)
            self.metrics.cache_misses.inc(r.model_cache.misses)
            self.metrics.cache_load_seconds.inc(r.model_cache.load_s)
        self._last_batch = time.monotonic()

    async def maintain_forever(self) -> None:
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._wake_loop = loop
        while not self._stop:
            try:
                await loop.run_in_executor(self._maint_pool, self._maintain_step)
            except Exception as exc:
                reason = redact_text(str(exc) if isinstance(exc, (BackendUnavailable, BatchFailed))
                                     else f"{type(exc).__name__}: {exc}")
                if self.ready and not is_backend_unavailable(exc):
                    # bad new input (a broken catalog snapshot, an unreadable model): keep serving
                    # with what was loaded before, and say so
                    self.metrics.errors.labels("refresh_failed").inc()
                    log.warning("refresh failed, still serving the previous model and catalog: %s", reason[:500])
                else:
                    self.mark_down(reason[:500], wake=False)
                    if self.batcher is not None:
                        self.batcher.fail_queued(BackendUnavailable(reason))
            interval = max(0.5, self.cfg.serve.refresh_s) if self.ready else 1.0
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def lists_forever(self) -> None:
        """Every ``serve.refresh_s``: the store's pointer (Redis) or the newest published partition (embedded)."""
        loop = asyncio.get_running_loop()
        while not self._stop and self.lists is not None:
            try:
                await loop.run_in_executor(self._lists_pool, self.lists.refresh)
            except Exception as exc:   # a refresh must never stop the loop
                log.warning("list store refresh failed: %s", redact_text(f"{type(exc).__name__}: {exc}")[:500])
            self.metrics.store_state(self.lists)
            await asyncio.sleep(max(0.5, self.cfg.serve.refresh_s))

    def on_demand_ready(self) -> bool:
        return self.ready and self.backend is not None and self.backend.context is not None

    async def answer(self, users: list[int], top_n: int, fresh: bool, timeout_s: float) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for these users: the store first (unless ``fresh``), on demand for the rest."""
        found: Found | None = None
        store_error = None
        if self.lists is not None and not fresh:
            try:
                found = await self.lists.lookup(users, top_n)
                self.metrics.store_up.set(1)
            except StoreDown as exc:
                store_error = str(exc)
                self.metrics.store_errors.inc()
                self.metrics.store_up.set(0)
        todo = users if found is None else found.missing
        computed: dict[int, dict[str, Any]] = {}
        context = None
        if todo and self.on_demand_ready():
            context, window = self.backend.context, self.backend.window
            try:
                computed, _ = await self.batcher.submit(todo, timeout_s)
            except tuple(_REQUEST_FAILURES) as exc:
                status, reason, kind = next(v for k, v in _REQUEST_FAILURES.items() if isinstance(exc, k))
                if found is None or found.fallback is None:
                    self.metrics.failed(status, reason)
                    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QueueFull) else None
                    return status, {"error": kind, "detail": str(exc), "_headers": headers}
                log.warning("on demand failed for %d user(s) missing from the lists (%s); they get the fallback list",
                            len(todo), first_line(exc))
                computed, context = {}, None
        elif todo and (fresh or found is None):
            why = f"the on-demand backend is not ready: {self.not_ready_reason}"
            if store_error is None:
                self.metrics.failed(503, "backend_unavailable")
                return 503, {"error": "backend_unavailable", "detail": why}
            self.metrics.failed(503, "store_unavailable")
            return 503, {"error": "store_unavailable", "detail": f"the list store is unavailable: {store_error}; {why}"}
        rows = []
        for user in users:
            if found is not None and user in found.rows:
                row = found.rows[user]
                rows.append(self._listed(user, row, found))
            elif user in computed:
                row = computed[user]
                rows.append({"user_id": user, "recommendations": row["recommendations"][:top_n], "source": row["source"],
                             "model_version": row["model_version"], "served_from": "on_demand",
                             "date": str(window.as_of)})
            else:   # missing from the lists, and nothing computed for them: the version's fallback list
                row = found.fallback or {"recommendations": [], "source": "none"}
                rows.append(self._listed(user, row, found))
        origins = {r["served_from"] for r in rows}
        for origin in origins:
            self.metrics.served_users.labels(origin).inc(sum(1 for r in rows if r["served_from"] == origin))
        if context is not None and computed:
            meta = {"model_version": context.model_version, "catalog_snapshot": str(context.catalog_snapshot),
                    "as_of": str(window.as_of)}
        else:
            meta = {"model_version": found.version.model_version, "catalog_snapshot": found.version.catalog_snapshot,
                    "as_of": found.version.date}
        return 200, {"rows": rows, **meta, "served_from": origins.pop() if len(origins) == 1 else "mixed",
                     "lists": found.version.describe() if found is not None else None}

    def reply(self, status: int, body: dict[str, Any], arrived: float, users: int,
              single: bool = False) -> tuple[int, dict[str, str] | None, dict[str, Any]]:
        """:meth:`answer`'s (status, body) -> (status, extra headers, JSON content), the answer counted in the
        metrics; ``single``: the one-user body of ``GET /v1/users/{id}/recommendations``. Shared by the FastAPI
        routes and the lookup route (:mod:`recsys.serve.lookup_route`), so both answer byte for byte alike."""
        if status != 200:
            return status, body.pop("_headers", None), {"error": body["error"], "detail": body["detail"]}
        seconds = time.monotonic() - arrived
        self.metrics.answered(users, seconds)
        if body["served_from"] != "on_demand" and body["served_from"] != "mixed":
            self.metrics.lookup_seconds.observe(seconds)
        if single:
            row = body["rows"][0]
            lists = body["lists"]
            listed = row["served_from"] != "on_demand" and lists
            body = {**row, "catalog_snapshot": lists["catalog_snapshot"] if listed else body["catalog_snapshot"],
                    "version": lists["version"] if listed else None}
        return 200, None, body

    @staticmethod
    def _listed(user: int, row: dict[str, Any], found: Found) -> dict[str, Any]:
        version = found.version
        return {"user_id": user, "recommendations": row["recommendations"], "source": row["source"],
                "model_version": version.model_version, "served_from": version.store, "date": version.date}

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> asyncio.Task:
        """On the app's event loop: the batcher, and the maintenance loop that connects the backend."""
        serve = self.cfg.serve
        self.batcher = Batcher(self.run_batch, BatchSettings(serve.max_wait_ms, serve.max_batch_users,
                                                             serve.max_concurrent_jobs, serve.max_queue_users),
                               self.metrics)
        self.batcher.start()
        self.lists = make_store(self.cfg)
        loop = asyncio.get_running_loop()
        if self.lists is not None:
            self._lists_task = loop.create_task(self.lists_forever())
        return loop.create_task(self.maintain_forever())

    async def stop(self, maintenance: asyncio.Task) -> None:
        """After uvicorn has stopped accepting and answered every open request: finish the queue, stop
        maintenance, wait for a running nightly job, close the backend."""
        await self.batcher.close()
        self._stop = True
        if self._wake is not None:
            self._wake.set()
        maintenance.cancel()
        if getattr(self, "_lists_task", None) is not None:
            self._lists_task.cancel()
        await aclose(self.lists)
        self._lists_pool.shutdown(wait=False)
        self._jobs_pool.shutdown(wait=True)
        if self.backend is not None:
            self.backend.close()
        log.info("stopped")

    # -- nightly jobs ---------------------------------------------------------------------------

    def submit_job(self, dates: list[dt.date], force: bool) -> JobState:
        job = JobState(id=uuid.uuid4().hex[:12], dates=[str(d) for d in dates], state="queued", submitted_at=_now())
        self.jobs[job.id] = job
        self.metrics.nightly_jobs.labels("queued").inc()
        self._jobs_pool.submit(self._run_job, job, dates, force)
        return job

    def _run_job(self, job: JobState, dates: list[dt.date], force: bool) -> None:
        from recsys.errors import RecsysError
        from recsys.hooks import NO_HOOKS
        from recsys.pipelines.nightly import overall_exit_code, run_dates

        job.state = "running"
        try:
            backend = self.backend
            if backend is None or backend.spark is None:
                raise BackendUnavailable(f"the backend is not connected: {self.not_ready_reason}")
            results = run_dates(backend.spark, self.cfg, dates, force=force, hooks=self.hooks or NO_HOOKS)
            job.run_ids = [r.run_id for r in results]
            job.published = [r.output_dir for r in results if r.status == RunStatus.PUBLISHED]
            job.skipped = [r.output_dir for r in results if r.status == RunStatus.SKIPPED]
            job.exit_code = int(overall_exit_code(results))
            job.state = "succeeded"
        except Exception as exc:
            job.exit_code = int(exc.exit_code) if isinstance(exc, RecsysError) else 1
            job.error = redact_text(f"{type(exc).__name__}: {exc}")[:2000]
            job.state = "failed"
        job.finished_at = _now()
        self.metrics.nightly_jobs.labels(job.state).inc()


def create_app(cfg: Config, url_provider: Callable[[], str], hooks: Any = None) -> LookupRoute:
    """The HTTP frontend: one :class:`Service` started and stopped with the app, and its routes; one-user
    lookups answered in front of FastAPI (:class:`recsys.serve.lookup_route.LookupRoute`, whose ``api`` is
    the FastAPI app)."""
    service = Service(cfg, url_provider, hooks)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        maintenance = service.start()
        try:
            yield
        finally:
            await service.stop(maintenance)

    app = FastAPI(title="recsys on-demand recommendations", version="1", lifespan=lifespan,
                  description="Per-user recommendations computed now by the nightly job's stages on a warm "
                              "Spark Connect backend; nightly jobs on demand. See docs/on-demand.md.")
    app.state.service = service

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        service.metrics.failed(400, "bad_request")
        return _problem(400, "bad_request", str(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A path or query parameter of the wrong type (``/v1/users/abc/...``, ``top_n=x``): a 400 naming it."""
        service.metrics.failed(400, "bad_request")
        problems = [f"{'.'.join(str(p) for p in err.get('loc', ())[1:]) or 'request'}: {err.get('msg')}"
                    for err in exc.errors()]
        return _problem(400, "bad_request", "; ".join(problems))

    _recommendation_routes(app, service)
    _job_routes(app, service)
    _operation_routes(app, service)
    return LookupRoute(app, service)


def _recommendation_routes(app: FastAPI, service: Service) -> None:
    """``GET /v1/users/{user_id}/recommendations`` and ``POST /v1/recommendations``: the store, then on demand."""
    cfg, serve = service.cfg, service.cfg.serve
    failures = {400: {"model": Problem}, 429: {"model": Problem}, 500: {"model": Problem}, 503: {"model": Problem},
                504: {"model": Problem}}

    def reply(status: int, body: dict[str, Any], arrived: float, users: int, single: bool = False) -> JSONResponse:
        code, headers, content = service.reply(status, body, arrived, users, single)
        return JSONResponse(content, status_code=code, headers=headers)

    @app.get("/v1/users/{user_id}/recommendations", response_model=UserRecommendation, responses=failures)
    async def user_recommendations(user_id: int, top_n: int | None = None, fresh: bool = False) -> Any:
        arrived = time.monotonic()
        if not -INT64 <= user_id < INT64:
            service.metrics.failed(400, "bad_request")
            return _problem(400, "bad_request", f"user_id = {user_id} is not a 64-bit integer")
        if top_n is not None and not 1 <= top_n <= cfg.scoring.top_n:
            service.metrics.failed(400, "bad_request")
            return _problem(400, "bad_request", f"top_n = {top_n} is out of range 1..{cfg.scoring.top_n} (scoring.top_n)")
        status, body = await service.answer([user_id], top_n or cfg.scoring.top_n, fresh, serve.request_timeout_s)
        return reply(status, body, arrived, 1, single=True)

    @app.post("/v1/recommendations", response_model=RecommendationResponse, openapi_extra=_body(RecommendationRequest),
              responses=failures)
    async def recommendations(request: Request) -> Any:
        arrived = time.monotonic()
        body = await _parse(request, RecommendationRequest)
        error = _check(body, serve.max_request_users, cfg.scoring.top_n, serve.request_timeout_s)
        if error:
            service.metrics.failed(400, "bad_request")
            return _problem(400, "bad_request", error)
        users = list(dict.fromkeys(body.user_ids))
        timeout = (body.timeout_ms / 1000) if body.timeout_ms else serve.request_timeout_s
        status, answer = await service.answer(users, body.top_n or cfg.scoring.top_n, body.fresh, timeout)
        return reply(status, answer, arrived, len(users))


def _job_routes(app: FastAPI, service: Service) -> None:
    """``POST /v1/jobs`` (the nightly job for dates, on the warm backend) and ``GET /v1/jobs/{id}``."""

    @app.post("/v1/jobs", response_model=JobState, status_code=202, openapi_extra=_body(JobRequest),
              responses={400: {"model": Problem}, 503: {"model": Problem}})
    async def submit_job(request: Request) -> Any:
        body = await _parse(request, JobRequest)
        if body.date is not None and (body.start_date or body.end_date):
            return _problem(400, "bad_request", "give either date or start_date and end_date, not both")
        if body.date is not None:
            dates = [body.date]
        elif body.start_date and body.end_date:
            try:
                dates = date_range(body.start_date, body.end_date, names=("start_date", "end_date"))
            except ValueError as exc:
                return _problem(400, "bad_request", str(exc))
        else:
            return _problem(400, "bad_request", "date (or start_date and end_date) is required")
        if service.backend is None or not service.ready:
            return _problem(503, "backend_unavailable", f"the backend is not ready: {service.not_ready_reason}")
        return service.submit_job(dates, body.force)

    @app.get("/v1/jobs/{job_id}", response_model=JobState, responses={404: {"model": Problem}})
    async def job_state(job_id: str) -> Any:
        job = service.jobs.get(job_id)
        if job is None:
            return _problem(404, "not_found", "no job with this id (jobs are kept in memory until the service stops)")
        return job


def _operation_routes(app: FastAPI, service: Service) -> None:
    """What operators and orchestrators poll: ``/metrics`` (Prometheus), ``/healthz``, ``/readyz``."""

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"model": Problem}})
    async def readyz() -> Any:
        """Ready when the store answers or the backend does; says which store serves which version."""
        lists = service.lists.status() if service.lists is not None else None
        on_demand: dict[str, Any] = {"ready": service.on_demand_ready()}
        if service.on_demand_ready():
            ctx = service.backend.context
            on_demand.update(model_version=ctx.model_version, catalog_snapshot=str(ctx.catalog_snapshot),
                             window_users=service.backend.window.users)
        else:
            on_demand["reason"] = service.not_ready_reason
        body = {"ready": bool(on_demand["ready"] or (lists and lists["up"])), "store": lists, "on_demand": on_demand}
        if on_demand["ready"]:
            body.update({k: on_demand[k] for k in ("model_version", "catalog_snapshot", "window_users")})
        if not body["ready"]:
            body["reason"] = (service.not_ready_reason if lists is None else
                              f"the list store: {lists['reason']}; the on-demand backend: {service.not_ready_reason}")
            return JSONResponse(body, status_code=503)
        return body


class BadRequest(Exception):
    """A 400 whose message names the field and what is wrong with it."""


def _body(model: type[BaseModel]) -> dict[str, Any]:
    """The request body's schema for the OpenAPI description (bodies are parsed by ``_parse``)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _parse(request: Request, model: type[BaseModel], limit: int = MAX_BODY_BYTES) -> Any:
    """JSON body -> ``model``, whatever the Content-Type says; BadRequest naming the field otherwise."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise BadRequest(f"the body is larger than {limit} bytes; send fewer user_ids per request")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body is not valid JSON; send an object such as {\"user_ids\": [1, 2]}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ())) or "body"
            if err.get("type") == "missing":
                problems.append(f"{where} is required")
            elif err.get("type") == "extra_forbidden":
                problems.append(f"{where} is not a known field")
            else:
                problems.append(f"{where}: {err.get('msg')}")
        raise BadRequest("; ".join(problems)) from None


def _check(body: RecommendationRequest, max_users: int, top_n_max: int, timeout_max_s: float) -> str | None:
    """Limits the typed model cannot know (they come from the config); None when the request is fine."""
    if not body.user_ids:
        return "user_ids must hold at least one id"
    if len(body.user_ids) > max_users:
        return f"user_ids holds {len(body.user_ids)} ids, more than serve.max_request_users={max_users}; split it"
    for i, user in enumerate(body.user_ids):
        if not -INT64 <= user < INT64:
            return f"user_ids[{i}] = {user} is not a 64-bit integer"
    if body.top_n is not None and not 1 <= body.top_n <= top_n_max:
        return f"top_n = {body.top_n} is out of range 1..{top_n_max} (scoring.top_n)"
    if body.timeout_ms is not None and not 1 <= body.timeout_ms <= timeout_max_s * 1000:
        return f"timeout_ms = {body.timeout_ms} is out of range 1..{int(timeout_max_s * 1000)} (serve.request_timeout_s)"
    return None
