"""Wire format: one WebSocket binary message per frame.

A frame is ``u32 header length | msgpack header | payload`` (length big-endian). The header map
has short keys: ``t`` message type (a registered str), ``v`` protocol version (must equal
:data:`PROTOCOL_VERSION`), ``i`` request id (0 for one-way messages), ``r`` id of the request
this answers (0 if none), ``n`` payload length, ``f`` the fields, checked by the type's
:class:`Schema`.

Register each message type's schema in a :class:`MessageRegistry`; send with
:func:`encode_frame`; read with :func:`decode_frame`, or :func:`decode_length` then
:func:`decode_header` on a stream. Nothing is unpickled: the header is msgpack with
``strict_map_key`` and no extension types, the payload raw bytes read only by the message's
owner, and every limit is checked before the allocation it guards.
"""

from __future__ import annotations

import abc
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgpack

from peer.exceptions import (
    FrameTooLarge,
    MalformedFrame,
    UnknownMessageType,
    UnsupportedVersion,
)

PROTOCOL_VERSION = 1
_LENGTH = struct.Struct(">I")

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard limits on what a peer accepts. Frames over a limit close the connection."""

    max_header_bytes: int = 1 << 20  # gossip digests of a few thousand records fit comfortably
    max_payload_bytes: int = 64 << 20
    max_list_length: int = 100_000
    max_string_length: int = 1 << 16

    @property
    def max_frame_bytes(self) -> int:
        return _LENGTH.size + self.max_header_bytes + self.max_payload_bytes


DEFAULT_LIMITS = Limits()


# --------------------------------------------------------------------------- schemas


class Spec(abc.ABC, Generic[T_co]):
    """A tiny validator for one msgpack-decoded value; raises MalformedFrame on mismatch."""

    @abc.abstractmethod
    def check(self, value: object, path: str, limits: Limits) -> T_co:
        """Return the validated value (possibly normalised, e.g. a tuple for a list)."""


@dataclass(frozen=True, slots=True)
class Scalar(Spec[T]):
    kind: type[T] | tuple[type[T], ...]
    min_value: float | None = None
    max_length: int | None = None
    # the accepted types themselves: values of exactly these take the short path below
    _exact: frozenset[type] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_exact", frozenset(_as_tuple(self.kind)))

    def check(self, value: object, path: str, limits: Limits) -> T:
        kind = type(value)
        if kind in self._exact:  # every frame has several of these: no isinstance chain
            # value is exactly of an accepted type, which mypy cannot see through type(); an
            # isinstance or cast here would cost every frame, hence the ignores on this path
            if kind is int or kind is float:
                if self.min_value is not None and value < self.min_value:  # type: ignore[operator]
                    raise MalformedFrame(f"{path}: {value!r} is below {self.min_value}")
                if value != value:
                    raise MalformedFrame(f"{path}: NaN is not allowed")
            elif kind is str or kind is bytes:
                max_length = (
                    self.max_length if self.max_length is not None else limits.max_string_length
                )
                if len(value) > max_length:  # type: ignore[arg-type]
                    raise MalformedFrame(f"{path}: longer than {max_length}")
            return value  # type: ignore[return-value]
        # bool is an int in Python; never accept it where a number is asked for.
        if isinstance(value, bool) and bool not in _as_tuple(self.kind):
            raise MalformedFrame(f"{path}: expected {_name(self.kind)}, got bool")
        if not isinstance(value, self.kind):
            raise MalformedFrame(f"{path}: expected {_name(self.kind)}, got {type(value).__name__}")
        if self.min_value is not None and isinstance(value, int | float) and value < self.min_value:
            raise MalformedFrame(f"{path}: {value!r} is below {self.min_value}")
        if isinstance(value, str | bytes):
            max_length = (
                self.max_length if self.max_length is not None else limits.max_string_length
            )
            if len(value) > max_length:
                raise MalformedFrame(f"{path}: longer than {max_length}")
        if isinstance(value, float) and value != value:
            raise MalformedFrame(f"{path}: NaN is not allowed")
        return value


@dataclass(frozen=True, slots=True)
class ListOf(Spec[list[T]]):
    item: Spec[T]
    max_length: int | None = None
    exact_length: int | None = None

    def check(self, value: object, path: str, limits: Limits) -> list[T]:
        if not isinstance(value, list | tuple):
            raise MalformedFrame(f"{path}: expected a list, got {type(value).__name__}")
        max_length = self.max_length if self.max_length is not None else limits.max_list_length
        if len(value) > max_length:
            raise MalformedFrame(f"{path}: more than {max_length} items")
        if self.exact_length is not None and len(value) != self.exact_length:
            raise MalformedFrame(f"{path}: expected {self.exact_length} items, got {len(value)}")
        return [self.item.check(v, f"{path}[{i}]", limits) for i, v in enumerate(value)]


@dataclass(frozen=True, slots=True)
class Tuple(Spec[tuple[object, ...]]):
    items: tuple[Spec[object], ...]

    def check(self, value: object, path: str, limits: Limits) -> tuple[object, ...]:
        if not isinstance(value, list | tuple) or len(value) != len(self.items):
            raise MalformedFrame(f"{path}: expected a list of {len(self.items)} items")
        return tuple(
            s.check(v, f"{path}[{i}]", limits)
            for i, (s, v) in enumerate(zip(self.items, value, strict=True))
        )


@dataclass(frozen=True, slots=True)
class Optional(Spec[T | None]):
    inner: Spec[T]

    def check(self, value: object, path: str, limits: Limits) -> T | None:
        return None if value is None else self.inner.check(value, path, limits)


@dataclass(frozen=True, slots=True)
class AnyValue(Spec[object]):
    """Any msgpack value (already bounded by the header size limit)."""

    def check(self, value: object, path: str, limits: Limits) -> object:
        return value


@dataclass(frozen=True, slots=True)
class Schema:
    """Fields of one message type: required and optional field specs. Unknown fields are
    rejected so that a typo on the sending side fails loudly instead of being ignored."""

    required: Mapping[str, Spec[object]] = field(default_factory=dict)
    optional: Mapping[str, Spec[object]] = field(default_factory=dict)
    payload: bool = False  # whether a raw payload may follow the header

    def check(self, fields: object, message_type: str, limits: Limits) -> dict[str, object]:
        if not isinstance(fields, dict):
            raise MalformedFrame(f"{message_type}: fields must be a map")
        out: dict[str, object] = {}
        for name, spec in self.required.items():
            if name not in fields:
                raise MalformedFrame(f"{message_type}: missing field {name!r}")
            out[name] = spec.check(fields[name], f"{message_type}.{name}", limits)
        for name, value in fields.items():
            if name in self.required:
                continue
            optional_spec = self.optional.get(name)
            if optional_spec is None:
                raise MalformedFrame(f"{message_type}: unknown field {name!r}")
            out[name] = optional_spec.check(value, f"{message_type}.{name}", limits)
        return out


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


INT = Scalar(int, min_value=0)
FLOAT = Scalar((int, float))
STR = Scalar(str)
BYTES = Scalar(bytes)
BOOL = Scalar(bool)


class MessageRegistry:
    """Message types a node understands, with their schemas. Layers above the node (gossip,
    averaging) register theirs; a frame of an unregistered type is a protocol error."""

    def __init__(self) -> None:
        self._schemas: dict[str, Schema] = {}

    def register(self, message_type: str, schema: Schema) -> None:
        existing = self._schemas.get(message_type)
        if existing is not None and existing != schema:
            raise ValueError(f"message type {message_type!r} is already registered differently")
        self._schemas[message_type] = schema

    def schema(self, message_type: str) -> Schema:
        try:
            return self._schemas[message_type]
        except KeyError:
            raise UnknownMessageType(f"unknown message type {message_type!r}") from None

    def __contains__(self, message_type: str) -> bool:
        return message_type in self._schemas


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class Frame:
    """One message. ``payload`` may be a zero-copy view into the received buffer."""

    type: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    payload: bytes | bytearray | memoryview = b""
    request_id: int = 0
    reply_to: int = 0


def encode_header(frame: Frame) -> bytes:
    """The length prefix and msgpack header of ``frame`` (the payload follows it as is)."""
    header: bytes = msgpack.packb(
        {
            "t": frame.type,
            "v": PROTOCOL_VERSION,
            "i": frame.request_id,
            "r": frame.reply_to,
            "n": memoryview(frame.payload).nbytes,
            "f": dict(frame.fields),
        },
        use_bin_type=True,
    )
    return _LENGTH.pack(len(header)) + header


def encode_frame(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Serialise a frame into one binary message. Raises FrameTooLarge over the limits."""
    header = encode_header(frame)
    payload = memoryview(frame.payload).cast("B")
    if len(header) - _LENGTH.size > limits.max_header_bytes:
        raise FrameTooLarge(f"{frame.type}: header of {len(header)} bytes is over the limit")
    if payload.nbytes > limits.max_payload_bytes:
        raise FrameTooLarge(f"{frame.type}: payload of {payload.nbytes} bytes is over the limit")
    if not payload.nbytes:
        return header
    out = bytearray(len(header) + payload.nbytes)
    out[: len(header)] = header
    out[len(header) :] = payload
    return bytes(out)


