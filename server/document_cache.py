"""Documents many readers ask for, built at most once per ``max_age_s`` in each worker.

A run's dashboard data takes tens of milliseconds of SQL at thousands of volunteers; API
clients polling it (a status page, a bot, a few hundred browsers without WebSockets) would
each pay that. :class:`DocumentCache` keeps each document's serialised form per key:

* younger than ``max_age_s``: served as it is;
* while a key is being read, one background thread per key rebuilds it every ``max_age_s``
  and goes on until nobody has read it for ``keep_warm_s``: steady readers, at any pace up to
  that, never wait for a build, and get a document at most ``max_age_s`` plus one build old;
* older than ``max_age_s`` but not older than twice it, with no thread keeping it warm: served
  as it is while such a thread starts;
* older still, or never built: the reader builds it (concurrent readers of the same key wait
  for that one build rather than each starting their own), and the key is kept warm after.

Builds open their own database session (a background build outlives the request that started
it). ``max_age_s = 0`` turns the cache off: every reader builds. The number of keys is bounded
(least recently read dropped first), so varied query strings cannot grow it without end.
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

# How long a key is rebuilt in the background after its last read.
KEEP_WARM_S = 10.0


@dataclass
class _Entry:
    build: Build
    value: str | None = None
    built_at: float = 0.0
    read_at: float = 0.0
    building: bool = False  # a reader builds it now
    warm: bool = False  # a thread keeps it fresh
    dropped: bool = False
    ready: threading.Condition = field(default_factory=threading.Condition)


class DocumentCache:
    def __init__(
        self,
        max_age_s: float,
        *,
        keep_warm_s: float = KEEP_WARM_S,
        max_entries: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_age_s < 0 or keep_warm_s < 0 or max_entries < 1:
            raise ValueError("max_age_s >= 0, keep_warm_s >= 0 and max_entries >= 1")
        self.max_age_s = max_age_s
        self.keep_warm_s = keep_warm_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0  # for tests and benchmarks

    def __len__(self) -> int:
        return len(self._entries)

    def warm(self, key: Hashable) -> bool:
        """Whether a background thread keeps ``key`` fresh now."""
        entry = self._entries.get(key)
        return entry is not None and entry.warm

    def get(self, key: Hashable, build: Build) -> str:
        """The document for ``key``, built by ``build`` when none is fresh enough."""
        if self.max_age_s <= 0:
            self.builds += 1
            return build()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(build)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)[1].dropped = True
            else:
                self._entries.move_to_end(key)
        with entry.ready:
            now = self.clock()
            entry.read_at = now
            entry.build = build  # the newest reader's (its settings are the same)
            age = now - entry.built_at
            if entry.value is not None and (age <= self.max_age_s or entry.warm):
                return entry.value
            if entry.value is not None and age <= 2 * self.max_age_s:
                self._keep_warm(entry, build_first=True)
                return entry.value
            while entry.building:  # another reader builds it: wait for that one
                entry.ready.wait()
                if entry.value is not None and self.clock() - entry.built_at <= self.max_age_s:
                    return entry.value
            entry.building = True
        try:
            value = build()
        except BaseException:
            with entry.ready:
                entry.building = False
                entry.ready.notify_all()
            raise
        with entry.ready:
            self._store(entry, value)
            entry.building = False
            entry.ready.notify_all()
            self._keep_warm(entry, build_first=False)
        return value

    def _store(self, entry: _Entry, value: str) -> None:
        self.builds += 1
        entry.value = value
        entry.built_at = self.clock()

    def _keep_warm(self, entry: _Entry, *, build_first: bool) -> None:
        """Start the thread that rebuilds ``entry`` while it is read (``entry.ready`` held)."""
        if entry.warm or self.keep_warm_s <= 0:
            return
        entry.warm = True
        threading.Thread(
            target=self._warm_loop, args=(entry, build_first), name="document-cache", daemon=True
        ).start()

    def _warm_loop(self, entry: _Entry, build_first: bool) -> None:
        try:
            while True:
                if not build_first:
                    with entry.ready:
                        pause = entry.built_at + self.max_age_s - self.clock()
                    if pause > 0:
                        time.sleep(pause)
                build_first = False
                with entry.ready:
                    if entry.dropped or self.clock() - entry.read_at > self.keep_warm_s:
                        return
                    build = entry.build
                try:
                    value = build()
                except Exception:
                    logger.warning("rebuilding a cached document failed", exc_info=True)
                    return  # the next reader tries again (and builds itself if it is too old)
                with entry.ready:
                    self._store(entry, value)
        finally:
            with entry.ready:
                entry.warm = False
