"""A volunteer's data directory: its identity key, and the lock that makes it one volunteer.

The key makes a restart the same peer. Two processes that join with one key are one peer to
the coordinator, and each join takes the place of the other (the coordinator keeps one peer
token per peer), so a second process on the same directory is refused at once:
:func:`lock_data_dir` takes an OS lock on ``volunteer.lock`` in the directory for as long
as the process holds it. The OS drops the lock when the process ends, however it ends, so a
volunteer that crashed never blocks its restart.

Several volunteers may start at once on a fresh machine: creating the directory and the key
is safe under concurrency. Every process that finds no key writes its own to a private
temporary file and links it into place; the link fails when another process was first, and
then the key on disk (the winner's) is the one loaded. Every caller ends with the same key.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
from pathlib import Path
from typing import IO

from peer.exceptions import SwarmgradError
from peer.formats.identity import Identity

__all__ = [
    "IDENTITY_FILE",
    "LOCK_FILE",
    "DataDirInUse",
    "DataDirLock",
    "default_data_dir",
    "load_identity",
    "lock_data_dir",
]

IDENTITY_FILE = "identity.key"
LOCK_FILE = "volunteer.lock"


class DataDirInUse(SwarmgradError):
    """Another process holds this data directory (and so this volunteer's key)."""


def default_data_dir() -> Path:
    """Where a volunteer keeps its identity key: ``$XDG_DATA_HOME/swarmgrad``, else
    ``~/.local/share/swarmgrad``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "swarmgrad"


def _cannot_keep(directory: Path, exc: OSError) -> SwarmgradError:
    return SwarmgradError(
        f"cannot keep this volunteer's key in {directory}: {exc.strerror or exc}; "
        "pass --data-dir with a writable directory"
    )


def load_identity(data_dir: Path) -> Identity:
    """The identity kept in ``data_dir``; created (the directory too, the key in a file only
    its owner reads) on first use. Safe when several processes call it at once on a fresh
    directory: all of them return the same identity, the one that reached the disk first."""
    directory = Path(data_dir)
    path = directory / IDENTITY_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        try:
            raw = _create_key(directory, path)
        except OSError as exc:
            raise _cannot_keep(directory, exc) from exc
    except OSError as exc:
        raise SwarmgradError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return Identity.from_private_bytes(raw)
    except ValueError as exc:
        raise SwarmgradError(
            f"{path} is not a swarmgrad identity key; move it away to start as a new peer"
        ) from exc


def _create_key(directory: Path, path: Path) -> bytes:
    """Write a new key to ``path`` unless another process does first; the key now there."""
    directory.mkdir(parents=True, exist_ok=True)
    data = Identity().private_bytes()
    # a name of this process's own (mkstemp: created exclusively, readable by its owner only)
    fd, temp = tempfile.mkstemp(prefix=f".{IDENTITY_FILE}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        try:
            # unlike a rename, a link never replaces: whoever links first wins, whole
            os.link(temp, path)
        except FileExistsError:
            return path.read_bytes()
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            return _create_key_without_links(path, data)
        _sync_directory(directory)
        return data
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _create_key_without_links(path: Path, data: bytes) -> bytes:
    """For file systems without hard links: create ``path`` exclusively, in one write."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return data


def _sync_directory(directory: Path) -> None:
    """Make the new name durable (a crash right after must not lose the key)."""
    if sys.platform == "win32":
        return
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class DataDirLock:
    """This process's hold on a data directory; :meth:`release` (or leaving the ``with``
    block) lets another process take it. The OS releases it too when the process ends."""

    def __init__(self, directory: Path, file: IO[bytes]) -> None:
        self.directory = directory
        self._file: IO[bytes] | None = file

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        """Idempotent."""
        file, self._file = self._file, None
        if file is None:
            return
        with contextlib.suppress(OSError):
            file.truncate(0)  # no process holds it now
        _unlock(file)
        file.close()

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_data_dir(data_dir: Path) -> DataDirLock:
    """Hold ``data_dir`` (created if missing) for this process, or raise
    :class:`DataDirInUse` at once, with the reason and the fix, if another process holds
    it. Where the file system has no locks (some network file systems) nothing is held."""
    directory = Path(data_dir)
    path = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        file = open(path, "a+b")  # noqa: SIM115 (held open for as long as the lock)
    except OSError as exc:
        raise _cannot_keep(directory, exc) from exc
    try:
        _lock(file)
    except BlockingIOError:
        holder = ""
        with contextlib.suppress(OSError):
            file.seek(0)
            holder = file.read(32).decode("ascii", "replace").strip()
        file.close()
        process = f" (process {holder})" if holder.isdigit() else ""
        raise DataDirInUse(
            f"another swarmgrad volunteer{process} is running with the key in {directory}, "
            "and two processes with one key would take each other's place in the run; "
            "to run a second volunteer on this machine, give it a directory of its own "
            "with --data-dir"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            file.close()
            raise _cannot_keep(directory, exc) from exc
        # no locks on this file system: run unguarded rather than not at all
    with contextlib.suppress(OSError):  # who holds it, for the message of the next one
        file.truncate(0)
        file.write(f"{os.getpid()}\n".encode())
        file.flush()
    return DataDirLock(directory, file)


if sys.platform == "win32":
    import msvcrt

    def _lock(file: IO[bytes]) -> None:
        file.seek(0)
        try:
            msvcrt.locking(file.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError as exc:
            raise BlockingIOError(*exc.args) from exc

    def _unlock(file: IO[bytes]) -> None:
        with contextlib.suppress(OSError):
            file.seek(0)
            msvcrt.locking(file.fileno(), msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _lock(file: IO[bytes]) -> None:
        # flock: held by this open file, so even a second lock from this same process fails
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(file: IO[bytes]) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)
