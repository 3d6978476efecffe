"""Fuzzing what peers send each other: every message type a node and its averagers accept,
as frames mutated at random from valid ones, then through the parser each field goes to.
No input may crash or raise anything but the typed errors the handlers turn into a refusal.

Seeded and plain (no coverage guidance), so that it is fast and the same on every run:
``SWARMGRAD_FUZZ_INPUTS`` inputs per message type (10,000 by default). A longer run, with
another seed::

    SWARMGRAD_FUZZ_INPUTS=1000000 SWARMGRAD_FUZZ_SEED=7 .venv/bin/pytest tests/peer/test_fuzz.py
"""

from __future__ import annotations

import functools
import os
import random
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch

from peer.averaging.matchmaking.machine import Declaration, GroupInfo
from peer.averaging.protocol import (
    ABORT,
    AVERAGE,
    JOIN,
    JOIN_REPLY,
    NOTICE,
    PART,
    STATE_BEGIN,
    STATE_CHUNK,
    STATE_DATA,
    STATE_INFO,
    Router,
    decode_declaration,
    decode_notice,
    decode_response,
    encode_declaration,
    encode_group,
)
from peer.averaging.sharing.download import parse_state_info
from peer.compression import (
    CompressedTensor,
    CompressionError,
    Float16Compression,
    NoCompression,
    extract,
    plain_values,
)
from peer.exceptions import AuthenticationError, ProtocolError
from peer.formats.identity import Certificate, Identity
from peer.formats.revocation import RevocationList
from peer.node.core import AsyncNode
from peer.node.gossip import GossipStore, Record
from peer.transport.memory import MemoryNetwork
from peer.wire import (
    AnyValue,
    Frame,
    ListOf,
    MessageRegistry,
    Optional,
    Scalar,
    Spec,
    Tuple,
    decode_frame,
    encode_frame,
)

INPUTS = int(os.environ.get("SWARMGRAD_FUZZ_INPUTS", "10000"))
SEED = int(os.environ.get("SWARMGRAD_FUZZ_SEED", "0"))
# What a handler turns into a refusal of the frame (and, for a peer, the link); anything
# else escaping a parser is a bug. (RecordError is a ValueError.)
TYPED = (ProtocolError, ValueError, CompressionError, AuthenticationError)

AUTHORITY, PEER = Identity(), Identity()
CERTIFICATE = Certificate.issue(
    AUTHORITY, run_id="run", public_key=PEER.public_key, expires_at=2e9
).to_bytes()
DECLARATION = encode_declaration(
    Declaration("run.avg.0", PEER.peer_id, 10.0, b"h" * 8, False, 3, 20.0)
)
GROUP = encode_group(
    GroupInfo(
        b"g" * 16, "run.avg.0", PEER.peer_id, (PEER.peer_id, "x" * 32), (b"", b"m"), (False, True)
    )
)
RECORD = Record.create(PEER, "run.progress", PEER.peer_id, [3, 64, 1.5], 2e9, seq=5).to_wire()
TENSOR = torch.linspace(-1, 1, 6)


def _compressed(codec: Any) -> tuple[dict[str, Any], bytes]:
    header, payload = codec.compress(TENSOR).to_wire()
    return header, bytes(memoryview(payload).cast("B"))


PLAIN, HALF = _compressed(NoCompression()), _compressed(Float16Compression())

# Realistic values for the free-form (AnyValue) fields and the bytes fields with a format
# of their own; the others are made from their schema.
FIELD_SEEDS: dict[tuple[str, str], list[Any]] = {
    (JOIN, "d"): [DECLARATION],
    (JOIN_REPLY, "d"): [DECLARATION],
    (NOTICE, "g"): [GROUP],
    (NOTICE, "d"): [DECLARATION],
    (NOTICE, "k"): ["assembled", "disbanded", "leave"],
    (JOIN_REPLY, "s"): ["accepted", "refused", "redirected"],
    (PART, "c"): [PLAIN[0], HALF[0]],
    (AVERAGE, "c"): [PLAIN[0], HALF[0]],
    (STATE_INFO, "x"): [[[PLAIN[0], len(PLAIN[1])]]],
    (STATE_INFO, "m"): [msgpack.packb({"epoch": 3}, use_bin_type=True)],
    ("gossip.push", "records"): [[RECORD]],
    ("gossip.reply", "records"): [[RECORD]],
    ("gossip.push", "certs"): [[[PEER.public_key, CERTIFICATE]]],
    ("gossip.reply", "certs"): [[[PEER.public_key, CERTIFICATE]]],
    ("link.credential", "credential"): [CERTIFICATE],
    ("hello", "credential"): [CERTIFICATE, b""],
    ("link.revocations", "list"): [
        RevocationList.issue(
            AUTHORITY, run_id="run", serial=4, entries=[(PEER.public_key, 2e9)]
        ).to_bytes()
    ],
}
PAYLOAD_SEEDS: dict[str, list[bytes]] = {
    PART: [PLAIN[1], HALF[1]],
    AVERAGE: [PLAIN[1], HALF[1]],
    STATE_DATA: [PLAIN[1]],
    "gossip.digest": [GossipStore(max_ttl=60).digest(0.0), b"\x00" * 24],
}


