"""A volunteer's data directory: its key is created safely when several processes start at
once on a fresh machine, and one process at a time holds it (one key is one volunteer)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer.data_dir import LOCK_FILE, DataDirInUse, lock_data_dir
from peer.exceptions import SwarmgradError
from peer.formats.identity import Identity
from tests.conftest import scaled

# Loads the key of each directory named on its standard input, as soon as the name comes.
LOADER = """
import sys
from pathlib import Path
from peer.volunteer import load_identity
print("ready", flush=True)
for line in sys.stdin:
    try:
        print(load_identity(Path(line.strip())).peer_id, flush=True)
    except Exception as exc:
        print("error:", type(exc).__name__, exc, flush=True)
"""


@pytest.fixture
def loaders() -> Iterator[list[subprocess.Popen[str]]]:
    started = [
        subprocess.Popen(
            [sys.executable, "-c", LOADER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for process in started:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready"
        yield started
    finally:
        for process in started:
            if process.stdin is not None:
                process.stdin.close()
            try:
                process.wait(scaled(10))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


@pytest.mark.slow
def test_three_volunteers_starting_at_once_on_a_fresh_machine_share_one_key(
    tmp_path: Path, loaders: list[subprocess.Popen[str]]
) -> None:
    for attempt in range(25):
        # a fresh machine: not even the parents of the data directory exist
        data_dir = tmp_path / f"home{attempt}" / ".local" / "share" / "swarmgrad"
        for process in loaders:  # all three are told at once
            assert process.stdin is not None
            process.stdin.write(f"{data_dir}\n")
        for process in loaders:
            assert process.stdin is not None
            process.stdin.flush()
        answers = []
        for process in loaders:
            assert process.stdout is not None
            answers.append(process.stdout.readline().strip())
        kept = Identity.from_private_bytes((data_dir / "identity.key").read_bytes()).peer_id
        assert answers == [kept] * 3, (attempt, answers)
        assert [p.name for p in data_dir.iterdir()] == ["identity.key"], "no leftovers"


def test_a_second_hold_on_one_data_dir_is_refused_with_the_fix(tmp_path: Path) -> None:
    data_dir = tmp_path / "fresh" / "swarmgrad"
    with lock_data_dir(data_dir) as held:
        assert held.held
        with pytest.raises(DataDirInUse) as refused:
            lock_data_dir(data_dir)  # even from the same process
        line = str(refused.value)
        assert "\n" not in line
        assert str(data_dir) in line and "--data-dir" in line
        assert "process" in line and str(os.getpid()) in line, line
    assert not held.held
    with lock_data_dir(data_dir):  # released: the next one holds it
        pass


def test_a_volunteer_that_was_killed_does_not_block_its_restart(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from peer.data_dir import lock_data_dir\n"
            "held = lock_data_dir(Path(sys.argv[1]))\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DataDirInUse, match=f"process {holder.pid}"):
            lock_data_dir(tmp_path)
    finally:
        holder.kill()  # SIGKILL: no chance to clean up
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()
    with lock_data_dir(tmp_path):
        pass
    assert (tmp_path / LOCK_FILE).exists()


def test_a_data_dir_that_cannot_be_made_says_which_and_what_to_do(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SwarmgradError, match=r"file/sub: .*--data-dir") as refused:
        lock_data_dir(blocker / "sub")
    assert not isinstance(refused.value, DataDirInUse)
