"""DiLoCo across real processes: a peer killed mid-round, a peer joining mid-run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import scaled
from tests.peer.optim.collab_swarm import all_logs, finish_workers, first_address

WORKER = Path(__file__).with_name("diloco_worker.py")


def start(tmp_path: Path, rank: int, first: str | None, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(WORKER),
        "--rank",
        str(rank),
        "--out",
        str(tmp_path / f"rank{rank}.pt"),
        "--done-dir",
        str(tmp_path / "done"),
        *extra,
    ]
    if first:
        cmd += ["--initial-peer", first]
    with open(tmp_path / f"rank{rank}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)


def start_swarm(tmp_path: Path, extras: list[tuple[str, ...]]) -> list[subprocess.Popen]:
    """One worker per entry of ``extras`` (its own options), all joined to the first."""
    (tmp_path / "done").mkdir()
    procs = [start(tmp_path, 0, None, *extras[0])]
    first = first_address(procs[0])
    procs += [start(tmp_path, r, first, *extra) for r, extra in enumerate(extras) if r]
    for proc in procs[1:]:
        first_address(proc)
    return procs


def assert_same_outer_state(results: list[dict], logs: list[str]) -> None:
    for result in results[1:]:
        for mine, theirs in zip(result["outer"], results[0]["outer"], strict=True):
            torch.testing.assert_close(
                mine, theirs, atol=1e-6, rtol=0, msg=lambda m: m + "\n" + all_logs(logs)
            )


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [
        # as the all-reduce of its second round begins
        (),
        # once its averages of that round reached one survivor only: that one has the
        # round's result and applies it, the other sees the death only by its watchdog,
        # drops the round and loads the first one's state
        ("--owing-one-average",),
    ],
    ids=["as-the-round-begins", "owing-one-survivor-an-average"],
)
def test_a_peer_killed_mid_round_does_not_stall_the_others(
    tmp_path: Path, how: tuple[str, ...]
) -> None:
    syncs = 4
    common = ("--syncs", str(syncs), "--expected", "2", "--wait-peers", "3")
    common += ("--silence", str(scaled(2.0)), "--verbose")  # (the logs tell who saw what)
    # the third peer dies (SIGKILL) in its second round
    procs = start_swarm(tmp_path, [common, common, (*common, "--die-in-sync", "1", *how)])
    logs = finish_workers(tmp_path, procs, timeout=scaled(120))
    assert procs[2].returncode == -9, all_logs(logs)  # it did die by SIGKILL
    for proc in procs[:2]:
        assert proc.returncode == 0, all_logs(logs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in results:
        assert result["sync"] == syncs, all_logs(logs)
        done, _failed, group = result["rounds"]
        assert done >= syncs - 1 and group == 2, all_logs(logs)
    assert_same_outer_state(results, logs)


@pytest.mark.slow
def test_a_peer_joining_mid_run_downloads_the_outer_state_and_takes_part(tmp_path: Path) -> None:
    syncs = 8
    common = ("--syncs", str(syncs), "--expected", "3", "--silence", str(scaled(3.0)))
    common += ("--step-delay", "0.25")  # (a sync takes a second or more: the third can join)
    # the first two train once the third is up (a process starts slowly on a busy machine);
    # the third starts training only once the swarm has done two syncs
    first_two = (*common, "--wait-peers", "2", "--wait-members", "3")
    joiner_options = (*common, "--join-at-sync", "2", "--verbose")  # (its log tells why)
    procs = start_swarm(tmp_path, [first_two, first_two, joiner_options])
    logs = finish_workers(tmp_path, procs, timeout=scaled(120))
    for proc in procs:
        assert proc.returncode == 0, all_logs(logs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for result in results:
        assert result["sync"] == syncs, all_logs(logs)
    joiner = results[2]
    assert 2 <= joiner["joined_at"] < syncs, all_logs(logs)  # it started from the swarm's state
    done, _, group = joiner["rounds"]
    assert done >= 1 and group == 3, all_logs(logs)  # and averaged with both others after
    assert results[0]["rounds"][2] == 3, all_logs(logs)
    assert_same_outer_state(results, logs)
    for result in results:  # the model ends at the outer parameters
        for p, o in zip(result["params"], result["outer"], strict=True):
            torch.testing.assert_close(p, o, atol=0, rtol=0)
