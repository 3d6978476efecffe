"""Fuzzing the bulk lanes' streams, fed bytes without a socket: the frames a lane in clear
(:class:`LaneReader`) or sealed (:class:`LaneOpener`) parses out of mutated streams, cut at
random into the pieces a socket would give. Every input ends in the frames sent (when it was
not altered), in frames that passed the checks, or in a typed refusal: never another
exception, and never a stall (a buffer with no room, which a lane would take for a closed
socket). Same knobs as tests/peer/test_fuzz.py: ``SWARMGRAD_FUZZ_INPUTS`` streams per
message type and mode, ``SWARMGRAD_FUZZ_SEED``."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest

from peer.averaging.protocol import ABORT, AVERAGE, JOIN, PART, STATE_BEGIN, STATE_CHUNK
from peer.exceptions import ProtocolError
from peer.transport.lane_stream import LaneReader
from peer.transport.secure import LaneOpener, LaneSealer
from peer.wire import Frame, Header, Limits, encode_frame, encode_header
from tests.peer.test_fuzz import TYPED, full_registry, mutate_bytes, mutated_input, seed_frame

INPUTS = int(os.environ.get("SWARMGRAD_FUZZ_INPUTS", "10000"))
SEED = int(os.environ.get("SWARMGRAD_FUZZ_SEED", "0"))
LANE_TYPES = [PART, AVERAGE]  # what averaging sends on lanes
OTHER_TYPES = [ABORT, JOIN, STATE_BEGIN, STATE_CHUNK]
# small limits: a mutated length asks for at most this much memory
LIMITS = Limits(max_header_bytes=64 << 10, max_payload_bytes=1 << 20)
KEY = bytes(range(32))

Stream = LaneReader | LaneOpener


def _check(head: Header) -> None:  # what a lane accepts (see peer.transport.lane_protocol)
    if head.type not in LANE_TYPES or head.request_id or head.reply_to:
        raise ProtocolError(f"{head.type!r} is not accepted on a bulk lane")


def _take(size: int) -> memoryview:
    return memoryview(bytearray(size))


def _reader() -> LaneReader:
    return LaneReader(full_registry(), LIMITS, check=_check, take=_take)


def _opener() -> LaneOpener:
    return LaneOpener(KEY, full_registry(), LIMITS, check=_check, take=_take)


def _sealed(frames: list[Frame]) -> bytes:
    sealer = LaneSealer(KEY)
    out = bytearray()
    for frame in frames:
        payload = memoryview(frame.payload).cast("B")
        for batch in sealer.seal(encode_header(frame), payload):
            for view in batch:
                out += view
    return bytes(out)


def feed(stream: Stream, data: bytes, rng: random.Random) -> list[Frame]:
    """Give ``data`` to ``stream`` as a socket would, in pieces of random sizes; the frames
    it hands out. Raises what the stream raises."""
    frames: list[Frame] = []
    pos = 0
    while True:
        while (frame := stream.next_frame()) is not None:
            frames.append(frame)
        if pos == len(data):
            return frames
        view = stream.buffer()
        assert len(view) > 0, "no room for the next bytes: a lane would stall"
        n = min(len(view), len(data) - pos, rng.choice((1, 7, 64, 4096, 1 << 20)))
        view[:n] = data[pos : pos + n]
        del view
        stream.received(n)
        pos += n


def _valid_frame(message_type: str, rng: random.Random) -> Frame:
    frame = seed_frame(message_type, full_registry(), rng)
    size = rng.choice((0, 1, 100, 5000, 70_000))
    payload = rng.randbytes(size) if size else bytes(frame.payload)
    return Frame(frame.type, frame.fields, payload)


def _same(got: list[Frame], sent: list[Frame]) -> bool:
    return [(f.type, f.fields, bytes(f.payload)) for f in got] == [
        (f.type, f.fields, bytes(f.payload)) for f in sent
    ]


def _run(message_type: str, make: Callable[[], Stream], sealed: bool) -> tuple[int, int]:
    rng = random.Random(f"{SEED}-{message_type}-{sealed}")
    refused = intact = 0
    for _ in range(INPUTS):
        sent = [_valid_frame(message_type, rng) for _ in range(rng.randrange(1, 4))]
        foreign = rng.random() < 0.05
        if foreign:  # a valid frame that lanes do not carry: another type, or a request
            i = rng.randrange(len(sent))
            other = seed_frame(rng.choice(OTHER_TYPES), full_registry(), rng)
            if rng.random() < 0.5:
                other = Frame(sent[i].type, sent[i].fields, sent[i].payload, request_id=1)
            sent[i] = other
        if sealed:
            data = _sealed(sent)
            altered = rng.random() < 0.9
            if altered:
                data = mutate_bytes(data, rng)
        else:
            altered = rng.random() < 0.9
            if altered:  # a frame's fields, envelope, payload or bytes, or the stream's
                i = rng.randrange(len(sent))
                parts = [encode_frame(f, LIMITS) for f in sent]
                parts[i] = mutated_input(message_type, full_registry(), rng)
                data = b"".join(parts)
                if rng.random() < 0.3:
                    data = mutate_bytes(data, rng)
            else:
                data = b"".join(encode_frame(f, LIMITS) for f in sent)
        try:
            got = feed(make(), data, rng)
        except TYPED:
            refused += 1
            assert altered or foreign, "an intact stream was refused"
            continue
        assert altered or not foreign, "a frame lanes do not carry was accepted"
        if not altered or _same(got, sent):
            assert _same(got, sent), "an intact stream gave other frames"
            intact += 1
        for frame in got:
            assert frame.type in LANE_TYPES and not frame.request_id and not frame.reply_to
            assert len(frame.payload) <= LIMITS.max_payload_bytes
        if sealed and altered:
            # what the keys did not seal is refused; a cut stream gives a prefix at most
            assert len(got) <= len(sent) and _same(got, sent[: len(got)])
    return refused, intact


@pytest.mark.parametrize("message_type", LANE_TYPES)
def test_a_clear_lane_parses_or_refuses_every_stream(message_type: str) -> None:
    refused, intact = _run(message_type, _reader, sealed=False)
    # the run tried both sides: streams refused, and streams that came through whole
    assert refused > INPUTS // 10 and intact > INPUTS // 20, (refused, intact)


@pytest.mark.parametrize("message_type", LANE_TYPES)
def test_a_sealed_lane_opens_only_what_was_sealed(message_type: str) -> None:
    refused, intact = _run(message_type, _opener, sealed=True)
    assert refused > INPUTS // 2 and intact > INPUTS // 20, (refused, intact)


def test_a_header_larger_than_the_read_ahead_and_a_payload_in_single_bytes() -> None:
    """The paths a random stream rarely takes: a header that does not fit the read-ahead
    buffer, and a payload arriving one byte at a time, then the next frame in the same
    piece as the end of the payload."""
    rng = random.Random(0)
    large = {**seed_frame(PART, full_registry(), rng).fields, "c": {"pad": b"x" * 9000}}
    frames = [
        Frame(PART, large, b"\x01" * 300),
        Frame(AVERAGE, seed_frame(AVERAGE, full_registry(), rng).fields, b""),
    ]
    data = b"".join(encode_frame(f, LIMITS) for f in frames)
    for make in (_reader, _opener):
        stream = make()
        raw = data if make is _reader else _sealed(frames)
        got = feed(stream, raw, random.Random(1))
        assert _same(got, frames)
        one_byte = random.Random(2)
        one_byte.choice = lambda options: 1  # type: ignore[method-assign]
        assert _same(feed(make(), raw, one_byte), frames)