def _store_compare(payload: Any) -> None:
    store = GossipStore(max_ttl=60)
    store.put(Record.from_wire(RECORD), 0.0)
    store.compare(payload, 0.0)


def _tensor(frame: Frame) -> None:
    values = plain_values(frame.fields.get("c"), frame.payload, torch.float32)
    if values is None:
        extract(CompressedTensor.from_wire(frame.fields.get("c"), frame.payload))


def _records(frame: Frame) -> None:
    for item in frame.fields["records"]:
        Record.from_wire(item).verify()
    for _, certificate in frame.fields.get("certs", ()):
        Certificate.from_bytes(certificate)


def _state_info(frame: Frame) -> None:
    _, items, _ = parse_state_info(frame.fields, 1 << 20)
    for header, nbytes in items:
        CompressedTensor.from_wire(header, b"\x00" * nbytes)


# Where each message type's fields go after the frame decodes.
PARSERS: dict[str, Callable[[Frame], object]] = {
    JOIN: lambda f: decode_declaration(f.fields["d"]),
    JOIN_REPLY: lambda f: decode_response("peer", f),
    NOTICE: lambda f: decode_notice("peer", f),
    PART: _tensor,
    AVERAGE: _tensor,
    STATE_INFO: _state_info,
    "gossip.push": _records,
    "gossip.reply": _records,
    "gossip.digest": lambda f: _store_compare(f.payload),
    "link.credential": lambda f: Certificate.from_bytes(f.fields["credential"]),
    "hello": lambda f: f.fields["credential"] and Certificate.from_bytes(f.fields["credential"]),
    "link.revocations": lambda f: RevocationList.from_bytes(f.fields["list"]),
}


@functools.cache
def full_registry() -> MessageRegistry:
    """Every message type a node with averagers accepts (built once: parsing only reads it)."""
    node = AsyncNode(transport=MemoryNetwork().transport("fuzz"))
    Router.of(node)
    return node.registry


