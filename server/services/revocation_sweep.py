"""What the database revoked, taken out of a worker's cache of verified peer tokens.

The report path reuses a verified peer token for up to ``peer_auth_cache_ttl_s``
(:class:`~server.security.PrincipalCache`). Every ``peer_auth_recheck_s`` each worker asks
the database what changed since it last looked (tokens revoked, runs finished or archived)
and forgets those tokens, so a revocation takes effect within seconds. Expiry needs no
sweep: a token is never kept past it.

The first report of a run that a worker cannot answer from its cache starts
:meth:`TokenCache.warm`: one query reads the run's active peer tokens (stored hashes) with
their peers' tracks, so a fresh worker does not verify thousands of tokens one by one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from server.models import Peer, Run, RunStatus, Token, TokenScope, utcnow
from server.security import PrincipalCache
from server.services.report_bounds import PeerTrack
from server.services.tokens import Principal

logger = logging.getLogger(__name__)

# Looked back this much further than the last sweep: for clocks of several coordinator
# hosts that disagree a little, and a transaction that commits a revocation stamped before
# the sweep read.
OVERLAP = timedelta(seconds=60)


class RevocationSweep:
    def __init__(
        self,
        cache: PrincipalCache,
        session_factory: sessionmaker[Session],
        interval_s: float,
        rewarm_s: float = 300.0,
    ) -> None:
        """``rewarm_s``: how long after a warm-up a run's uncached report starts another
        (the cache's entries expire; half its TTL suits)."""
        self._cache = cache
        self._session_factory = session_factory
        self._interval = interval_s
        self._since: datetime = utcnow() - OVERLAP
        self._task: asyncio.Task[None] | None = None
        self._warming: dict[str, asyncio.Task[int]] = {}
        self._warmed: dict[str, float] = {}  # run id -> when (monotonic)
        self._rewarm_s = rewarm_s

    def warm_soon(self, run_id: str, remember: Callable[[int, PeerTrack], None]) -> None:
        """Start :meth:`warm` for ``run_id`` unless it ran or runs (on the event loop)."""
        warmed = self._warmed.get(run_id)
        if run_id in self._warming or (
            warmed is not None and time.monotonic() - warmed < self._rewarm_s
        ):
            return
        task = asyncio.create_task(self.warm(run_id, remember), name=f"token-warmup-{run_id}")
        self._warming[run_id] = task

    async def warmed(self) -> None:
        """Wait for the warm-ups in flight (on the event loop)."""
        await asyncio.gather(*list(self._warming.values()), return_exceptions=True)

    async def warm(self, run_id: str, remember: Callable[[int, PeerTrack], None]) -> int:
        """Cache every active peer token of a running run, and give each peer's track to
        ``remember``; how many (0 if the run is finished, archived or unknown)."""
        try:
            rows = await asyncio.to_thread(self._read_run_tokens, run_id)
        except Exception as error:  # tried again at the run's next uncached report
            logger.warning("cannot read the peer tokens of run %s: %s", run_id, error)
            self._warming.pop(run_id, None)
            return 0
        now = utcnow()
        for token_id, secret_hash, expires_at, peer_pk, track in rows:
            left = None if expires_at is None else (expires_at - now).total_seconds()
            if left is not None and left <= 0:
                continue
            principal = Principal(TokenScope.peer, token_id, run_id, peer_pk)
            self._cache.put_verified(
                token_id, secret_hash, principal, run_id=run_id, expires_in_s=left
            )
            remember(peer_pk, track)
        self._warmed[run_id] = time.monotonic()
        self._warming.pop(run_id, None)
        return len(rows)

    def _read_run_tokens(
        self, run_id: str
    ) -> list[tuple[str, bytes, datetime | None, int, PeerTrack]]:
        now = utcnow()
        with self._session_factory() as session:
            run = session.get(Run, run_id)
            if run is None or run.archived_at is not None or run.status is RunStatus.finished:
                return []
            rows = session.execute(
                select(
                    Token.id,
                    Token.secret_hash,
                    Token.expires_at,
                    Peer.id,
                    Peer.first_seen_ms,
                    Peer.volunteer_id,
                    Peer.samples_base,
                    Peer.samples,
                    Peer.last_report_ms,
                )
                .join(Peer, Peer.id == Token.peer_id)
                .where(
                    Token.run_id == run_id,
                    Token.scope == TokenScope.peer,
                    Token.revoked_at.is_(None),
                    or_(Token.expires_at.is_(None), Token.expires_at > now),
                    or_(Token.max_uses.is_(None), Token.uses < Token.max_uses),
                    Peer.run_id == run_id,
                )
            ).all()
        return [
            (
                str(r[0]),
                bytes(r[1]),
                r[2],
                int(r[3]),
                PeerTrack(
                    first_seen_ms=int(r[4]),
                    volunteer_id=int(r[5]),
                    banked=int(r[6]),
                    samples=int(r[7]),
                    as_of_ms=None if r[8] is None else int(r[8]),
                ),
            )
            for r in rows
        ]

    def sweep_once(self) -> int:
        """Forget the cached tokens revoked, and those of runs finished or archived, since
        the last sweep (blocking: run it in a thread); how many were forgotten."""
        started = utcnow()
        with self._session_factory() as session:
            revoked = session.scalars(select(Token.id).where(Token.revoked_at >= self._since)).all()
            ended = session.scalars(
                select(Run.id).where(
                    Run.updated_at >= self._since,
                    or_(Run.status == RunStatus.finished, Run.archived_at.is_not(None)),
                )
            ).all()
        forgotten = self._cache.evict(revoked) + sum(self._cache.evict_run(r) for r in ended)
        for run_id in ended:
            self._warmed.pop(run_id, None)
        self._since = started - OVERLAP
        return forgotten

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await asyncio.to_thread(self.sweep_once)
            except Exception as error:  # the database is away: the cache's TTL still holds
                logger.warning("cannot read revocations: %s", error)

    async def __aenter__(self) -> RevocationSweep:
        self._task = asyncio.create_task(self._run(), name="revocation-sweep")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in list(self._warming.values()):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
