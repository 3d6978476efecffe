"""Error feedback for compressed pseudo-gradients (Seide et al. 2014; Karimireddy et al.,
arXiv:1901.09847): what compression loses from one round's values is added to the next
round's, so the losses do not pile up into a bias.

Pure tensor math, no I/O. :class:`peer.DiLoCo` keeps one :class:`ErrorFeedback` per
fragment. The loss is *estimated* by compressing this peer's values with the round's codec
as one flat tensor; the round itself compresses parts of the group's spans (different
block boundaries, and reducers' averages are compressed again), so the estimate is close,
not exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peer.compression import Compression, CompressionInfo, extract

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The residual of one set of tensors under ``codec``."""

    def __init__(self, codec: Compression) -> None:
        self.codec = codec
        self.residuals: list[torch.Tensor] | None = None

    def reset(self) -> None:
        """Forget the residual (e.g. after loading another peer's state)."""
        self.residuals = None

    def apply(self, values: Sequence[torch.Tensor]) -> None:
        """In place: ``values += residual``; the new residual is what compressing the result
        loses. ``values`` are CPU float tensors (any shapes, the same ones every call)."""
        with torch.no_grad():
            if self.residuals is not None:
                if len(self.residuals) != len(values) or any(
                    r.shape != v.shape for r, v in zip(self.residuals, values, strict=True)
                ):
                    raise ValueError("error feedback got tensors of other shapes than before")
                for v, r in zip(values, self.residuals, strict=True):
                    v.add_(r)
            flat = torch.cat([v.reshape(-1).float() for v in values])  # [total]
            sent = extract(
                self.codec.compress(flat, CompressionInfo.from_tensor(flat)), check_finite=False
            )
            lost = flat - sent.float()
            out, start = [], 0
            for v in values:
                out.append(lost[start : start + v.numel()].view(v.shape).to(v.dtype))
                start += v.numel()
            self.residuals = out
