"""Prometheus metrics at ``GET /metrics`` (text exposition format).

Two kinds, with different guarantees when several worker processes serve one coordinator:

* the *run state* (runs by status, peers and peers online, samples, reports stored) is read
  from the database at scrape time: every worker reports the same values;
* per-process instruments (HTTP requests and latencies, reports written or pruned, rate
  limit refusals) count what this process served, labelled with its ``pid``: a scrape sees
  one worker's share; scrape each worker for exact totals.

Each app owns its registry (no global state), so several apps can live in one process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.clock import now_ms
from server.models import EpochSummary, Peer, Run, RunStatus
from server.services import presence
from server.services.run_totals import float_sum, saturated

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class DatabaseCollector(Collector):
    """Run-state metrics computed from SQL on every scrape."""

    def __init__(self, session_factory: sessionmaker[Session], online_ttl_s: float) -> None:
        self._session_factory = session_factory
        self._online_ttl_s = online_ttl_s

    def collect(self) -> Iterator[Metric]:
        runs = GaugeMetricFamily(
            "swarmgrad_runs", "Runs by status (archived excluded).", labels=["status"]
        )
        peers = GaugeMetricFamily(
            "swarmgrad_peers", "Peers that ever joined the run.", labels=["run_id"]
        )
        online = GaugeMetricFamily(
            "swarmgrad_peers_online", "Peers seen within the online TTL.", labels=["run_id"]
        )
        samples = CounterMetricFamily(
            "swarmgrad_samples", "Samples processed by the run's peers.", labels=["run_id"]
        )
        throughput = GaugeMetricFamily(
            "swarmgrad_samples_per_second",
            "What the online peers claim to compute, summed (the run's counted rate is on "
            "its progress).",
            labels=["run_id"],
        )
        reports = CounterMetricFamily(
            "swarmgrad_reports", "Progress reports stored for the run.", labels=["run_id"]
        )
        since = now_ms() - int(self._online_ttl_s * 1000)
        with self._session_factory() as session:
            counts = dict(
                session.execute(
                    select(Run.status, func.count())
                    .where(Run.archived_at.is_(None))
                    .group_by(Run.status)
                ).all()
            )
            for status in RunStatus:
                runs.add_metric([status.value], counts.get(status, 0))
            active = select(Run.id).where(Run.archived_at.is_(None)).scalar_subquery()
            for run_id, total, live, done, sps in session.execute(
                select(
                    Peer.run_id,
                    func.count(),
                    func.sum(case((presence.online(since), 1), else_=0)),
                    float_sum(Peer.samples_base + Peer.samples),
                    func.sum(case((presence.online(since), Peer.samples_per_second), else_=0)),
                )
                .where(Peer.run_id.in_(active))
                .group_by(Peer.run_id)
            ):
                peers.add_metric([run_id], total)
                online.add_metric([run_id], live or 0)
                samples.add_metric([run_id], saturated(done))
                throughput.add_metric([run_id], sps or 0.0)
            for run_id, stored in session.execute(
                select(EpochSummary.run_id, func.sum(EpochSummary.reports))
                .where(EpochSummary.run_id.in_(active))
                .group_by(EpochSummary.run_id)
            ):
                reports.add_metric([run_id], stored or 0)
        yield from (runs, peers, online, samples, throughput, reports)


class Metrics:
    """The app's registry and its per-process instruments."""

    def __init__(self, session_factory: sessionmaker[Session], online_ttl_s: float) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        pid = [str(os.getpid())]
        labels = ["pid", "method", "route", "status"]
        self._pid = pid
        self.requests = Counter(
            "swarmgrad_http_requests",
            "HTTP requests served by this process.",
            labels,
            registry=self.registry,
        )
        self.latency = Histogram(
            "swarmgrad_http_request_duration_seconds",
            "Time to answer HTTP requests in this process.",
            ["pid", "method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.reports_written = Counter(
            "swarmgrad_process_reports_written",
            "Progress reports this process wrote to the database.",
            ["pid"],
            registry=self.registry,
        )
        self.buffer_pending = Gauge(
            "swarmgrad_process_report_buffer_pending",
            "Reports acknowledged by this process and not yet written.",
            ["pid"],
            registry=self.registry,
        )
        self.reports_pruned = Counter(
            "swarmgrad_process_reports_pruned",
            "Raw progress reports this process deleted past report_retention_s (folded into "
            "rollups first).",
            ["pid"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "swarmgrad_process_rate_limited",
            "Requests this process refused with 429 for a rate limit, by endpoint and by whose "
            "bucket was empty (the peer token's or the client address's).",
            ["pid", "endpoint", "by"],
            registry=self.registry,
        )
        self.registry.register(DatabaseCollector(session_factory, online_ttl_s))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(*self._pid, method, route, str(status)).inc()
        self.latency.labels(*self._pid, method, route).observe(seconds)

    def count_written(self, n: int) -> None:
        self.reports_written.labels(*self._pid).inc(n)

    def count_pruned(self, n: int) -> None:
        self.reports_pruned.labels(*self._pid).inc(n)

    def count_rate_limited(self, endpoint: str, by: str) -> None:
        self.rate_limited.labels(*self._pid, endpoint, by).inc()

    def set_pending(self, n: int) -> None:
        self.buffer_pending.labels(*self._pid).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Times every HTTP request and labels it with its route template, not the raw path
    (so ids do not explode the number of series)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(scope["method"], path, status, time.perf_counter() - start)
