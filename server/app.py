"""The app factory: ``create_app(settings)`` builds one coordinator.

Serve it with uvicorn, which runs the lifespan: migrations (unless disabled), then the
report buffer; on shutdown the buffer is flushed and the pool closed. ``app_from_env`` is
the factory uvicorn's workers use (``uvicorn --factory server.app:app_from_env``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from server import web
from server.api.fast_reports import ReportFastPath
from server.api.rate_limits import RateLimitMiddleware, limiter_from_settings
from server.api.routes import checkpoints, dashboard, health, peers, progress, runs, tokens
from server.config import Settings
from server.db import make_engine, make_session_factory, upgrade_database
from server.document_cache import DocumentCache
from server.exceptions import CoordinatorError
from server.live import LiveHub
from server.metrics import Metrics, MetricsMiddleware
from server.schemas import ErrorPublic
from server.security import JoinChallenges, KeyBox, PrincipalCache
from server.services.checkpoints import CheckpointStore
from server.services.credit_rates import CreditLimits
from server.services.report_bounds import ReportLimits
from server.services.report_buffer import ReportBuffer, database_unavailable
from server.services.report_guard import ReportGuard
from server.services.report_spill import ReportSpill
from server.services.retention import ReportRetention
from server.services.revocation_sweep import RevocationSweep

logger = logging.getLogger("server")

MAX_BODY_BYTES = 1024 * 1024
# On every answer, so that a client can tell a coordinator from whatever else answers at a
# URL (a captive portal, a proxy's error page, another service).
COORDINATOR_HEADER = (b"x-swarmgrad-coordinator", b"1")

ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorPublic, "description": description}
    for status, description in {
        401: "Missing, unknown, expired, revoked or used-up token.",
        403: "Valid token of the wrong scope or for another run.",
        404: "Unknown id.",
        409: "Conflicts with the resource's state.",
    }.items()
}


def create_app(settings: Settings | None = None) -> FastAPI:
    """A coordinator for ``settings`` (default: read from ``SWARMGRAD_*`` variables)."""
    settings = settings if settings is not None else Settings()
    engine = make_engine(settings)
    session_factory = make_session_factory(engine)
    metrics = Metrics(session_factory, settings.peer_online_ttl_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.migrate_on_start:
            await asyncio.to_thread(upgrade_database, engine)
        # Everything loaded so far (modules, the app) lives as long as the process: keep it
        # out of the collector's full passes, which otherwise rescan it every few thousand
        # allocations and put 60-100 ms pauses into the answers (bench/dashboard.py's p99).
        gc.collect()
        gc.freeze()
        buffer = ReportBuffer(
            session_factory,
            flush_interval_s=settings.report_flush_interval_s,
            max_pending=settings.report_buffer_max,
            snapshot_interval_s=settings.snapshot_interval_s,
            online_ttl_s=settings.peer_online_ttl_s,
            spill=ReportSpill(settings.spill_dir),
            on_written=metrics.count_written,
            housekeeping=None
            if settings.report_retention_s is None
            else ReportRetention(
                session_factory,
                retention_s=settings.report_retention_s,
                interval_s=settings.report_retention_interval_s,
                online_ttl_s=settings.peer_online_ttl_s,
                on_pruned=metrics.count_pruned,
            ),
        )
        sweep = RevocationSweep(
            app.state.principal_cache,
            session_factory,
            settings.peer_auth_recheck_s,
            rewarm_s=settings.peer_auth_cache_ttl_s / 2,
        )
        app.state.revocation_sweep = sweep
        async with buffer, sweep:
            app.state.report_buffer = buffer
            try:
                yield
            finally:
                app.state.report_buffer = None
                await app.state.live_hub.close()
        engine.dispose()

    app = FastAPI(
        title="Swarmgrad coordinator",
        version="1",
        summary="Runs, invites, peer credentials, bootstrap peers and progress.",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = session_factory
    secret, previous = settings.secret_keys()
    app.state.keybox = KeyBox(secret, previous)
    app.state.join_challenges = JoinChallenges(
        secret, settings.join_challenge_ttl_s, previous=previous
    )
    app.state.checkpoint_store = CheckpointStore(
        settings.checkpoint_dir,
        keep=settings.checkpoint_keep,
        max_bytes=settings.checkpoint_max_bytes,
        dir_max_bytes=settings.checkpoint_dir_max_bytes,
    )
    app.state.metrics = metrics
    app.state.principal_cache = PrincipalCache(settings.peer_auth_cache_ttl_s)
    app.state.live_hub = LiveHub(settings.live_interval_s)
    app.state.dashboard_cache = DocumentCache(settings.dashboard_cache_s)
    app.state.report_guard = ReportGuard(
        session_factory,
        ReportLimits(settings.report_max_samples_per_second, settings.report_max_epoch_lead),
        credit=CreditLimits(
            settings.report_rate_multiple,
            settings.report_rate_floor,
            settings.report_max_samples_per_second,
        ),
        refresh_s=settings.report_swarm_refresh_s,
        online_ttl_s=settings.peer_online_ttl_s,
    )

    # Routes are matched in order: the report route, by far the most called, goes first.
    app.include_router(peers.reports_router)
    app.include_router(peers.join_router)
    app.include_router(tokens.organizer_router)
    for module in (runs, tokens, peers, checkpoints, progress, dashboard, health):
        app.include_router(module.router)
    web.install(app)

    @app.exception_handler(CoordinatorError)
    async def coordinator_error(_: Request, exc: CoordinatorError) -> JSONResponse:
        return JSONResponse(
            {"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        # The input is not echoed back: it may hold NaN (not JSON) or a secret.
        detail = [
            {"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}
            for error in exc.errors()
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    async def database_error(request: Request, exc: Exception) -> JSONResponse:
        if not database_unavailable(exc):  # a statement's own failure: a bug
            return await internal_error(request, exc)
        logger.error("database unavailable: %s", getattr(exc, "orig", None) or exc)
        return JSONResponse(
            {"detail": "the coordinator's database is unavailable; try again shortly"},
            status_code=503,
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        # Starlette answers this one from its outermost layer, outside CoordinatorHeader.
        return JSONResponse(
            {"detail": "internal error; the coordinator's log has the details"},
            status_code=500,
            headers={COORDINATOR_HEADER[0].decode(): COORDINATOR_HEADER[1].decode()},
        )

    # Lost connections, a full disk, a read-only file, a pool with no connection free.
    app.add_exception_handler(DBAPIError, database_error)
    app.add_exception_handler(PoolTimeout, database_error)

    # Our own limit rather than FastAPI's max_body_size: that one answers in plain text.
    # Checkpoint uploads are larger and enforce their own limit while they stream.
    app.add_middleware(ReportFastPath)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES, exempt=checkpoints.is_upload)
    if settings.rate_limits:  # before the body is read, after the client is known
        app.add_middleware(
            RateLimitMiddleware, limiter=limiter_from_settings(settings), metrics=metrics
        )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    # The client address (rate limits, reachability probes): the socket's peer, or what
    # X-Forwarded-For says when that peer is a trusted proxy (rightmost untrusted entry).
    if settings.trusted_proxies:
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=list(settings.trusted_proxies))
    app.add_middleware(CoordinatorHeader)  # added last: the outermost, so on every answer
    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory``: settings from the environment."""
    return create_app(Settings())


class CoordinatorHeader:
    """Adds ``X-Swarmgrad-Coordinator: 1`` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), COORDINATOR_HEADER]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413 before they are read into memory,
    except for requests ``exempt(scope)`` accepts (they enforce a limit of their own)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        exempt: Callable[[Scope], bool] = lambda scope: False,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt(scope):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._too_large(send)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        response = JSONResponse(
            {"detail": f"request body over {self.max_bytes} bytes"}, status_code=413
        )
        await response({"type": "http"}, _no_receive, send)


class _BodyTooLarge(Exception):
    pass


async def _no_receive() -> Message:  # pragma: no cover - never called for a plain response
    return {"type": "http.disconnect"}
