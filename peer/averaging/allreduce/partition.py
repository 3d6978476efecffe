"""Flatten averaged tensors into one vector, split it among reducers, cut spans into parts.

The flat vector is split into one contiguous *span* per member; member ``i`` reduces span
``i``, streamed in *parts* of at most ``part_size_bytes`` after compression. No I/O:

* :class:`FlatLayout`: where each tensor lives in the flat vector;
  :meth:`FlatLayout.flatten` copies the tensors into one buffer (mixed floating dtypes in
  their promoted dtype), :meth:`FlatLayout.unflatten_into` writes it back in place.
* :class:`Partition`: spans per reducer and the parts of each span. A part never crosses a
  change of codec, but may cross tensor boundaries. Parts are views, never copies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from peer.compression import (
    Compression,
    CompressionInfo,
    NoCompression,
    TensorDescriptor,
    TensorRole,
    dtype_name,
)

__all__ = ["FlatLayout", "Part", "Partition", "schema_hash"]


@dataclass(frozen=True)
class FlatLayout:
    """Where each averaged tensor lives in the flat vector (offsets in elements)."""

    descriptors: tuple[TensorDescriptor, ...]
    offsets: tuple[int, ...]  # offsets[i] = start of tensor i; offsets[-1] = total
    dtype: torch.dtype

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> FlatLayout:
        """Layout for ``tensors`` (any shapes, including 0-d and zero-size; floating dtypes)."""
        return cls.from_descriptors([TensorDescriptor.from_tensor(t) for t in tensors])

    @classmethod
    def from_descriptors(cls, descriptors: Sequence[TensorDescriptor]) -> FlatLayout:
        offsets = [0]
        dtype: torch.dtype | None = None
        for d in descriptors:
            if not d.dtype.is_floating_point:
                raise ValueError(f"averaged tensors must be floating point, got {d.dtype}")
            dtype = d.dtype if dtype is None else torch.promote_types(dtype, d.dtype)
            offsets.append(offsets[-1] + d.numel)
        return cls(tuple(descriptors), tuple(offsets), dtype or torch.float32)

    @property
    def total(self) -> int:
        """Number of elements of the flat vector."""
        return self.offsets[-1]

    def _check(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(self.descriptors):
            raise ValueError(f"expected {len(self.descriptors)} tensors, got {len(tensors)}")
        for i, (t, d) in enumerate(zip(tensors, self.descriptors, strict=True)):
            if tuple(t.shape) != d.shape or t.dtype != d.dtype:
                raise ValueError(
                    f"tensor {i} is {t.dtype}{list(t.shape)}, expected {d.dtype}{list(d.shape)}"
                )

    def flatten(
        self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy ``tensors`` into one contiguous flat vector (``out`` if given), once.

        Returns a tensor of shape ``[total]`` and dtype :attr:`dtype` on the CPU.
        """
        self._check(tensors)
        if out is None:
            out = torch.empty(self.total, dtype=self.dtype)
        elif out.shape != (self.total,) or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.dtype}[{self.total}] tensor")
        for t, view in zip(tensors, self.views(out), strict=True):
            view.copy_(t.detach())
        return out

    def alias(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """A flat ``[total]`` view of the tensors' own memory, or None if they are not laid
        out back to back (in order, contiguous, one dtype, one storage): a single tensor,
        or views of one flat buffer. Writing the view writes the tensors (no autograd)."""
        self._check(tensors)
        sized = [(t, start) for t, start in zip(tensors, self.offsets, strict=False) if t.numel()]
        if not sized:
            return None
        first, first_start = sized[0]
        storage = first.untyped_storage()
        itemsize = self.dtype.itemsize
        base = first.data_ptr() - first_start * itemsize
        for t, start in sized:
            if (
                t.dtype != self.dtype
                or t.device.type != "cpu"
                or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.data_ptr() != base + start * itemsize
            ):
                return None
        offset = first.storage_offset() - first_start
        if offset < 0:
            return None
        flat = torch.empty(0, dtype=self.dtype)
        return flat.set_(storage, offset, (self.total,), (1,))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like the tensors (no copies)."""
        return [
            flat[start:stop].view(d.shape)
            for d, start, stop in zip(
                self.descriptors, self.offsets, self.offsets[1:], strict=False
            )
        ]

    def unflatten_into(
        self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], alpha: float = 1.0
    ) -> None:
        """Write ``flat`` back into ``tensors`` in place: ``t += alpha * (flat_view - t)``.

        ``alpha=1`` copies exactly; see
        :func:`peer.averaging.allreduce.reducer.apply_averaging_alpha`.
        """
        from peer.averaging.allreduce.reducer import apply_averaging_alpha

        self._check(tensors)
        if flat.shape != (self.total,):
            raise ValueError(f"flat must have shape [{self.total}]")
        with torch.no_grad():
            for t, view in zip(tensors, self.views(flat), strict=True):
                apply_averaging_alpha(t, view, alpha)


def zeros_back_to_back(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zero CPU tensors shaped like ``tensors``, as views of one flat buffer when they share
    a dtype: an in-place round then averages that buffer directly (``FlatLayout.alias``)
    instead of through a flat copy."""
    if len({t.dtype for t in tensors}) != 1:
        return [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].view(t.shape))
        start += t.numel()
    return out


