"""Wrappers that pick a leaf codec per tensor from its :class:`CompressionInfo`: by size,
by the tensor's key, or by its role."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from peer.compression.base import Compression, CompressionInfo, TensorRole
from peer.compression.casts import NoCompression


class SizeAdaptiveCompression(Compression):
    """``less`` for tensors with fewer than ``threshold`` elements, else ``greater_equal``."""

    def __init__(self, threshold: int, less: Compression, greater_equal: Compression) -> None:
        if threshold < 0:
            raise ValueError("threshold must be non-negative")
        self.threshold, self.less, self.greater_equal = threshold, less, greater_equal

    def select(self, info: CompressionInfo | None) -> Compression:
        if info is None:
            raise ValueError("SizeAdaptiveCompression needs a CompressionInfo to choose")
        codec = self.less if info.descriptor.numel < self.threshold else self.greater_equal
        return codec.select(info)

    def spec(self) -> str:
        return f"size_adaptive({self.threshold},{self.less.spec()},{self.greater_equal.spec()})"

    def __repr__(self) -> str:
        return f"SizeAdaptiveCompression({self.threshold}, {self.less!r}, {self.greater_equal!r})"


class PerTensorCompression(Compression):
    """One codec per tensor, chosen by ``info.key`` (an index into a list, or a mapping key)."""

    def __init__(self, codecs: Sequence[Compression] | Mapping[Hashable, Compression]) -> None:
        self.codecs = codecs

    def select(self, info: CompressionInfo | None) -> Compression:
        if info is None:
            raise ValueError("PerTensorCompression needs a CompressionInfo to choose")
        try:
            codec = self.codecs[info.key]  # type: ignore[call-overload]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"no codec for tensor key {info.key!r}") from None
        return codec.select(info)

    def spec(self) -> str:
        if isinstance(self.codecs, Mapping):
            items = ",".join(f"{k!r}:{c.spec()}" for k, c in sorted(self.codecs.items(), key=repr))
        else:
            items = ",".join(c.spec() for c in self.codecs)
        return f"per_tensor({items})"

    def __repr__(self) -> str:
        return f"PerTensorCompression({self.codecs!r})"


class RoleAdaptiveCompression(Compression):
    """One codec per :class:`TensorRole`; roles not given use ``default``."""

    def __init__(
        self,
        *,
        activation: Compression | None = None,
        parameter: Compression | None = None,
        gradient: Compression | None = None,
        optimizer: Compression | None = None,
        default: Compression | None = None,
    ) -> None:
        self.default = default if default is not None else NoCompression()
        self.by_role: dict[TensorRole, Compression] = {
            role: codec if codec is not None else self.default
            for role, codec in (
                (TensorRole.ACTIVATION, activation),
                (TensorRole.PARAMETER, parameter),
                (TensorRole.GRADIENT, gradient),
                (TensorRole.OPTIMIZER, optimizer),
                (TensorRole.UNSPECIFIED, None),
            )
        }

    def select(self, info: CompressionInfo | None) -> Compression:
        role = TensorRole.UNSPECIFIED if info is None else info.role
        return self.by_role[role].select(info)

    def spec(self) -> str:
        return (
            "role_adaptive("
            + ",".join(f"{r.value}:{c.spec()}" for r, c in self.by_role.items())
            + ")"
        )

    def __repr__(self) -> str:
        return f"RoleAdaptiveCompression({self.by_role!r})"
