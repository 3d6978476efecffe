"""HierarchicalModelAverager and DASO in real processes: "machines" are gloo worlds of one or
two processes, linked by Swarmgrad (each machine's rank 0 holds a Node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import free_port, scaled

WORKER = Path(__file__).with_name("levels_worker.py")

pytestmark = pytest.mark.slow


def _launch(
    tmp_path: Path, mode: str, machines: int, local_size: int, *extra: str
) -> list[tuple[subprocess.Popen[str], Path]]:
    """Start every process of every machine; machine 0's leader is everyone's initial peer."""
    procs: list[tuple[subprocess.Popen[str], Path]] = []
    first: str | None = None
    for m in range(machines):
        port = free_port()
        for r in range(local_size):
            index = m * local_size + r
            out = tmp_path / f"{index}.pt"
            cmd = [
                sys.executable,
                str(WORKER),
                "--mode",
                mode,
                "--index",
                str(index),
                "--local-rank",
                str(r),
                "--local-size",
                str(local_size),
                "--store-port",
                str(port),
                "--peers",
                str(machines),
                "--out",
                str(out),
                *extra,
            ]
            if first is not None:
                cmd += ["--initial-peer", first]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append((proc, out))
        if first is None:
            line = procs[0][0].stdout.readline()  # type: ignore[union-attr]
            assert line, procs[0][0].communicate()[1]
            first = json.loads(line)["addresses"][0]
    return procs


def _results(procs: list[tuple[subprocess.Popen[str], Path]], expect_dead: int = -1) -> list[Any]:
    """Every process's saved results (``None`` for the one expected to die), each with its
    log; any unexpected exit fails with every process's log."""
    logs, codes = [], []
    try:
        for proc, _ in procs:
            _, err = proc.communicate(timeout=scaled(120))
            logs.append(err)
            codes.append(proc.returncode)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    expected = [-9 if i == expect_dead else 0 for i in range(len(procs))]
    everything = "\n".join(f"--- process {i}\n{log}" for i, log in enumerate(logs))
    assert codes == expected, everything
    results = []
    for i, (_, out) in enumerate(procs):
        if i == expect_dead:
            results.append(None)
            continue
        result = torch.load(out)
        result["log"] = logs[i]
        results.append(result)
    return results


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _logs(results: list[Any]) -> str:
    """Every process's log, for an assertion's message."""
    return "\n".join(f"--- process {i}\n{r['log']}" for i, r in enumerate(results) if r)


def test_hierarchy_of_two_machines_of_two_processes(tmp_path: Path) -> None:
    """{2: 2, 4: 4}: at step 2 each machine's processes agree and the machines differ; at
    step 4 all four agree (warm-up 1: step 0 averages nothing)."""
    results = _results(_launch(tmp_path, "hma", 2, 2, "--levels", "2:2,4:4", "--steps", "5"))
    snaps = [r["snapshots"] for r in results]
    assert not _equal(snaps[0][0], snaps[1][0])  # step 0: warm-up
    assert _equal(snaps[0][2], snaps[1][2]) and _equal(snaps[2][2], snaps[3][2])
    assert not _equal(snaps[0][2], snaps[2][2])
    assert not _equal(snaps[0][3], snaps[1][3])  # step 3: local steps only
    for s in snaps[1:]:
        assert _equal(s[4], snaps[0][4])
    leaders = [results[0], results[2]]
    assert [r["rounds"][4] for r in leaders] == [1, 1]
    assert [r["group_sizes"][4][4] for r in leaders] == [2, 2]


def test_hierarchy_of_four_single_process_peers(tmp_path: Path) -> None:
    """The same levels with no torch.distributed at all: both are swarm levels, groups of two
    at step 2 (each peer agrees with exactly one other) and of four at step 4."""
    results = _results(_launch(tmp_path, "hma", 4, 1, "--levels", "2:2,4:4", "--steps", "5"))
    snaps = [r["snapshots"] for r in results]
    for i in range(4):
        partners = [j for j in range(4) if j != i and _equal(snaps[i][2], snaps[j][2])]
        assert len(partners) == 1, (i, partners, _logs(results))
        assert results[i]["group_sizes"][2][2] == 2
    for s in snaps[1:]:
        assert _equal(s[4], snaps[0][4]), _logs(results)
    assert all(r["group_sizes"][4][4] == 4 for r in results)


def test_hierarchy_survives_a_peer_killed_mid_round(tmp_path: Path) -> None:
    """Peer 3 dies in the middle of its third swarm round (step 4), as it sends its first
    part: the others finish every step, averaging in groups of three from then on (or
    skipping a round), and end equal."""
    results = _results(
        _launch(
            tmp_path,
            "hma",
            4,
            1,
            "--levels",
            "2:4",
            "--steps",
            "11",
            "--warmup",
            "0",
            "--die-in-round",
            "3",
            "--die-index",
            "3",
        ),
        expect_dead=3,
    )
    alive = [r for r in results if r is not None]
    for r in alive:
        assert len(r["snapshots"]) == 11
        assert r["rounds"][2] + r["skipped"][2] == 6
        assert r["group_sizes"][10][2] == 3
        assert r["rounds"][2] >= 4
    for r in alive[1:]:
        assert _equal(r["snapshots"][10], alive[0]["snapshots"][10])


def test_daso_two_machines_of_two_processes(tmp_path: Path) -> None:
    """After every epoch's blocking global receive the four processes agree to bf16
    precision; what the parameters' rounds put on the wire is bfloat16, two bytes each, in
    chunks of at most ``sending_chunk_size`` elements."""
    results = _results(
        _launch(
            tmp_path,
            "daso",
            2,
            2,
            "--epochs",
            "4",
            "--last-batch",
            "3",
            "--matchmaking-time",
            "0.5",
        )
    )
    for r in results:
        assert r["epoch"] == 4
        # warm-up, two cycling epochs (send every 4th batch, receive one batch later), cool-down
        assert r["schedule"] == [(4, 1, 1), (4, 1, 1), (0, 0, 0), (0, 0, 0)]
    for epoch in range(4):
        ref = results[0]["at_epoch_end"][epoch]
        for r in results[1:]:
            torch.testing.assert_close(r["at_epoch_end"][epoch], ref, rtol=1e-2, atol=1e-2)
    for leader in (results[0], results[2]):
        done, skipped = leader["rounds"]
        assert (
            skipped == 0 and done == 4 + 2 * 2 + 4
        )  # every batch, 2 per cycling epoch, every batch
        params = [w for w in leader["wire"] if w[0] == "daso-test.params"]
        assert params
        assert {w[1] for w in params} == {"bfloat16"}
        assert all(w[2] == 2 * w[3] for w in params)
        assert all(w[3] <= 7 * w[4] for w in params)  # parts of sending_chunk_size at most
    for follower in (results[1], results[3]):
        assert follower["wire"] == []