@dataclass(frozen=True)
class Part:
    """One part of one reducer's span: elements ``[start, stop)`` of the flat vector."""

    reducer: int  # index of the reducer in group order
    index: int  # index of the part within that reducer's span
    start: int
    stop: int
    codec: Compression  # leaf codec compressing this part

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The part's elements of ``flat`` as a view, shape ``[numel]``."""
        return flat[self.start : self.stop]


class Partition:
    """Spans per reducer and each span cut into parts; pure integer bookkeeping.

    ``span_sizes[i]`` elements go to reducer ``i`` in order (from
    :func:`peer.averaging.allreduce.load_balancing.load_balance`); they must sum to the layout's
    total. ``compression`` is resolved per tensor (``CompressionInfo`` key = tensor index,
    role from ``roles``) to a leaf codec. Each part holds at most ``part_size_bytes`` of
    compressed payload (at least one element, so a tiny budget still makes progress).
    """

    def __init__(
        self,
        layout: FlatLayout,
        span_sizes: Sequence[int],
        part_size_bytes: int,
        compression: Compression | None = None,
        roles: Sequence[TensorRole] | None = None,
    ) -> None:
        if part_size_bytes < 1:
            raise ValueError("part_size_bytes must be positive")
        if any(s < 0 for s in span_sizes) or sum(span_sizes) != layout.total:
            raise ValueError(
                f"span sizes {list(span_sizes)} must be non-negative and sum to {layout.total}"
            )
        compression = compression if compression is not None else NoCompression()
        roles = roles if roles is not None else [TensorRole.UNSPECIFIED] * len(layout.descriptors)
        self.layout = layout
        self.part_size_bytes = part_size_bytes

        # runs of consecutive non-empty tensors sharing a leaf codec: (start, stop, codec)
        runs: list[tuple[int, int, Compression]] = []
        for i, (d, start, stop) in enumerate(
            zip(layout.descriptors, layout.offsets, layout.offsets[1:], strict=False)
        ):
            if start == stop:
                continue  # zero-size tensors take no room and never split a run
            codec = compression.select(CompressionInfo(i, d, roles[i]))
            if runs and runs[-1][2] == codec:
                runs[-1] = (runs[-1][0], stop, codec)
            else:
                runs.append((start, stop, codec))

        spans: list[tuple[int, int]] = []
        parts: list[tuple[Part, ...]] = []
        position = 0
        for reducer, size in enumerate(span_sizes):
            span = (position, position + size)
            spans.append(span)
            parts.append(tuple(self._cut(reducer, span, runs)))
            position += size
        self.spans: tuple[tuple[int, int], ...] = tuple(spans)
        self._parts: tuple[tuple[Part, ...], ...] = tuple(parts)

    def _cut(
        self, reducer: int, span: tuple[int, int], runs: list[tuple[int, int, Compression]]
    ) -> list[Part]:
        out: list[Part] = []
        lo, hi = span
        for run_start, run_stop, codec in runs:
            start, stop = max(lo, run_start), min(hi, run_stop)
            if start >= stop:
                continue
            per_part = max(1, self.part_size_bytes // codec.payload_itemsize(self.layout.dtype))
            for part_start in range(start, stop, per_part):
                out.append(
                    Part(reducer, len(out), part_start, min(stop, part_start + per_part), codec)
                )
        return out

    @property
    def num_reducers(self) -> int:
        return len(self.spans)

    def parts_of(self, reducer: int) -> tuple[Part, ...]:
        """The parts of ``reducer``'s span, in order, tiling it exactly."""
        return self._parts[reducer]

    def part(self, reducer: int, index: int) -> Part:
        """Part ``index`` of ``reducer``'s span; ``IndexError`` if there is none (bad input)."""
        if not 0 <= reducer < len(self._parts) or not 0 <= index < len(self._parts[reducer]):
            raise IndexError(f"no part {index} in the span of reducer {reducer}")
        return self._parts[reducer][index]

    def all_parts(self) -> list[Part]:
        """Every part, by reducer then index (the order a sender may stream them)."""
        return [p for parts in self._parts for p in parts]

    def part_sizes(self, reducer: int) -> list[int]:
        """Element counts of ``reducer``'s parts, e.g. for :class:`WeightedMeanReducer`."""
        return [p.numel for p in self._parts[reducer]]


def schema_hash(
    tensors_or_descriptors: Sequence[torch.Tensor | TensorDescriptor],
    compression: Compression | None = None,
    roles: Sequence[TensorRole] | None = None,
) -> bytes:
    """A digest of shapes, dtypes and per-tensor codecs; only equal hashes may share a group.

    Used by matchmaking (``Declaration.schema_hash``): peers that would disagree on the
    layout or on how a part is compressed must never average together.
    """
    compression = compression if compression is not None else NoCompression()
    h = hashlib.sha256(b"swarmgrad-schema-v1")
    for i, item in enumerate(tensors_or_descriptors):
        d = item if isinstance(item, TensorDescriptor) else TensorDescriptor.from_tensor(item)
        role = roles[i] if roles is not None else TensorRole.UNSPECIFIED
        codec = compression.select(CompressionInfo(i, d, role))
        h.update(f"|{dtype_name(d.dtype)}{list(d.shape)}:{codec.spec()}".encode())
    return h.digest()[:16]