def decode_frame(
    data: bytes | bytearray | memoryview,
    registry: MessageRegistry,
    limits: Limits = DEFAULT_LIMITS,
) -> Frame:
    """Parse and validate one binary message. The payload is a view into ``data``.

    Raises a :class:`~peer.exceptions.ProtocolError` subclass naming what is wrong.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    if len(view) < _LENGTH.size:
        raise MalformedFrame(f"frame of {len(view)} bytes is shorter than its length prefix")
    header_length = decode_length(view[: _LENGTH.size], limits)
    if _LENGTH.size + header_length > len(view):
        raise MalformedFrame("frame is truncated inside its header")
    start = _LENGTH.size + header_length
    head = decode_header(view[_LENGTH.size : start], registry, limits)
    if len(view) - start != head.payload_length:
        raise MalformedFrame(
            f"payload is {len(view) - start} bytes but the header says {head.payload_length}"
        )
    return Frame(head.type, head.fields, view[start:], head.request_id, head.reply_to)


LENGTH_BYTES = _LENGTH.size


def decode_length(prefix: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> int:
    """The header length from a frame's 4-byte prefix, checked against ``limits``."""
    (header_length,) = _LENGTH.unpack_from(prefix, 0)
    if header_length > limits.max_header_bytes:
        raise FrameTooLarge(
            f"header of {header_length} bytes is over the limit of {limits.max_header_bytes}"
        )
    return int(header_length)


