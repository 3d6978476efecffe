"""Receive buffers for large payloads, reused instead of freed.

A bulk lane reads each payload straight from the socket into a buffer of its size
(:mod:`peer.transport.bulk`). Fresh allocations of a model's size in parts cost twice: new
pages to fault in, and freed memory kept in fragments, so resident memory grows well beyond
what is live. :class:`BufferPool` hands out views of power-of-two *slabs* that go back to
the pool once nothing refers to them, so resident memory is the most that was live at once.

Lifetime: :meth:`BufferPool.take` returns a ``memoryview`` of a numpy slice of a slab.
Everything made from it (``memoryview`` copies, tensors from ``torch.frombuffer`` and their
views) keeps that slice alive through the buffer protocol; when the last is gone, a
``weakref.finalize`` on the slice returns the slab. Thread-safe (the last reference may go
in any thread).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

__all__ = ["BufferPool"]


class BufferPool:
    """Power-of-two slabs of bytes, reused.

    Payloads smaller than ``min_bytes`` get plain allocations (small ones are cheap, and the
    allocator keeps them compact). At most ``max_idle_bytes`` of slabs wait in the pool;
    beyond that, returned slabs are freed.
    """

    def __init__(self, min_bytes: int = 64 << 10, max_idle_bytes: int = 256 << 20) -> None:
        if min_bytes < 1 or max_idle_bytes < 0:
            raise ValueError("min_bytes must be positive and max_idle_bytes non-negative")
        self.min_bytes = min_bytes
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.slabs_allocated = 0  # slabs ever allocated (for tests and diagnostics)

    @property
    def idle_bytes(self) -> int:
        """Bytes of slabs waiting in the pool."""
        return self._idle_bytes

    def take(self, size: int) -> memoryview:
        """A writable buffer of exactly ``size`` bytes (contents undefined)."""
        if size < self.min_bytes:
            return memoryview(np.empty(size, dtype=np.uint8))  # type: ignore[arg-type]
        capacity = 1 << (size - 1).bit_length()
        slab = None
        with self._lock:
            idle = self._idle.get(capacity)
            if idle:
                slab = idle.pop()
                self._idle_bytes -= capacity
        if slab is None:
            slab = np.empty(capacity, dtype=np.uint8)
            self.slabs_allocated += 1
        piece = slab[:size]
        # nothing to give back at interpreter exit: the process's memory goes anyway
        weakref.finalize(piece, self._give_back, slab).atexit = False
        return memoryview(piece)  # type: ignore[arg-type]

    def _give_back(self, slab: np.ndarray) -> None:
        capacity = slab.nbytes
        with self._lock:
            if self._idle_bytes + capacity <= self.max_idle_bytes:
                self._idle.setdefault(capacity, []).append(slab)
                self._idle_bytes += capacity

    def clear(self) -> None:
        """Free the idle slabs (buffers in use return to the pool later, as usual)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0