# ----------------------------------------------------------------------------- values


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack value, weighted to the edges that break parsers."""
    roll = rng.random()
    if depth < 3 and roll < 0.15:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 3 and roll < 0.25:
        return {
            rng.choice(["k", "id", "s", "h", "c", "r", "d", "p", "g", "shape", "meta", "codec"]): (
                random_value(rng, depth + 1)
            )
            for _ in range(rng.randrange(5))
        }
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            -1,
            1,
            2**31,
            2**63 - 1,
            -(2**63),
            2**64 - 1,
            rng.randrange(-1000, 1000),
            0.5,
            -0.0,
            float("nan"),
            float("inf"),
            -float("inf"),
            1e308,
            "",
            "x" * rng.randrange(40),
            "none",
            "float16",
            "float32",
            b"",
            bytes(rng.randrange(256) for _ in range(rng.randrange(40))),
        ]
    )


def valid_value(spec: Spec, rng: random.Random) -> Any:
    if isinstance(spec, Scalar):
        kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
        kind = rng.choice(kinds)
        limit = min(spec.max_length or 32, 32)
        if kind is bool:
            return rng.random() < 0.5
        if kind is int:
            return max(int(spec.min_value or 0), rng.randrange(0, 100))
        if kind is float:
            return max(spec.min_value or 0.0, rng.random() * 10)
        if kind is str:
            return "".join(rng.choice("abc.0") for _ in range(rng.randrange(limit + 1)))
        if kind is bytes:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(limit + 1)))
        return None
    if isinstance(spec, ListOf):
        n = spec.exact_length if spec.exact_length is not None else rng.randrange(3)
        return [valid_value(spec.item, rng) for _ in range(n)]
    if isinstance(spec, Tuple):
        return [valid_value(s, rng) for s in spec.items]
    if isinstance(spec, Optional):
        return None if rng.random() < 0.3 else valid_value(spec.inner, rng)
    assert isinstance(spec, AnyValue)
    return random_value(rng)


def seed_frame(message_type: str, registry: MessageRegistry, rng: random.Random) -> Frame:
    schema = registry.schema(message_type)
    fields = {}
    for specs, always in ((schema.required, True), (schema.optional, False)):
        for name, spec in specs.items():
            if always or rng.random() < 0.5:
                seeds = FIELD_SEEDS.get((message_type, name))
                fields[name] = rng.choice(seeds) if seeds else valid_value(spec, rng)
    payload = b""
    if schema.payload:
        payload = rng.choice(PAYLOAD_SEEDS.get(message_type, [b"", b"\x01\x02\x03\x04"]))
    return Frame(message_type, fields, payload, rng.randrange(3), rng.randrange(3))


def mutate_value(value: Any, rng: random.Random) -> Any:
    """The value with one leaf replaced, a key dropped or added, or a list cut or grown."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        out = dict(value)
        key = rng.choice(list(out))
        roll = rng.random()
        if roll < 0.2:
            del out[key]
        elif roll < 0.3:
            out[rng.choice(["z", "codec", "k", "shape"])] = random_value(rng)
        else:
            out[key] = mutate_value(out[key], rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.8:
        out_list = list(value)
        roll = rng.random()
        if roll < 0.15:
            out_list.pop(rng.randrange(len(out_list)))
        elif roll < 0.3:
            out_list.append(rng.choice(out_list) if rng.random() < 0.5 else random_value(rng))
        else:
            i = rng.randrange(len(out_list))
            out_list[i] = mutate_value(out_list[i], rng)
        return out_list
    if isinstance(value, bytes) and value and rng.random() < 0.7:
        return mutate_bytes(value, rng)
    return random_value(rng)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        roll = rng.random()
        if roll < 0.4 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif roll < 0.6 and buf:
            del buf[rng.randrange(len(buf)) :]
        elif roll < 0.8:
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif buf:
            i = rng.randrange(len(buf))
            buf[i:i] = buf[i : i + rng.randrange(1, 16)]
    return bytes(buf)


def mutated_input(message_type: str, registry: MessageRegistry, rng: random.Random) -> bytes:
    frame = seed_frame(message_type, registry, rng)
    roll = rng.random()
    if roll < 0.45 and frame.fields:  # a field's value
        fields = dict(frame.fields)
        name = rng.choice(list(fields))
        fields[name] = mutate_value(fields[name], rng)
        frame = Frame(frame.type, fields, frame.payload, frame.request_id, frame.reply_to)
    elif roll < 0.55:  # a field too many or too few
        fields = dict(frame.fields)
        if fields and rng.random() < 0.5:
            del fields[rng.choice(list(fields))]
        else:
            fields[rng.choice(["x", "zz", "p", "t"])] = random_value(rng)
        frame = Frame(frame.type, fields, frame.payload, frame.request_id, frame.reply_to)
    elif roll < 0.65 and frame.payload:  # the payload
        frame = Frame(frame.type, frame.fields, mutate_bytes(bytes(frame.payload), rng))
    header = {
        "t": frame.type,
        "v": 1,
        "i": frame.request_id,
        "r": frame.reply_to,
        "n": len(frame.payload),
        "f": dict(frame.fields),
    }
    if roll >= 0.65 and roll < 0.75:  # the envelope
        key = rng.choice(list(header))
        header[key] = mutate_value(header[key], rng)
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return encode_frame(Frame(message_type, seed_frame(message_type, registry, rng).fields))
    data = struct.pack(">I", len(packed)) + packed + bytes(frame.payload)
    if roll >= 0.75 and roll < 0.9:  # the bytes on the wire
        data = mutate_bytes(data, rng)
    return data


# ----------------------------------------------------------------------------- the runs


def _types() -> list[str]:
    return sorted(full_registry()._schemas)


def test_every_accepted_message_type_has_a_seed() -> None:
    """A new message type joins the fuzz run: a free-form field needs its seeds here."""
    registry = full_registry()
    missing = [
        (t, name)
        for t in _types()
        for schema in (registry.schema(t),)
        for name, spec in {**schema.required, **schema.optional}.items()
        if isinstance(spec, AnyValue) and (t, name) not in FIELD_SEEDS
    ]
    assert missing == [], "give these free-form fields realistic seeds in FIELD_SEEDS"
    assert {JOIN, NOTICE, PART, AVERAGE, ABORT, STATE_BEGIN, STATE_CHUNK, "hello"} <= set(_types())


@pytest.mark.parametrize("message_type", _types())
def test_mutated_frames_are_parsed_or_refused_with_a_typed_error(message_type: str) -> None:
    registry = full_registry()
    rng = random.Random(f"{SEED}:{message_type}")
    parse = PARSERS.get(message_type)
    decoded = parsed = 0
    for _ in range(INPUTS):
        data = mutated_input(message_type, registry, rng)
        try:
            frame = decode_frame(data, registry)
            decoded += 1
            if parse is not None and frame.type == message_type:
                parse(frame)
            parsed += 1
        except TYPED:
            pass
        except Exception as exc:  # the finding: a crash a peer could cause
            raise AssertionError(
                f"{message_type}: {type(exc).__name__}: {exc} on input {data.hex()}"
            ) from exc
    # the run tried both sides: inputs that decode (and parse) and inputs that are refused
    assert 0 < decoded < INPUTS and parsed > 0, (decoded, parsed)
