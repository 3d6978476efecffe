"""What a butterfly round's received frames hold: the part range a frame claims, and its
contributions or average decoded into a flat tensor. Pure functions, no I/O; every one
raises ``ValueError`` or :class:`~peer.compression.CompressionError` (decoding may also
raise ``RuntimeError``) on bad input, which the round takes as its sender's fault.

Received ``none`` payloads are decoded with one copy (the transport hands out read-only
``bytes``); other codecs through :func:`~peer.compression.extract`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peer.compression import (
    CompressedTensor,
    CompressionError,
    all_finite,
    extract,
    plain_values,
)
from peer.wire import Frame

__all__ = ["average_values", "batch_sizes", "contribution_values"]


def batch_sizes(part_sizes: Sequence[int], index: object, count: object) -> Sequence[int]:
    """The element counts of parts ``index .. index + count - 1`` of ``part_sizes``, as a
    frame's fields ``i`` and ``k`` claim them (untrusted)."""
    if type(count) is not int or count < 1 or type(index) is not int or index < 0:
        raise ValueError(f"bad part range {index!r} + {count!r}")
    if index + count > len(part_sizes):
        raise ValueError(f"parts {index}..{index + count - 1} of {len(part_sizes)}")
    return part_sizes[index : index + count]


def contribution_values(
    frame: Frame, sizes: Sequence[int], count: int, dtype: torch.dtype
) -> torch.Tensor:
    """The values of a ``part`` frame of ``count`` parts of ``sizes``, flat. Finiteness is
    not checked: the reducer does that itself, with its sums."""
    values = plain_values(frame.fields["c"], frame.payload, dtype)
    if values is None:
        compressed = CompressedTensor.from_wire(frame.fields["c"], frame.payload)
        # the reducer checks finiteness itself: skip extract's (second) pass
        values = extract(compressed, check_finite=False).reshape(-1)
    if count > 1 and values.numel() != sum(sizes):
        raise ValueError(f"batch of {values.numel()} values, expected {sum(sizes)}")
    return values


def average_values(
    frame: Frame, sizes: Sequence[int], count: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """The averages of an ``avg`` frame of ``count`` parts of ``sizes``, flat and finite;
    None for a part without one (no contributor with positive weight)."""
    if count > 1 and "c" not in frame.fields:
        raise ValueError("a batch of parts without averages")
    if "c" not in frame.fields:
        return None
    average = plain_values(frame.fields["c"], frame.payload, dtype)
    if average is None:
        compressed = CompressedTensor.from_wire(frame.fields["c"], frame.payload)
        average = extract(compressed).reshape(-1)
    elif not all_finite(average):
        raise CompressionError("none payload decodes to NaN or Inf")
    if average.numel() != sum(sizes) or average.dtype != dtype:
        raise ValueError(
            f"average of {average.numel()} {average.dtype}, expected {sum(sizes)} {dtype}"
        )
    return average
