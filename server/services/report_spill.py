"""The spill: reports acknowledged while the database could not take them, on disk.

Each worker process appends to a segment of its own, ``<directory>/<host>-<pid>-<ns>.jsonl``:
one JSON object per line, written whole, flushed and ``fsync``'d before the write returns (so
before the flush that spilled them is over). The writer holds an exclusive ``flock`` on its
segment while it lives; a segment nobody holds belongs to a worker that is gone, and the next
worker to replay takes it over. Which lines of a segment are already in the database is
recorded in the database itself (``spilled_segments``, advanced in the same transaction as
the rows: see :mod:`server.services.report_buffer`), so a line is written exactly once even
if the process dies between the commit and the file's removal.

No database access here: this module only stores, lists, reads and removes segments.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from server.services.reports import PendingReport

logger = logging.getLogger(__name__)

SUFFIX = ".jsonl"


class ReportSpill:
    """One worker's view of the spill directory. Not thread-safe: the report buffer uses it
    from one flush at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._own: tuple[str, IO[bytes]] | None = None
        self._taken: dict[str, IO[bytes]] = {}  # orphans this worker holds the lock of

    def append(self, reports: Sequence[PendingReport]) -> None:
        """Store ``reports`` durably; ``OSError`` if the disk refuses (nothing then stays
        half-written in the segment)."""
        if not reports:
            return
        _, file = self._own if self._own is not None else self._open()
        data = b"".join(
            json.dumps(dataclasses.asdict(r), separators=(",", ":")).encode() + b"\n"
            for r in reports
        )
        offset = file.tell()
        try:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        except OSError:
            try:  # cut the partial line, so the next append starts a line of its own
                file.truncate(offset)
                file.seek(offset)
            except OSError:
                self._own = None
                file.close()
            raise

    def segments(self) -> list[str]:
        """Segments to replay, oldest first: this worker's own and those no live worker
        holds (taken over: locked until :meth:`remove` or :meth:`close`)."""
        if not self.directory.is_dir():
            return []
        names = []
        own = None if self._own is None else self._own[0]
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            name = path.name.removesuffix(SUFFIX)
            if name == own or name in self._taken or self._take(path, name):
                names.append(name)
        return names

    def read(self, name: str) -> list[PendingReport | None]:
        """The segment's complete lines, in order; None for a line that is not a report
        (logged). A partial last line — a write cut short — is not a line yet."""
        data = (self.directory / f"{name}{SUFFIX}").read_bytes()
        lines = data.split(b"\n")[:-1]
        reports: list[PendingReport | None] = []
        for number, line in enumerate(lines):
            try:
                reports.append(PendingReport(**json.loads(line)))
            except (ValueError, TypeError):
                logger.error("spill segment %s line %d is not a report; skipped", name, number)
                reports.append(None)
        return reports

    def remove(self, name: str) -> None:
        """Delete a segment whose every line is in the database."""
        (self.directory / f"{name}{SUFFIX}").unlink(missing_ok=True)
        if self._own is not None and self._own[0] == name:
            self._own[1].close()
            self._own = None
        taken = self._taken.pop(name, None)
        if taken is not None:
            taken.close()

    def close(self) -> None:
        """Release every segment (what is left in them is replayed by the next worker)."""
        if self._own is not None:
            self._own[1].close()
            self._own = None
        for file in self._taken.values():
            file.close()
        self._taken.clear()

    def _open(self) -> tuple[str, IO[bytes]]:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        file = open(self.directory / f"{name}{SUFFIX}", "ab")  # noqa: SIM115 - kept open
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The new name must survive a crash too.
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._own = (name, file)
        return self._own

    def _take(self, path: Path, name: str) -> bool:
        try:
            file = open(path, "rb")  # noqa: SIM115 - kept open while taken
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live worker's
            file.close()
            return False
        self._taken[name] = file
        return True
