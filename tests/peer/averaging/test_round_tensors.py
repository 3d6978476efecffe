"""The averaged tensors as rounds use them (:mod:`peer.averaging.round_tensors`), without a
node: which flat buffer a round averages, what goes back into the tensors, and the lock."""

from __future__ import annotations

import asyncio

import torch

from peer.averaging.allreduce.partition import FlatLayout
from peer.averaging.round_tensors import AveragedTensors


def _tensors(*parts: torch.Tensor) -> AveragedTensors:
    return AveragedTensors(parts, FlatLayout.from_tensors(parts))


def test_views_of_one_buffer_are_averaged_in_their_own_memory() -> None:
    buffer = torch.arange(6, dtype=torch.float32)
    tensors = _tensors(buffer[:2], buffer[2:])
    flat, copy_back = tensors.in_place(auxiliary=False)
    assert not copy_back
    flat.fill_(7.0)
    assert torch.equal(buffer, torch.full((6,), 7.0))


def test_separate_tensors_are_averaged_on_a_copy_written_back() -> None:
    a, b = torch.zeros(2), torch.ones(3)
    tensors = _tensors(a, b)
    flat, copy_back = tensors.in_place(auxiliary=False)
    assert copy_back
    assert flat.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    flat.fill_(5.0)
    assert a.tolist() == [0.0, 0.0]  # not until copy_back
    tensors.copy_back(flat)
    assert a.tolist() == [5.0, 5.0] and b.tolist() == [5.0] * 3


def test_an_auxiliary_peer_averages_a_copy_and_keeps_its_tensors() -> None:
    own = torch.zeros(4)
    flat, copy_back = _tensors(own).in_place(auxiliary=True)
    assert not copy_back
    flat.fill_(3.0)
    assert torch.equal(own, torch.zeros(4))


def test_a_snapshot_round_adds_alpha_times_the_change() -> None:
    a = torch.ones(4)
    tensors = _tensors(a)
    snapshot = tensors.snapshot()
    assert snapshot.data_ptr() != a.data_ptr()
    assert tensors.snapshot().data_ptr() == snapshot.data_ptr()  # reused across rounds
    a.add_(10.0)  # trained on during the round: kept
    tensors.apply(torch.full((4,), 2.0), 0.5)
    assert torch.equal(a, torch.full((4,), 12.0))
    tensors.apply(torch.full((4,), 2.0), 0.0)
    assert torch.equal(a, torch.full((4,), 12.0))


def test_the_accumulator_is_reused_while_large_enough() -> None:
    tensors = _tensors(torch.zeros(4))
    first = tensors.accumulator(8, torch.float32)
    smaller = tensors.accumulator(4, torch.float32)
    assert smaller.numel() == 4 and smaller.data_ptr() == first.data_ptr()
    assert tensors.accumulator(16, torch.float32).numel() == 16
    assert tensors.accumulator(4, torch.float64).dtype == torch.float64


def test_code_on_the_loop_waits_for_an_in_place_round_to_end() -> None:
    tensors = _tensors(torch.zeros(4))
    order: list[str] = []

    async def main() -> None:
        round_began, round_may_end = asyncio.Event(), asyncio.Event()

        async def in_place_round() -> None:
            async with tensors.held_for_round():
                order.append("round")
                round_began.set()
                await round_may_end.wait()
                order.append("round ends")

        async def donor_snapshot() -> None:
            async with tensors.locked():  # reentrant lock, same thread: must still wait
                order.append("snapshot")

        task = asyncio.create_task(in_place_round())
        await round_began.wait()
        waiter = asyncio.create_task(donor_snapshot())
        for _ in range(20):
            await asyncio.sleep(0)
        assert order == ["round"]
        round_may_end.set()
        await asyncio.gather(task, waiter)

    asyncio.run(main())
    assert order == ["round", "round ends", "snapshot"]