@dataclass(frozen=True, slots=True)
class Header:
    """A validated frame header; the payload (``payload_length`` bytes) follows it."""

    type: str
    fields: Mapping[str, Any]
    request_id: int
    reply_to: int
    payload_length: int


def decode_header(
    data: bytes | bytearray | memoryview,
    registry: MessageRegistry,
    limits: Limits = DEFAULT_LIMITS,
) -> Header:
    """Parse and validate a frame's msgpack header (without its length prefix), so that a
    stream reader can size the payload's buffer before reading it."""
    try:
        header = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_header_bytes,
            max_bin_len=limits.max_header_bytes,
            max_array_len=limits.max_list_length,
            max_map_len=limits.max_list_length,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedFrame(f"header is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise MalformedFrame("header must be a msgpack map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol version {version!r} is not supported (this peer speaks {PROTOCOL_VERSION})"
        )
    message_type = header.get("t")
    if not isinstance(message_type, str):
        raise MalformedFrame("header lacks a message type")
    schema = registry.schema(message_type)
    request_id = INT.check(header.get("i", 0), "header.i", limits)
    reply_to = INT.check(header.get("r", 0), "header.r", limits)
    payload_length = INT.check(header.get("n"), "header.n", limits)
    if payload_length > limits.max_payload_bytes:
        raise FrameTooLarge(
            f"payload of {payload_length} bytes is over the limit of {limits.max_payload_bytes}"
        )
    if payload_length and not schema.payload:
        raise MalformedFrame(f"{message_type} carries no payload")
    fields = schema.check(header.get("f", {}), message_type, limits)
    return Header(message_type, fields, request_id, reply_to, payload_length)
