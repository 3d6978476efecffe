"""Shared test settings.

``SWARMGRAD_TEST_TIME_SCALE`` stretches every bounded wait in the tests (e.g. 3 on a slow
machine); it is the one timing knob, instead of sleeps sprinkled with magic numbers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TIME_SCALE = float(os.environ.get("SWARMGRAD_TEST_TIME_SCALE", "1"))


# A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored
# across exec: run that way (`make test &`, some CI runners), every process a test starts
# would ignore the Ctrl-C the tests send it. Python's own handler here makes children start
# with the default disposition, as they do from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def scaled(seconds: float) -> float:
    return seconds * TIME_SCALE


# Set in the environment of a process a test starts; every process it starts inherits it.
MARKER_VARIABLE = "SWARMGRAD_TEST_PROCESS_MARKER"


def marked_processes(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``MARKER_VARIABLE=marker``:
    how a test proves that a command left nothing behind."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone, or not ours
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """An ASGI app served by uvicorn on a loopback port, in a thread (its lifespan runs);
    yields its URL. The socket is bound before uvicorn starts, so no other process can take
    the port in between."""
    import uvicorn

    from swarmlab.node_process import wait_until

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    try:
        assert wait_until(lambda: server.started or not thread.is_alive(), scaled(60))
        assert server.started, "the app did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(scaled(30))
        sock.close()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each module of multi-process scenarios (``slow``) is one xdist group: under ``make
    test``'s ``--dist loadgroup`` its scenarios run in turn on one worker, its session
    fixtures are built once, and the groups (largest first) go out before the quick tests,
    which then fill both workers. Those that time something (``alone``) run by themselves
    in a pass of their own."""
    if not config.pluginmanager.hasplugin("xdist"):
        return  # run without xdist (-p no:xdist): nothing to schedule
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("alone"):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse to run when xdist ignored the groups (it writes them into the node ids; some
    pytest releases stop that silently), rather than run the scenarios unscheduled."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [
        i.nodeid
        for i in session.items
        if i.get_closest_marker("xdist_group") and "@" not in i.nodeid
    ]
    if lost:
        why = (
            f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}): check the "
            "pytest and pytest-xdist versions pinned in pyproject.toml"
        )
        print(why, file=sys.__stderr__)  # a worker's exit message does not reach the terminal
        pytest.exit(why, returncode=pytest.ExitCode.USAGE_ERROR)
