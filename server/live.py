"""Live updates for open pages: one feed per watched view, fanned out to its WebSockets.

Each worker process has a :class:`LiveHub`. A feed (the runs list, or one run's dashboard)
exists while at least one of this worker's WebSockets watches it (:meth:`LiveHub.subscribe`):
a task that builds the view's document from the database every ``interval_s`` and, when its
``version`` changed, hands it to every subscriber. Every worker reads what it shows from the
database, so nothing is shared between workers.

A feed costs one build per interval whatever the number of browsers, and at most
``MAX_BUILD_SHARE`` of the worker's time (a slow build is repeated less often).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable, Mapping

logger = logging.getLogger(__name__)

# A view's document: the hub reads only its ``version`` and hands it on as it is.
Document = Mapping[str, object]
Build = Callable[[], Document | None]  # the document, or None: the view is gone

# The most of a worker's time one feed spends building documents.
MAX_BUILD_SHARE = 0.25


def pause_s(interval_s: float, build_s: float, share: float = MAX_BUILD_SHARE) -> float:
    """How long a feed waits after a build that took ``build_s`` before the next one:
    ``interval_s``, or longer when building that often would take more than ``share`` of
    the worker's time."""
    return max(interval_s, build_s * (1 - share) / share)


class _Feed:
    def __init__(self, build: Build, interval_s: float) -> None:
        self.build = build
        self.interval_s = interval_s
        self.subscribers: set[asyncio.Queue[Document | None]] = set()
        self.latest: Document | None = None
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        version = None
        while self.subscribers:
            started = time.perf_counter()
            try:
                document = await asyncio.to_thread(self.build)
            except Exception:
                logger.warning("building a live document failed; retrying", exc_info=True)
                document = self.latest
            if document is None:  # the run is gone: tell everyone, stop
                for queue in self.subscribers:
                    queue.put_nowait(None)
                return
            if document.get("version") != version:
                version = document.get("version")
                self.latest = document
                for queue in self.subscribers:
                    _offer(queue, document)
            await asyncio.sleep(pause_s(self.interval_s, time.perf_counter() - started))


def _offer(queue: asyncio.Queue[Document | None], document: Document) -> None:
    """Newest wins: a slow browser skips documents rather than queueing them."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(document)


class LiveHub:
    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self._feeds: dict[Hashable, _Feed] = {}

    @contextlib.asynccontextmanager
    async def subscribe(
        self, key: Hashable, build: Build
    ) -> AsyncIterator[asyncio.Queue[Document | None]]:
        """A queue of documents for view ``key`` (``build`` makes one), the current one first;
        ``None`` in the queue means the view is gone."""
        feed = self._feeds.get(key)
        if feed is None:
            feed = self._feeds[key] = _Feed(build, self.interval_s)
        queue: asyncio.Queue[Document | None] = asyncio.Queue(maxsize=1)
        feed.subscribers.add(queue)
        if feed.latest is not None:
            _offer(queue, feed.latest)
        if feed.task is None or feed.task.done():
            feed.task = asyncio.create_task(feed.run(), name=f"live-feed-{key}")
        try:
            yield queue
        finally:
            feed.subscribers.discard(queue)
            if not feed.subscribers:
                self._feeds.pop(key, None)
                if feed.task is not None:
                    feed.task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await feed.task

    @property
    def feeds(self) -> int:
        return len(self._feeds)

    async def close(self) -> None:
        for feed in list(self._feeds.values()):
            if feed.task is not None:
                feed.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feed.task
        self._feeds.clear()
