"""DecentralizedAverager over WebSocket on loopback: groups, weights, modes and metadata."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from typing import Any

import pytest
import torch

from peer import AveragingStage, DecentralizedAverager
from peer.averaging.allreduce.runner import RunnerFactory
from peer.averaging.exceptions import MatchmakingFailed, StepCancelled
from peer.averaging.matchmaking.group_bits import grid_bits
from peer.wire import Frame
from swarmlab.averager_doubles import averager_with
from swarmlab.send_gate import gated_runner
from tests.conftest import scaled
from tests.peer.averaging.conftest import random_tensors, step_all, wait_for


def assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape
        assert torch.allclose(a, e, atol=1e-6, rtol=0), (a - e).abs().max()


@pytest.mark.parametrize("clients", [0, 1, 2])
@pytest.mark.parametrize("auxiliaries", [0, 1, 2])
def test_four_peers_average_to_the_exact_mean(make_swarm, clients: int, auxiliaries: int) -> None:
    """Point 1: every non-auxiliary peer holds the mean over them; auxiliary peers keep their
    own tensors (as hivemind's do: they only lend their bandwidth); results name all 4."""
    # peers 0..: auxiliary first (they can lead), clients last (never peer 0: the bootstrap)
    aux = set(range(auxiliaries))
    client = set(range(4 - clients, 4))
    swarm = make_swarm(4, client=sorted(client))
    tensors = [random_tensors(i) for i in range(4)]
    contributors = [i for i in range(4) if i not in aux]
    expected = [sum(tensors[i][j] for i in contributors) / len(contributors) for j in range(5)]
    originals = [[t.clone() for t in peer_tensors] for peer_tensors in tensors]
    averagers = swarm.add_averagers(
        tensors, per_peer=[{"auxiliary": i in aux} for i in range(4)], part_size_bytes=256
    )
    results = step_all(averagers)
    ids = {a.peer_id for a in averagers}
    for i, result in enumerate(results):
        assert isinstance(result, dict), result
        assert set(result) == ids
        if i not in aux:
            assert_close(tensors[i], expected)
    for i in aux:
        assert all(torch.equal(a, o) for a, o in zip(tensors[i], originals[i], strict=True))


@pytest.mark.parametrize("concurrent", [False, True])
def test_an_auxiliary_peer_keeps_its_own_tensor_bit_for_bit(make_swarm, concurrent: bool) -> None:
    """An auxiliary peer reduces a span of the others' values (weight 0) and leaves its own
    tensor untouched, whether rounds average in place or on a snapshot; here one tensor,
    whose memory a contributing peer would average directly."""
    swarm = make_swarm(3)
    tensors = [[torch.randn(4000, generator=torch.Generator().manual_seed(i))] for i in range(3)]
    original = tensors[2][0].clone()
    expected = (tensors[0][0] + tensors[1][0]) / 2
    averagers = swarm.add_averagers(
        tensors,
        concurrent_updates=concurrent,
        part_size_bytes=1024,
        per_peer=[{}, {}, {"auxiliary": True}],
    )
    results = step_all(averagers)
    assert all(isinstance(r, dict) and len(r) == 3 for r in results), results
    assert torch.equal(tensors[2][0], original)
    for i in (0, 1):
        assert torch.allclose(tensors[i][0], expected, atol=1e-6, rtol=0)


def test_weighted_mean(make_swarm) -> None:
    """Point 2: random weights → Σwᵢxᵢ/Σwᵢ everywhere."""
    swarm = make_swarm(4)
    tensors = [random_tensors(10 + i) for i in range(4)]
    rng = random.Random(3)
    weights = [rng.uniform(0.1, 5.0) for _ in range(4)]
    expected = [
        sum(w * t[j] for w, t in zip(weights, tensors, strict=True)) / sum(weights)
        for j in range(5)
    ]
    averagers = swarm.add_averagers(tensors, part_size_bytes=300)
    results = step_all(averagers, [{"weight": w} for w in weights])
    assert all(isinstance(r, dict) for r in results), results
    for t in tensors:
        assert_close(t, expected)


def test_moshpit_grid_reaches_the_global_mean_in_three_rounds(make_swarm) -> None:
    """Point 3: 8 peers, groups of 2 on a 2x2x2 grid."""
    n = 8
    swarm = make_swarm(n)
    tensors = [[torch.randn(64, generator=torch.Generator().manual_seed(i))] for i in range(n)]
    global_mean = sum(t[0] for t in tensors) / n
    averagers = swarm.add_averagers(
        tensors,
        target_group_size=2,
        per_peer=[{"initial_group_bits": grid_bits(i, n, 2)} for i in range(n)],
    )
    index = {a.peer_id: i for i, a in enumerate(averagers)}
    for round_ in range(4):
        results = step_all(averagers)
        groups = {frozenset(r) for r in results if isinstance(r, dict)}
        assert all(isinstance(r, dict) for r in results), results
        assert all(len(g) == 2 for g in groups) and len(groups) == 4
        if round_ == 0:
            assert {frozenset(index[p] for p in g) for g in groups} == {
                frozenset({2 * k, 2 * k + 1}) for k in range(4)
            }
        mean_now = sum(t[0] for t in tensors) / n
        assert torch.allclose(mean_now, global_mean, atol=1e-6)
        if round_ >= 2:  # after rounds 0, 1, 2: everyone holds the global mean
            for t in tensors:
                assert torch.allclose(t[0], global_mean, atol=1e-6)


def test_all_gather_returns_exactly_the_group(make_swarm) -> None:
    """Point 4: 8 peers in two groups of 4 (group bits), each result holds its group."""
    n = 8
    swarm = make_swarm(n)
    tensors = [[torch.full((10,), float(i))] for i in range(n)]
    averagers = swarm.add_averagers(
        tensors,
        target_group_size=4,
        per_peer=[{"initial_group_bits": format(i % 4, "02b") + str(i // 4)} for i in range(n)],
    )
    results = step_all(averagers, [{"gather": {"batch_size": 123 + i}} for i in range(n)])
    ids = [a.peer_id for a in averagers]
    for i, result in enumerate(results):
        group = range(0, 4) if i < 4 else range(4, 8)
        assert result == {ids[k]: {"batch_size": 123 + k} for k in group}
        expected = sum(float(k) for k in group) / 4
        assert torch.allclose(tensors[i][0], torch.full((10,), expected))


def test_lone_peers_and_different_schemas_fail_cleanly(make_swarm) -> None:
    """Point 5: no partner within the timeout → MatchmakingFailed, tensors untouched.
    Peers with different shapes never share a group."""
    swarm = make_swarm(3)
    tensors = [[torch.ones(4)], [torch.ones(5)], [torch.ones(4, dtype=torch.float64)]]
    before = [[t.clone() for t in ts] for ts in tensors]
    averagers = swarm.add_averagers(tensors)
    results = step_all(averagers, [{"timeout": 2.0}] * 3)
    for result in results:
        assert isinstance(result, MatchmakingFailed), result
    assert all(torch.equal(a[0], b[0]) for a, b in zip(tensors, before, strict=True))


def test_scheduled_and_triggered_steps_expose_stages(make_swarm) -> None:
    """Point 6: a scheduled step waits for its time; require_trigger waits in
    AWAITING_TRIGGER until allow_allreduce()."""
    swarm = make_swarm(2)
    tensors = [[torch.zeros(3)], [torch.ones(3)]]
    a, b = swarm.add_averagers(tensors)
    when = swarm.nodes[0].get_time() + 2.0
    ca = a.step(wait=False, scheduled_time=when, require_trigger=True, timeout=scaled(20))
    cb = b.step(wait=False, scheduled_time=when, require_trigger=True, timeout=scaled(20))
    assert ca.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
    assert wait_for(
        lambda: (
            ca.stage is AveragingStage.AWAITING_TRIGGER
            and cb.stage is AveragingStage.AWAITING_TRIGGER
        ),
        15,
    )
    assert swarm.nodes[0].get_time() >= when - 0.5  # the group formed at the scheduled time
    assert not ca.done() and torch.equal(tensors[0][0], torch.zeros(3))
    ca.allow_allreduce()
    cb.allow_allreduce()
    assert set(ca.result(scaled(20))) == {a.peer_id, b.peer_id}
    assert set(cb.result(scaled(20))) == {a.peer_id, b.peer_id}
    assert ca.stage is AveragingStage.FINISHED and ca.began_allreduce
    assert torch.allclose(tensors[0][0], torch.full((3,), 0.5))
    assert not ca.cancel()  # too late


def test_cancel_before_allreduce(make_swarm) -> None:
    """Point 6: cancel() while looking for a group → StepCancelled, tensors unchanged."""
    swarm = make_swarm(2)
    tensors = [[torch.zeros(3)], [torch.ones(3)]]
    a, b = swarm.add_averagers(tensors, min_matchmaking_time=5.0)
    control = a.step(wait=False, timeout=scaled(20))
    assert wait_for(lambda: control.stage is AveragingStage.LOOKING_FOR_GROUP, 5)
    assert control.cancel()
    with pytest.raises(StepCancelled):
        control.result(scaled(10))
    assert control.stage is AveragingStage.CANCELLED
    assert torch.equal(tensors[0][0], torch.zeros(3))
    # the averager is still usable afterwards
    results = step_all([a, b])
    assert all(isinstance(r, dict) for r in results), results
    assert torch.allclose(tensors[1][0], torch.full((3,), 0.5))


def test_shutdown_while_looking_for_a_group_leaves_no_error_unread(make_swarm, caplog) -> None:
    """Shutting down mid-matchmaking cancels the attempt: asyncio reports no result that was
    set and never read (the attempt's failure has nobody left to read it)."""
    swarm = make_swarm(2)
    a, _ = swarm.add_averagers([[torch.zeros(3)], [torch.ones(3)]], min_matchmaking_time=30.0)
    control = a.step(wait=False, timeout=scaled(60))
    assert wait_for(lambda: control.stage is AveragingStage.LOOKING_FOR_GROUP, 5)
    a.shutdown()
    assert control.stage is AveragingStage.CANCELLED
    gc.collect()  # an unread result is reported when it is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_constructor_rejects_bad_settings(make_swarm) -> None:
    swarm = make_swarm(1)
    with pytest.raises(ValueError):
        DecentralizedAverager(
            [torch.zeros(1)],
            swarm.nodes[0],
            start=False,
            prefix="x",
            auxiliary=True,
            client_mode=True,
        )
    with pytest.raises(ValueError):
        DecentralizedAverager(
            [torch.zeros(1, dtype=torch.int64)], swarm.nodes[0], start=False, prefix="x"
        )
    averager = DecentralizedAverager([torch.zeros(1)], swarm.nodes[0], start=True, prefix="y")
    with pytest.raises(ValueError):
        averager.step(weight=-1.0)
    averager.shutdown()


def test_torch_is_single_threaded_in_the_loop_thread_only(make_swarm) -> None:
    """The node's loop thread runs torch with one thread (an OpenMP team per small
    operation stalled rounds for seconds on oversubscribed cores); the thread that made the
    averager, and threads started later, keep the process's setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(3)  # a setting of the process's own, whatever the machine's cores
    try:
        node = make_swarm(1).nodes[0]
        averager = DecentralizedAverager([torch.zeros(8)], node, start=True, prefix="t")

        async def loop_threads() -> int:
            return torch.get_num_threads()

        assert node.run_coroutine(loop_threads()) == 1
        assert torch.get_num_threads() == 3
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [3]
        averager.shutdown()
    finally:
        torch.set_num_threads(previous)


def test_back_to_back_steps_with_the_same_key(make_swarm) -> None:
    """A declaration published right after the previous round's retraction must win over
    it in gossip; otherwise the partner cannot see it and the step only succeeds after a
    failed attempt (which the timeout below does not leave room for)."""
    swarm = make_swarm(2)
    tensors = [[torch.zeros(5)], [torch.ones(5)]]
    averagers = swarm.add_averagers(tensors, target_group_size=2)
    for _ in range(4):
        results = step_all(averagers, [{"timeout": scaled(3.5)}] * 2)
        assert all(isinstance(r, dict) for r in results), results
    assert torch.allclose(tensors[0][0], torch.full((5,), 0.5))


def test_a_late_step_sees_who_already_averaged_without_it(make_swarm) -> None:
    """Two peers average as a pair; a third that comes under the same key afterwards finds
    nobody, and sees that both withdrew (their group began without it): its caller may call
    the step off rather than wait for its timeout."""
    swarm = make_swarm(3)
    tensors = [[torch.zeros(3)], [torch.ones(3)], [torch.ones(3)]]
    a, b, late = swarm.add_averagers(tensors, target_group_size=2)
    assert late.withdrawn_peers() == frozenset(), "not looking for a group: nobody withdrew"
    results = step_all([a, b], [{"timeout": scaled(10)}] * 2)
    assert all(isinstance(r, dict) and len(r) == 2 for r in results), results
    control = late.step(wait=False, timeout=scaled(20))
    pair = {swarm.nodes[0].peer_id, swarm.nodes[1].peer_id}
    try:
        assert wait_for(lambda: late.withdrawn_peers() == pair, 10), late.withdrawn_peers()
    finally:
        assert control.cancel()
    with pytest.raises(StepCancelled):
        control.result(timeout=scaled(10))
    assert torch.equal(tensors[2][0], torch.ones(3)), "a step called off leaves the values"


def _gated(gate: threading.Event) -> RunnerFactory:
    """Rounds whose every send waits until ``gate`` opens: they stay in their all-reduce."""

    async def hold(peer_id: str, frame: Frame) -> None:
        await asyncio.to_thread(gate.wait)

    return gated_runner(hold)


@pytest.mark.parametrize("concurrent", [False, True])
def test_tensor_lock_during_a_round(make_swarm, concurrent: bool) -> None:
    """In place (the default, as in hivemind) a round holds the tensors' lock from its
    all-reduce to its end: get_tensors() waits. With concurrent_updates=True it does not,
    and an update made during the round is kept on top of the average."""
    swarm = make_swarm(2)
    tensors = [[torch.zeros(1000)], [torch.ones(1000)]]
    gate = threading.Event()
    a, b = swarm.add_averagers(
        tensors,
        concurrent_updates=concurrent,
        per_peer=[{}, {"averager_class": averager_with(runner=_gated(gate))}],
    )
    try:
        ca, cb = (x.step(wait=False, timeout=scaled(30)) for x in (a, b))
        assert wait_for(lambda: ca.stage is AveragingStage.RUNNING_ALLREDUCE, 15)
        got_lock = threading.Event()
        seen_when_locked: list[float] = []

        def update() -> None:
            with a.get_tensors() as mine:
                seen_when_locked.append(float(mine[0][1]))  # averaged yet?
                got_lock.set()
                mine[0].add_(10.0)

        worker = threading.Thread(target=update)
        worker.start()
        # in place the lock is the round's until it ends; else it is free within moments
        assert got_lock.wait(scaled(5) if concurrent else 1.0) is concurrent
    finally:
        gate.set()
    assert set(ca.result(scaled(30))) == {a.peer_id, b.peer_id}
    cb.result(scaled(30))
    worker.join(scaled(10))
    assert seen_when_locked == [0.0 if concurrent else 0.5]
    assert torch.equal(tensors[1][0], torch.full((1000,), 0.5))
    assert torch.equal(tensors[0][0], torch.full((1000,), 10.5))  # average + own update


def test_state_download_waits_for_an_in_place_round(make_swarm) -> None:
    """A donor's snapshot is taken on the event loop, where the in-place round holds the
    (reentrant) tensor lock: it must wait for the round, not read half-averaged tensors."""
    swarm = make_swarm(3)
    tensors = [[torch.zeros(1000)], [torch.ones(1000)], [torch.full((1000,), 7.0)]]
    gate = threading.Event()
    a, b = swarm.add_averagers(
        tensors[:2], allow_state_sharing=True, averager_class=averager_with(runner=_gated(gate))
    )
    newcomer = DecentralizedAverager(
        tensors[2], swarm.nodes[2], start=True, prefix="test", allow_state_sharing=False
    )
    swarm.averagers.append(newcomer)
    assert wait_for(lambda: newcomer_sees_donors(newcomer), 15)
    try:
        ca, cb = (x.step(wait=False, timeout=scaled(30)) for x in (a, b))
        assert wait_for(
            lambda: all(c.stage is AveragingStage.RUNNING_ALLREDUCE for c in (ca, cb)), 15
        )
        downloaded: list[Any] = []
        worker = threading.Thread(
            target=lambda: downloaded.append(newcomer.load_state_from_peers(timeout=scaled(30)))
        )
        worker.start()
        worker.join(1.0)
        assert worker.is_alive(), "the snapshot did not wait for the round"
    finally:
        gate.set()
    ca.result(scaled(30))
    cb.result(scaled(30))
    worker.join(scaled(30))
    assert downloaded and downloaded[0] is not None
    _, state = downloaded[0]
    assert torch.equal(state[0], torch.full((1000,), 0.5))  # after the round, whole


def newcomer_sees_donors(averager: DecentralizedAverager) -> bool:
    from peer.averaging.sharing.download import state_key

    record = averager.node.get(state_key("test"))
    return record is not None and len(record.value) >= 2


def test_nodes_count_the_bytes_they_send(make_swarm) -> None:
    """A round of two peers over 1 MB: each sends its half for reduction and the average of
    the half it reduced, so its count grows by about the tensor's size (plus headers,
    matchmaking and gossip)."""
    swarm = make_swarm(2)
    numel = 2**18  # 1 MiB of float32
    tensors = [[torch.full((numel,), float(i))] for i in range(2)]
    averagers = swarm.add_averagers(tensors)
    before = [node.bytes_sent for node in swarm.nodes]
    results = step_all(averagers)
    assert all(isinstance(r, dict) for r in results), results
    for node, start in zip(swarm.nodes, before, strict=True):
        sent = node.bytes_sent - start
        assert 4 * numel <= sent < 4 * numel * 1.1, sent
