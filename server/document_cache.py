"""Documents many readers ask for, built at most once per ``max_age_s`` in each worker.

:class:`DocumentCache` keeps each document's serialised form per key, so that API clients
polling a run's dashboard data do not each pay its SQL:

* younger than ``max_age_s``: served as it is;
* younger than ``max_stale_s``: served as it is while one background thread builds the next
  (stale-while-revalidate);
* older, or never built: the reader builds it; concurrent readers of that key wait for
  that one build.

A build starts only on a read, at most one per key at a time, and opens its own database
session. ``max_age_s = 0`` turns the cache off. The number of keys is bounded (least
recently read dropped first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

Build = Callable[[], str]

#: ``max_stale_s`` by default, in multiples of ``max_age_s``: how old a document may be and
#: still be served while the next one is built
STALE_FACTOR = 5.0


@dataclass
class _Entry:
    value: str | None = None
    built_at: float = 0.0
    building: bool = False
    ready: threading.Condition = field(default_factory=threading.Condition)


class DocumentCache:
    def __init__(
        self,
        max_age_s: float,
        *,
        max_stale_s: float | None = None,
        max_entries: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_age_s < 0 or max_entries < 1:
            raise ValueError("max_age_s >= 0 and max_entries >= 1")
        self.max_age_s = max_age_s
        stale = STALE_FACTOR * max_age_s if max_stale_s is None else max_stale_s
        self.max_stale_s = max(max_age_s, stale)
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def building(self, key: Hashable) -> bool:
        """Whether a document for ``key`` is being built now."""
        entry = self._entries.get(key)
        return entry is not None and entry.building

    def get(self, key: Hashable, build: Build) -> str:
        """The document for ``key``, built by ``build`` when none is fresh enough."""
        if self.max_age_s <= 0:
            return build()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
        with entry.ready:
            age = self.clock() - entry.built_at
            if entry.value is not None and age <= self.max_age_s:
                return entry.value
            if entry.value is not None and age <= self.max_stale_s:
                if not entry.building:
                    entry.building = True
                    threading.Thread(
                        target=self._build_behind,
                        args=(entry, build),
                        name="document-cache",
                        daemon=True,
                    ).start()
                return entry.value
            while entry.building:  # another reader builds it: wait for that one
                entry.ready.wait()
                if entry.value is not None and self.clock() - entry.built_at <= self.max_stale_s:
                    return entry.value
            entry.building = True
        try:
            value = build()
        except BaseException:
            self._done(entry, None)
            raise
        self._done(entry, value)
        return value

    def _build_behind(self, entry: _Entry, build: Build) -> None:
        try:
            value = build()
        except Exception:
            logger.warning("rebuilding a cached document failed", exc_info=True)
            self._done(entry, None)  # the next reader tries again (or builds, if too old)
            return
        self._done(entry, value)

    def _done(self, entry: _Entry, value: str | None) -> None:
        with entry.ready:
            if value is not None:
                entry.value = value
                entry.built_at = self.clock()
            entry.building = False
            entry.ready.notify_all()
