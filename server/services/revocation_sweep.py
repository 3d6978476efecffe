"""What the database revoked, taken out of a worker's cache of verified peer tokens.

The report path reuses a peer token it verified for up to ``peer_auth_cache_ttl_s`` (a
:class:`~server.security.PrincipalCache` per worker): at 10,000 volunteers reporting every
10 s, verifying each token in the database every 30 s sent most reports down the slow path.
So the cache keeps verified tokens long, and every ``peer_auth_recheck_s`` each worker asks
the database what changed since it last looked — tokens revoked (a volunteer's ban, an
organizer's revocation) and runs finished or archived — and forgets those tokens. Two
indexed queries that return nothing most of the time: revocation takes effect on reports
within ``peer_auth_recheck_s`` (a few seconds) instead of within the cache's lifetime.

Expiry needs no sweep: a token is never kept past its own expiry.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from server.models import Run, RunStatus, Token, utcnow
from server.security import PrincipalCache

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
    ) -> None:
        self._cache = cache
        self._session_factory = session_factory
        self._interval = interval_s
        self._since: datetime = utcnow() - OVERLAP
        self._task: asyncio.Task[None] | None = None

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
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
