"""The receive-buffer pool of bulk lanes: reuse, lifetimes, bounds."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from peer.transport.receive_buffers import BufferPool


def _address(buffer: memoryview) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def test_a_released_buffer_is_reused_for_the_same_size_class() -> None:
    pool = BufferPool(min_bytes=1024)
    first = pool.take(3000)
    assert first.nbytes == 3000 and not first.readonly
    address = _address(first)
    del first
    assert pool.idle_bytes == 4096  # the power-of-two slab went back
    second = pool.take(4000)  # same class
    assert _address(second) == address and second.nbytes == 4000
    assert pool.slabs_allocated == 1 and pool.idle_bytes == 0
    other = pool.take(5000)  # next class: a new slab
    assert pool.slabs_allocated == 2 and other.nbytes == 5000


def test_the_slab_stays_taken_while_anything_made_from_the_buffer_lives() -> None:
    pool = BufferPool(min_bytes=1024)
    buffer = pool.take(4096)
    buffer[:] = bytes(range(256)) * 16
    # what the averaging path makes of a payload: memoryview → frombuffer → reshape/slices
    tensor = torch.frombuffer(memoryview(buffer), dtype=torch.uint8)
    piece = tensor.reshape(-1)[100:200]
    del buffer, tensor
    assert pool.idle_bytes == 0  # still in use through ``piece``
    again = pool.take(4096)  # must not hand out the memory ``piece`` reads
    again[:] = b"\xff" * 4096
    assert piece.tolist() == list(range(100, 200))
    assert pool.slabs_allocated == 2
    del piece
    assert pool.idle_bytes == 4096


def test_small_payloads_get_plain_buffers() -> None:
    pool = BufferPool(min_bytes=1024)
    small = pool.take(1000)
    assert small.nbytes == 1000 and not small.readonly
    del small
    assert pool.slabs_allocated == 0 and pool.idle_bytes == 0
    assert pool.take(0).nbytes == 0


def test_idle_slabs_beyond_the_cap_are_freed() -> None:
    pool = BufferPool(min_bytes=1024, max_idle_bytes=8192)
    buffers = [pool.take(4096) for _ in range(3)]
    del buffers
    assert pool.idle_bytes == 8192  # two kept, the third freed
    pool.clear()
    assert pool.idle_bytes == 0


def test_buffers_released_in_another_thread_return_safely() -> None:
    pool = BufferPool(min_bytes=1024)
    held = [pool.take(2048) for _ in range(64)]

    def release(chunk: list[memoryview]) -> None:
        while chunk:
            chunk.pop()

    threads = [threading.Thread(target=release, args=(held[i::4],)) for i in range(4)]
    del held
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert pool.idle_bytes == 64 * 2048


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="min_bytes"):
        BufferPool(min_bytes=0)
