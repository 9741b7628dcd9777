"""The frontend's figures in the Prometheus text format (``GET /metrics``), one registry per service.

Rates (requests and users per second) are the ``rate()`` of the ``*_total`` counters; the
``recsys_serve_*_per_second`` gauges hold the same over the last minute, for a quick look without
a Prometheus server.
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
_LOOKUP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
_USERS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 50000)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_users = Gauge("recsys_serve_queue_users", "Users waiting in the queue", registry=r)
        self.queue_requests = Gauge("recsys_serve_queue_requests", "Requests waiting in the queue", registry=r)
        self.requests = Counter("recsys_serve_requests", "Recommendation requests answered, by HTTP status",
                                ["code"], registry=r)
        self.users = Counter("recsys_serve_users", "Users answered with recommendations", registry=r)
        self.errors = Counter("recsys_serve_errors", "Requests answered with an error, by reason", ["reason"],
                              registry=r)
        self.wait_seconds = Histogram("recsys_serve_wait_seconds", "Time a request waited in the queue before "
                                      "its (first) Spark job started", buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("recsys_serve_request_seconds", "Time from arrival to answer (200s)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_users = Histogram("recsys_serve_batch_users", "Users per Spark job", buckets=_USERS_BUCKETS,
                                     registry=r)
        self.batch_requests = Histogram("recsys_serve_batch_requests", "Requests (or parts) coalesced per Spark job",
                                        buckets=_USERS_BUCKETS, registry=r)
        self.batch_seconds = Histogram("recsys_serve_batch_seconds", "Seconds per Spark job, as the frontend saw it",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.spark_jobs = Counter("recsys_serve_spark_jobs", "Spark jobs (batches) started, by outcome",
                                  ["outcome"], registry=r)
        self.jobs_in_flight = Gauge("recsys_serve_spark_jobs_in_flight", "Spark jobs (batches) running now",
                                    registry=r)
        self.cache_hits = Counter("recsys_backend_model_cache_hits", "Scoring tasks that found the model in "
                                  "their worker's cache", registry=r)
        self.cache_misses = Counter("recsys_backend_model_cache_misses", "Scoring tasks that loaded the model",
                                    registry=r)
        self.cache_load_seconds = Counter("recsys_backend_model_load_seconds", "Seconds workers spent loading models",
                                          registry=r)
        self.ready = Gauge("recsys_serve_ready", "1 when the backend answers and the model is warm", registry=r)
        self.backend_reconnects = Counter("recsys_serve_backend_reconnects", "Connections (re)established to the "
                                          "backend", registry=r)
        self.window_users = Gauge("recsys_serve_window_users", "Users with a history cached in the backend",
                                  registry=r)
        self.nightly_jobs = Counter("recsys_serve_nightly_jobs", "Nightly jobs run through /v1/jobs, by state",
                                    ["state"], registry=r)
        self.store_up = Gauge("recsys_serve_store_up", "1 when the list store (serve.store) answers", registry=r)
        self.store_info = Gauge("recsys_serve_store_info", "The published lists served: 1 for the store and the "
                                "version it serves", ["store", "version", "date", "model_version"], registry=r)
        self.store_errors = Counter("recsys_serve_store_errors", "Lookups the list store could not answer",
                                    registry=r)
        self.served_users = Counter("recsys_serve_served_users", "Users answered, by where their list came from "
                                    "(redis, embedded, on_demand)", ["served_from"], registry=r)
        self.lookup_seconds = Histogram("recsys_serve_lookup_seconds", "Arrival to answer of requests answered "
                                        "from the list store alone", buckets=_LOOKUP_BUCKETS, registry=r)
        self._store_labels: tuple[str, ...] | None = None
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        Gauge("recsys_serve_requests_per_second", "Requests answered with 200 per second, last minute",
              registry=r).set_function(lambda: self._rate(False))
        Gauge("recsys_serve_users_per_second", "Users answered per second, last minute",
              registry=r).set_function(lambda: self._rate(True))

    def answered(self, users: int, seconds: float) -> None:
        self.requests.labels("200").inc()
        self.users.inc(users)
        self.request_seconds.observe(seconds)
        with self._lock:
            self._recent.append((time.monotonic(), users))

    def store_state(self, lists) -> None:
        """The list store's state after a refresh: up or down, and which version it serves."""
        status = lists.status()
        self.store_up.set(1 if status["up"] else 0)
        labels = (status["store"], str(status.get("version", "")), str(status.get("date", "")),
                  str(status.get("model_version", "")))
        if labels != self._store_labels:
            self.store_info.clear()
            self.store_info.labels(*labels).set(1)
            self._store_labels = labels

    def failed(self, code: int, reason: str) -> None:
        self.requests.labels(str(code)).inc()
        self.errors.labels(reason).inc()

    def users_per_second(self) -> float:
        return self._rate(True)

    def _rate(self, users: bool, window: float = 60.0) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - window:
                self._recent.popleft()
            if not self._recent:
                return 0.0
            span = max(1.0, min(window, now - self._recent[0][0]))
            return sum(n if users else 1 for _, n in self._recent) / span
