"""The stream of frames on a bulk lane in clear, parsed without I/O.

A lane carries frames in the :mod:`peer.wire` layout (u32 header length, msgpack header, raw
payload) back to back. :class:`LaneReader` is fed the bytes as the socket gives them, through
the same calls as :class:`~peer.transport.secure.LaneOpener` (the sealed stream): the lane
receives into :meth:`LaneReader.buffer`, reports how many bytes came with
:meth:`LaneReader.received`, and takes frames with :meth:`LaneReader.next_frame`. A payload
is received straight into a buffer of its size (``take``), so nothing is copied but the few
bytes read ahead with a header. Every malformed input is a
:class:`~peer.exceptions.ProtocolError`; a lane closes on the first.
"""

from __future__ import annotations

from collections.abc import Callable

from peer.wire import (
    LENGTH_BYTES,
    Frame,
    Header,
    Limits,
    MessageRegistry,
    decode_header,
    decode_length,
)

__all__ = ["LaneReader"]


class LaneReader:
    """Parses one direction of a lane in clear into frames (no I/O)."""

    _READ_AHEAD = 4096  # bytes read while looking for a header (what follows is copied once)

    def __init__(
        self,
        registry: MessageRegistry,
        limits: Limits,
        *,
        check: Callable[[Header], None],  # raises ProtocolError for a header not allowed
        take: Callable[[int], memoryview],  # a writable buffer for a payload of that size
    ) -> None:
        self._registry = registry
        self._limits = limits
        self._check = check
        self._take = take
        self._staging = bytearray(self._READ_AHEAD)
        self._have = 0  # bytes in the staging buffer
        self._pos = 0  # of which those before this offset are parsed
        self._head: Header | None = None  # header of the frame whose payload is arriving
        self._payload: memoryview | None = None
        self._got = 0  # bytes of that payload received

    @property
    def in_payload(self) -> bool:
        return self._payload is not None

    def _header_size(self) -> int:
        """Bytes of the next frame's length and header (0 while its length is not known)."""
        if self._have - self._pos < LENGTH_BYTES:
            return 0
        start = self._pos
        view = memoryview(self._staging)[start : start + LENGTH_BYTES]
        return LENGTH_BYTES + decode_length(view, self._limits)

    @property
    def pending(self) -> bool:
        """Whether :meth:`next_frame` has something to do without more bytes."""
        if self._payload is not None:
            return self._got == len(self._payload)
        header = self._header_size()
        return bool(header) and self._have - self._pos >= header

    def buffer(self) -> memoryview:
        """Where the next bytes from the socket go (at most as many as are useful now)."""
        payload = self._payload
        if payload is not None:
            return payload[self._got :]
        pos, have = self._pos, self._have
        if pos:  # what is left of the headers parsed moves to the front (a partial one)
            self._staging[: have - pos] = self._staging[pos:have]
            self._have, self._pos = have - pos, 0
        header = self._header_size()
        if max(header, self._have + 1) > len(self._staging):  # a large header: whole
            grown = bytearray(max(header, self._have) + self._READ_AHEAD)
            grown[: self._have] = self._staging[: self._have]
            self._staging = grown
        return memoryview(self._staging)[self._have :]

    def wanted(self) -> int:
        """Bytes still missing from the payload being read (1 when reading headers): a
        socket may wait for that many before waking its reader."""
        if self._payload is None:
            return 1
        return max(1, len(self._payload) - self._got)

    def received(self, n: int) -> None:
        """Take ``n`` bytes written into :meth:`buffer` (then :meth:`next_frame`)."""
        if self._payload is not None:
            self._got += n
        else:
            self._have += n

    def next_frame(self) -> Frame | None:
        """The next frame the bytes received so far complete, or None. Raises a
        :class:`~peer.exceptions.ProtocolError` for bytes that break the protocol."""
        payload = self._payload
        if payload is not None:
            if self._got < len(payload):
                return None
            head, self._head, self._payload = self._head, None, None
            assert head is not None
            return Frame(head.type, head.fields, payload)
        header = self._header_size()
        if not header or self._have - self._pos < header:
            return None
        start = self._pos
        view = memoryview(self._staging)
        head = decode_header(
            view[start + LENGTH_BYTES : start + header], self._registry, self._limits
        )
        self._check(head)
        self._pos = start + header
        size = head.payload_length
        if not size:
            return Frame(head.type, head.fields, b"")
        # what was read ahead of the payload goes in first; the rest comes straight in
        payload = self._take(size)
        spilled = min(self._have - self._pos, size)
        payload[:spilled] = view[self._pos : self._pos + spilled]
        self._pos += spilled
        if spilled < size:
            self._head, self._payload, self._got = head, payload, spilled
            return None
        return Frame(head.type, head.fields, payload)
