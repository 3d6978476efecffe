"""Running ``collab_worker.py`` peers as processes, for the collaborative optimizer's tests.

Each worker prints its addresses as a first JSON line, then ``{"epoch": n}`` as it reaches
each epoch, on stdout; its log goes to ``rank<r>.log`` beside its results (a file, not a
pipe: a test that waits on stdout never blocks a worker that logs a lot).
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

WORKER = Path(__file__).with_name("collab_worker.py")


def start_worker(
    tmp_path: Path,
    rank: int,
    sizes: list[int],
    epochs: int,
    first: str | None,
    *extra: str,
    continuous: bool = True,
    prefix: Sequence[str] = (),
) -> subprocess.Popen:
    """Worker ``rank`` (``prefix``: a command to run it under, e.g. ``ip netns exec``)."""
    cmd = [
        *prefix,
        sys.executable,
        str(WORKER),
        "--rank",
        str(rank),
        "--batch-sizes",
        ",".join(map(str, sizes)),
        "--epochs",
        str(epochs),
        "--out",
        str(tmp_path / f"rank{rank}.pt"),
        "--done-dir",
        str(tmp_path / "done"),
        *(["--continuous"] if continuous else []),
        *extra,
    ]
    if first:
        cmd += ["--initial-peer", first]
    with open(tmp_path / f"rank{rank}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)


def first_address(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())["addresses"][0]


def reach_epoch(proc: subprocess.Popen, epoch: int, timeout: float) -> bool:
    """Read the worker's ``{"epoch": n}`` lines until ``n >= epoch`` (False at the timeout
    or when it exits first). The latest epoch read is kept: :func:`latest_epoch`."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while latest_epoch(proc) < epoch:
            left = deadline - time.monotonic()
            if left <= 0 or (selector.select(left) and not _read_epoch(proc)):
                return False
    return True


def latest_epoch(proc: subprocess.Popen) -> int:
    """The latest epoch the worker printed that a :func:`reach_epoch` call has read."""
    return getattr(proc, "swarm_epoch", -1)


def _read_epoch(proc: subprocess.Popen) -> bool:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        return False
    proc.swarm_epoch = max(latest_epoch(proc), json.loads(line).get("epoch", -1))  # type: ignore[attr-defined]
    return True


def all_logs(logs: list[str]) -> str:
    """The workers' logs, for a failure message."""
    return "\n".join(f"--- rank {rank} ---\n{log}" for rank, log in enumerate(logs))


def finish_workers(
    tmp_path: Path, procs: list[subprocess.Popen], timeout: float = 400
) -> list[str]:
    """Wait for every worker (killing the ones still running after ``timeout``); their logs."""
    try:
        for proc in procs:
            proc.communicate(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [(tmp_path / f"rank{rank}.log").read_text() for rank in range(len(procs))]


def assert_same_model(results: list[dict], logs: list[str]) -> None:
    """Every worker's final parameters equal the first one's."""
    import torch

    for result in results[1:]:
        for mine, first_peer in zip(result["params"], results[0]["params"], strict=True):
            torch.testing.assert_close(
                mine, first_peer, atol=1e-5, rtol=0, msg=lambda m: m + "\n" + all_logs(logs)
            )
