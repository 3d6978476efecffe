"""A coordinator and volunteers as child processes on this machine, for ``swarmgrad demo`` and
for tests that run the system as people do.

- :class:`LocalCoordinator` runs ``swarmgrad coordinator`` in production mode with fresh
  secrets, its SQLite database and checkpoints in one directory; it can be stopped, killed
  and started again on the same port and database.
- :func:`start_volunteer` runs ``swarmgrad join URL --token T --data-dir D ...``.

Children never outlive their parent: each runs in its own process group, which
:func:`stop_process` stops (SIGTERM, SIGKILL after a grace period), and on Linux gets SIGKILL
when the *thread* that started it exits (``PR_SET_PDEATHSIG``): start children from a thread
that lives as long as they should (the main thread, typically).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, TypeAlias, overload

import httpx

import swarmgrad
from peer.coordinator.connection import COORDINATOR_HEADER
from swarmgrad.errors import CommandError

# How long a coordinator may take to answer /healthz after its start (migrations included).
STARTUP_TIMEOUT_S = 60.0
# How long a child gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (another process may take it before you do)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _death_signal_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies; None where the
    platform has no ``prctl``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request: nobody to follow
            os._exit(1)

    return set_death_signal


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child running ``python -m swarmgrad``: the same
    ``swarmgrad`` and ``peer`` found first, output not buffered, plus ``extra``."""
    env = dict(os.environ)
    root = str(Path(swarmgrad.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# A child process, its pipes in text or in binary mode.
Process: TypeAlias = subprocess.Popen[str] | subprocess.Popen[bytes]
# Where a child's standard stream goes: subprocess.PIPE, DEVNULL, STDOUT, a file, or inherited.
Stream: TypeAlias = int | IO[str] | IO[bytes] | None


@overload
def spawn(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
    text: Literal[False] = False,
) -> subprocess.Popen[bytes]: ...


@overload
def spawn(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
    text: Literal[True],
) -> subprocess.Popen[str]: ...


def spawn(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
    text: bool = False,
) -> Process:
    """``subprocess.Popen(args)`` in a new session (its own process group), killed by the
    kernel if this process dies (Linux)."""
    return subprocess.Popen(
        list(args),
        start_new_session=True,
        preexec_fn=_death_signal_setter(),
        env=env,
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=text,
    )


def _signal_group(process: Process, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def stop_process(process: Process, grace: float = STOP_GRACE_S) -> int:
    """Stop ``process`` and its process group: SIGTERM, SIGKILL after ``grace`` seconds (at
    once on a KeyboardInterrupt while waiting). Returns the exit status."""
    stop_processes([process], grace)
    return process.returncode


def stop_processes(processes: Sequence[Process], grace: float = STOP_GRACE_S) -> None:
    """:func:`stop_process` for several at once: all get SIGTERM, then one shared grace."""
    for process in processes:
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
    finally:  # also on a second Ctrl-C while waiting: nothing is left behind
        for process in processes:
            # The group too: whatever the child started dies with it.
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _tail(path: Path, lines: int = 1) -> str:
    """The last non-empty ``lines`` of a log file, joined by " | "."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    found = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(found[-lines:])


class LocalCoordinator:
    """``swarmgrad coordinator`` as a child process, state in ``directory``.

    ``start()`` returns once ``/healthz`` answers; ``stop()`` (SIGTERM) and ``kill()``
    (SIGKILL) end it; ``start()`` again serves the same database on the same port. Use it as
    a context manager to start and stop it. ``url`` and ``admin_token`` (an organizer token
    accepted through ``SWARMGRAD_ADMIN_TOKEN``) stay the same across restarts.
    """

    def __init__(
        self,
        directory: Path,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.directory = Path(directory)
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.admin_token = secrets.token_urlsafe(32)
        self.log_path = self.directory / "coordinator.log"
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._env = {
            # None of the caller's coordinator settings (a production database URL!) leak in.
            **{k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")},
            "SWARMGRAD_ENVIRONMENT": "production",
            "SWARMGRAD_SECRET_KEY": secrets.token_urlsafe(48),
            "SWARMGRAD_ADMIN_TOKEN": self.admin_token,
            "SWARMGRAD_DATABASE_URL": f"sqlite:///{self.directory.resolve() / 'coordinator.db'}",
            "SWARMGRAD_CHECKPOINT_DIR": str(self.directory.resolve() / "checkpoints"),
            "SWARMGRAD_PUBLIC_URL": self.url,
            **(env or {}),
        }

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the coordinator and wait until it answers; :class:`CommandError` (with the
        last line of its log) if it exits or stays silent first."""
        if self.running:
            raise RuntimeError("the coordinator is running already")
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "swarmgrad", "coordinator", "--host", self.host]
        args += ["--port", str(self.port), "--log-level", "warning"]
        with open(self.log_path, "ab") as log:
            self.process = spawn(
                args,
                env=child_environment(self._env),
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_until_healthy(self) -> None:
        process = self.process
        assert process is not None
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as http:
            while True:
                code = process.poll()
                if code is not None:
                    raise CommandError(
                        f"the coordinator exited (status {code}) before it answered: "
                        f"{_tail(self.log_path) or 'no output'}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    answer = http.get(f"{self.url}/healthz")
                    # Ours, not another server that took the port first.
                    if answer.status_code == 200 and answer.headers.get(COORDINATOR_HEADER):
                        return
                if time.monotonic() > deadline:
                    raise CommandError(
                        f"the coordinator did not answer on {self.url} within "
                        f"{self.startup_timeout:.0f} s (log: {self.log_path})"
                    )
                time.sleep(0.1)  # readiness poll: the process says nothing when it is ready

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM (a clean shutdown), SIGKILL after ``grace`` seconds. Idempotent."""
        if self.process is not None:
            stop_process(self.process, grace)

    def kill(self) -> None:
        """SIGKILL: the coordinator vanishes as in a crash (nothing flushed)."""
        self.stop(grace=0.0)

    def restart(self) -> None:
        """Stop, then start again on the same port and database."""
        self.stop()
        self.start()

    def log(self) -> str:
        """Everything the coordinator printed so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> LocalCoordinator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_volunteer(
    url: str,
    token: str,
    data_dir: Path,
    *extra_args: str,
    stdout: Stream = subprocess.PIPE,
    stderr: Stream = subprocess.STDOUT,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[str]:
    """``swarmgrad join URL --token T --data-dir D *extra_args`` as a child process (text
    mode; by default its stdout and stderr together in ``process.stdout``). Stop it with
    SIGINT/SIGTERM (it leaves the swarm cleanly) or :func:`stop_process`."""
    args = [sys.executable, "-m", "swarmgrad", "join", url, "--token", token]
    args += ["--data-dir", str(data_dir), *extra_args]
    return spawn(
        args,
        env=child_environment(env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )
