"""Wire format: round trips, and every kind of malformed input rejected with a typed error."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.exceptions import (
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    UnknownMessageType,
    UnsupportedVersion,
)
from peer.wire import (
    BYTES,
    INT,
    PROTOCOL_VERSION,
    STR,
    Frame,
    Limits,
    ListOf,
    MessageRegistry,
    Schema,
    decode_frame,
    encode_frame,
    encode_header,
)


@pytest.fixture
def registry() -> MessageRegistry:
    reg = MessageRegistry()
    reg.register("ping", Schema(required={"n": INT}, optional={"note": STR}))
    reg.register("blob", Schema(required={"names": ListOf(STR)}, payload=True))
    return reg


def raw_frame(header: object, payload: bytes = b"") -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed + payload


def test_round_trip_with_payload(registry: MessageRegistry) -> None:
    frame = Frame("blob", {"names": ["a", "b"]}, b"\x00\x01\x02" * 100, request_id=7)
    decoded = decode_frame(encode_frame(frame), registry)
    assert decoded.type == "blob"
    assert decoded.fields == {"names": ["a", "b"]}
    assert bytes(decoded.payload) == bytes(frame.payload)
    assert decoded.request_id == 7 and decoded.reply_to == 0


def test_header_and_payload_fragments_equal_the_whole(registry: MessageRegistry) -> None:
    frame = Frame("blob", {"names": []}, bytearray(b"xyz"))
    assert encode_header(frame) + b"xyz" == encode_frame(frame)


def test_optional_field_and_unknown_field(registry: MessageRegistry) -> None:
    ok = decode_frame(encode_frame(Frame("ping", {"n": 1, "note": "hi"})), registry)
    assert ok.fields["note"] == "hi"
    with pytest.raises(MalformedFrame, match="unknown field 'typo'"):
        decode_frame(encode_frame(Frame("ping", {"n": 1, "typo": 2})), registry)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "missing field 'n'"),
        ({"n": "one"}, "expected int, got str"),
        ({"n": -1}, "below 0"),
        ({"n": True}, "got bool"),
    ],
)
def test_field_validation(registry: MessageRegistry, fields: dict, message: str) -> None:
    with pytest.raises(MalformedFrame, match=message):
        decode_frame(raw_frame({"t": "ping", "v": PROTOCOL_VERSION, "n": 0, "f": fields}), registry)


def test_unknown_type(registry: MessageRegistry) -> None:
    with pytest.raises(UnknownMessageType, match="'nope'"):
        decode_frame(raw_frame({"t": "nope", "v": PROTOCOL_VERSION, "n": 0, "f": {}}), registry)


def test_wrong_version(registry: MessageRegistry) -> None:
    with pytest.raises(UnsupportedVersion, match="version 99"):
        decode_frame(raw_frame({"t": "ping", "v": 99, "n": 0, "f": {"n": 1}}), registry)


def test_truncated_header(registry: MessageRegistry) -> None:
    data = encode_frame(Frame("ping", {"n": 1}))
    with pytest.raises(MalformedFrame, match="truncated"):
        decode_frame(data[:-3], registry)
    with pytest.raises(MalformedFrame, match="shorter than its length prefix"):
        decode_frame(data[:2], registry)


def test_payload_length_mismatch_and_unexpected_payload(registry: MessageRegistry) -> None:
    with pytest.raises(MalformedFrame, match="header says 10"):
        decode_frame(
            raw_frame({"t": "blob", "v": PROTOCOL_VERSION, "n": 10, "f": {"names": []}}, b"abc"),
            registry,
        )
    with pytest.raises(MalformedFrame, match="carries no payload"):
        decode_frame(
            raw_frame({"t": "ping", "v": PROTOCOL_VERSION, "n": 3, "f": {"n": 1}}, b"abc"), registry
        )


def test_limits(registry: MessageRegistry) -> None:
    limits = Limits(max_header_bytes=64, max_payload_bytes=16)
    with pytest.raises(FrameTooLarge):
        encode_frame(Frame("blob", {"names": []}, b"x" * 17), limits)
    with pytest.raises(FrameTooLarge):
        decode_frame(
            raw_frame({"t": "blob", "v": PROTOCOL_VERSION, "n": 17, "f": {"names": []}}, b"x" * 17),
            registry,
            limits,
        )
    with pytest.raises(FrameTooLarge, match="header of"):
        decode_frame(
            raw_frame(
                {"t": "ping", "v": PROTOCOL_VERSION, "n": 0, "f": {"n": 1, "note": "y" * 100}}
            ),
            registry,
            limits,
        )
    # A length prefix claiming a huge header is refused before anything is allocated.
    with pytest.raises(FrameTooLarge):
        decode_frame(struct.pack(">I", 2**31) + b"\x80", registry, limits)


def test_not_a_map_and_bad_msgpack(registry: MessageRegistry) -> None:
    with pytest.raises(MalformedFrame, match="must be a msgpack map"):
        decode_frame(raw_frame([1, 2, 3]), registry)
    with pytest.raises(MalformedFrame, match="not valid msgpack"):
        decode_frame(struct.pack(">I", 2) + b"\xc1\xc1", registry)


def test_extension_types_are_refused(registry: MessageRegistry) -> None:
    packed = msgpack.packb(
        {"t": "ping", "v": PROTOCOL_VERSION, "n": 0, "f": {"n": msgpack.ExtType(1, b"x")}}
    )
    with pytest.raises(ProtocolError):
        decode_frame(struct.pack(">I", len(packed)) + packed, registry)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_protocol_errors(data: bytes) -> None:
    reg = MessageRegistry()
    reg.register("ping", Schema(required={"n": INT}))
    reg.register("blob", Schema(required={"b": BYTES}, payload=True))
    try:
        decode_frame(data, reg)
    except ProtocolError:
        pass


header_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["t", "v", "i", "r", "n", "f", "x"]), header_values, max_size=7
    ),
    st.binary(max_size=16),
)
def test_arbitrary_headers_only_ever_raise_protocol_errors(header: dict, payload: bytes) -> None:
    reg = MessageRegistry()
    reg.register("ping", Schema(required={"n": INT}, optional={"s": STR}))
    try:
        frame = decode_frame(raw_frame(header, payload), reg)
    except ProtocolError:
        return
    assert frame.type == "ping" and isinstance(frame.fields["n"], int)
