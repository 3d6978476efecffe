"""State download: a newcomer fetches ``(metadata, tensors)`` from a peer that has them.

Donors run a :class:`StateServer` and declare themselves in gossip under
``f"{prefix}.all_averagers"`` (:func:`state_key`; subkey: peer id, value:
``state_sharing_priority``; ``None`` retracts), refreshed every ``declare_state_period / 2``
and expiring after ``declare_state_period``. A newcomer calls :func:`download_state`, which
tries donors one at a time (highest priority first, random order among equal ones) and
judges each state by other donors (:mod:`peer.averaging.sharing.witnesses`) before it is used.
``docs/averaging.md`` ("State download") describes the whole exchange.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from peer.averaging.protocol import (
    STATE_BEGIN,
    STATE_CHUNK,
    STATE_DATA,
    STATE_HASH,
    STATE_INFO,
)
from peer.averaging.seam import Link, NodeCore
from peer.averaging.sharing.witnesses import Refusals, judge, witness_of
from peer.compression import CompressedTensor, Compression, CompressionError, extract
from peer.exceptions import SwarmgradError
from peer.formats.identity import is_peer_id
from peer.wire import Frame

logger = logging.getLogger("peer.averaging.state")

__all__ = ["CORROBORATORS", "StateServer", "download_state", "state_digest", "state_key"]

#: a transfer idle this long is dropped by the donor
_TRANSFER_TTL = 60.0
_MAX_TRANSFERS = 4
_WINDOW = 4  # chunk requests in flight
_MAX_STATE_BYTES = 1 << 40
#: other donors asked to check a downloaded state against theirs
CORROBORATORS = 3


def state_digest(wires: Sequence[tuple[Any, Any]]) -> bytes:
    """The digest of a state in its wire form: each tensor's compressed header and payload."""
    digest = hashlib.blake2b(digest_size=32)
    for header, payload in wires:
        packed = msgpack.packb(header, use_bin_type=True)
        data = memoryview(payload).cast("B")
        digest.update(len(packed).to_bytes(8, "big") + packed + data.nbytes.to_bytes(8, "big"))
        digest.update(data)
    return digest.digest()


def state_key(prefix: str) -> str:
    return f"{prefix}.all_averagers"


@dataclass
class _Transfer:
    buffer: bytearray
    chunk_bytes: int
    last_used: float
    served: set[int] = field(default_factory=set)

    @property
    def num_chunks(self) -> int:
        return max(1, math.ceil(len(self.buffer) / self.chunk_bytes))


class StateServer:
    """The donor side: answers ``avg.state_begin`` and ``avg.state_chunk``.

    The transfer:

    1. ``avg.state_begin`` → ``avg.state_info``: the donor snapshots ``get_current_state()``,
       compresses each tensor with ``state_compression`` and copies the payloads into one
       buffer (a snapshot: the donor may keep training). The reply carries a transfer id, the
       msgpack metadata, each tensor's compressed header and byte length, the chunk size and
       the chunk count.
    2. ``avg.state_chunk`` (``i`` = 0 … n-1) → ``avg.state_data`` with the chunk's bytes; a few
       requests are kept in flight so the stream does not wait a round trip per chunk.
    """

    def __init__(
        self,
        get_state: Callable[[], tuple[Any, Sequence[torch.Tensor]]],
        compression: Compression,
        chunk_bytes: int,
        lock: Callable[[], Any],
    ) -> None:
        self.get_state = get_state
        self.compression = compression
        self.chunk_bytes = max(1, chunk_bytes)
        self.lock = lock  # async context manager factory guarding the tensors
        self._transfers: dict[int, _Transfer] = {}
        self._ids = itertools.count(1)
        self._digesting = 0

    def _snapshot(self) -> tuple[Any, list[tuple[Any, Any]]]:
        """``(metadata, wire forms of the tensors)``: call with the tensors locked."""
        metadata, tensors = self.get_state()
        compressed = [self.compression.compress(t.detach().cpu()) for t in tensors]
        return metadata, [c.to_wire() for c in compressed]

    async def digest(self) -> bytes:
        """The digest of the state this peer would serve now (takes the lock)."""
        async with self.lock():
            _, wires = self._snapshot()
            return state_digest(wires)

    async def on_digest(self, link: Link, frame: Frame, priority: float) -> Frame:
        """The digest of the state this peer would serve now, and its priority."""
        if self._digesting >= _MAX_TRANSFERS:
            raise ValueError("too many state digests in progress")
        self._digesting += 1
        try:
            digest = await self.digest()
        finally:
            self._digesting -= 1
        return Frame(STATE_HASH, {"e": priority, "d": digest})

    async def on_begin(self, link: Link, frame: Frame) -> Frame:
        now = asyncio.get_running_loop().time()
        for tid, transfer in list(self._transfers.items()):
            if now - transfer.last_used > _TRANSFER_TTL:
                del self._transfers[tid]
        if len(self._transfers) >= _MAX_TRANSFERS:
            raise ValueError("too many state downloads in progress; try another donor")
        async with self.lock():
            metadata, wires = self._snapshot()
            total = sum(memoryview(payload).nbytes for _, payload in wires)
            buffer = bytearray(total)
            offset = 0
            for _, payload in wires:
                view = memoryview(payload).cast("B")
                buffer[offset : offset + view.nbytes] = view
                offset += view.nbytes
        transfer = _Transfer(buffer, self.chunk_bytes, now)
        tid = next(self._ids)
        self._transfers[tid] = transfer
        return Frame(
            STATE_INFO,
            {
                "t": tid,
                "m": msgpack.packb(metadata, use_bin_type=True),
                "x": [[header, memoryview(payload).nbytes] for header, payload in wires],
                "n": transfer.num_chunks,
                "b": transfer.chunk_bytes,
            },
        )

    async def on_chunk(self, link: Link, frame: Frame) -> Frame:
        tid, index = frame.fields["t"], frame.fields["i"]
        transfer = self._transfers.get(tid)
        if transfer is None or index >= transfer.num_chunks:
            raise ValueError("no such state transfer or chunk")
        transfer.last_used = asyncio.get_running_loop().time()
        transfer.served.add(index)
        if len(transfer.served) == transfer.num_chunks:
            del self._transfers[tid]
        start = index * transfer.chunk_bytes
        return Frame(
            STATE_DATA, payload=memoryview(transfer.buffer)[start : start + transfer.chunk_bytes]
        )


async def list_donors(
    core: NodeCore, prefix: str, prefer: frozenset[str] = frozenset()
) -> list[tuple[float, str]]:
    """``(priority, peer_id)`` of the declared donors other than this peer, best first
    (among equal priorities those in ``prefer`` first, in random order)."""
    entry = await core.get(state_key(prefix), latest=True)
    donors = []
    if entry is not None and isinstance(entry.value, dict):
        for subkey, item in entry.value.items():
            priority = getattr(item, "value", None)
            if (
                subkey == core.peer_id
                or not is_peer_id(subkey)  # "0", an upper-cased id: slots no peer owns
                or isinstance(priority, bool)
                or not isinstance(priority, int | float)
                or not math.isfinite(priority)
            ):
                continue
            donors.append((float(priority), random.random(), subkey))
    donors.sort(key=lambda d: (-d[0], d[2] not in prefer, d[1]))
    return [(priority, peer_id) for priority, _, peer_id in donors]


async def download_state(
    core: NodeCore,
    prefix: str,
    *,
    request_timeout: float,
    chunk_timeout: float,
    max_bytes: int = _MAX_STATE_BYTES,
    max_priority: float = math.inf,
    min_priority: float = -math.inf,
    check: Callable[[Any], str | None] | None = None,
    own: bytes | None = None,
    partners: frozenset[str] = frozenset(),
    refusals: Refusals | None = None,
    prefer: frozenset[str] = frozenset(),
) -> tuple[Any, list[torch.Tensor], str] | None:
    """Download from the best donor that works; ``(metadata, tensors, donor)`` or None.
    A donor announcing a state of more than ``max_bytes`` is skipped before anything is
    allocated, and one declaring a priority over ``max_priority`` before it is asked (the
    caller knows that no honest donor can be that far ahead), or under ``min_priority``
    (its state is no newer than this peer's). A state whose metadata ``check`` refuses (it
    returns why), or that the witnesses do not let this peer use, is dropped and the next
    donor tried (see below). ``own``: the digest of the state this peer holds
    and would replace (None: a newcomer, with nothing of its own to keep); ``partners``: the
    peers that began, with this peer, the round whose result it misses — their state at
    exactly ``min_priority`` extends this peer's own and is judged as a newcomer judges a
    state. ``refusals``:
    the donors refused so far, updated here (keep one per averager: the run). ``prefer``:
    donors asked first among those of equal priority (e.g. the peers of this peer's slab
    of the Moshpit grid, whose values its first round wants).

    A donor that fails to answer within ``next_chunk_timeout`` (or dies, or sends anything
    malformed) is abandoned and the next donor is tried from the start. Nothing is unpickled:
    metadata is msgpack, tensors are validated by :meth:`CompressedTensor.from_wire`.

    Checked against the swarm: a donor could serve any weights under any priority, so a state
    downloaded is judged by what other donors hold before it is used
    (:mod:`peer.averaging.sharing.witnesses`): a newcomer uses it unless other volunteers outvote
    it; a peer that holds a state of its own (``own``) replaces it only with a state another
    volunteer confirms. A donor outvoted once is not downloaded from again, and one whose state was
    refused is not asked again until it declares a higher priority. An outvoted donor whose verdict
    is contested (another volunteer declares its priority with another state: two forks of one
    stage, where neither claim is a lone one) is refused that way too.
    """
    refusals = Refusals() if refusals is None else refusals
    donors = await list_donors(core, prefix, prefer)
    # every donor of this peer's own invite (a run that shares one invite): no witness can
    # ever confirm a state, and the donors cannot be told from this peer itself; a holder
    # takes an unconfirmed state then as a newcomer does, rather than never catch up
    me = witness_of(core, core.peer_id)
    sole = me[0] == "invite" and {witness_of(core, d) for _, d in donors} == {me}
    for priority, donor in donors:
        if priority > max_priority:
            logger.warning(
                "donor %s declares a state of priority %g, over the %g this peer can "
                "believe; skipped",
                donor,
                priority,
                max_priority,
            )
            continue
        person = witness_of(core, donor)
        if priority < min_priority or refusals.refuses(person, priority):
            continue
        try:
            metadata, tensors, digest = await _download_from(
                core, prefix, donor, request_timeout, chunk_timeout, max_bytes
            )
        except (
            SwarmgradError,
            TimeoutError,
            ValueError,
            KeyError,
            TypeError,
            CompressionError,
            MemoryError,
        ) as exc:
            logger.warning(
                "state download from %s (priority %g) failed: %s; trying the next donor",
                donor,
                priority,
                exc or type(exc).__name__,
            )
            continue
        if own is not None and digest == own:
            continue  # the state this peer holds: nothing to load, nothing to reset
        refusal = check(metadata) if check is not None else None
        if refusal is not None:
            logger.warning(
                "state from %s (priority %g) refused: %s; trying the next donor",
                donor,
                priority,
                refusal,
            )
            refusals.refused(person, donor, priority)
            continue
        others = [
            d
            for p, d in sorted(donors, key=lambda d: d[0] != priority)
            if d != donor and witness_of(core, d) not in refusals.people
        ]
        # a round mate's state of the round this peer missed extends this peer's own: the
        # peers that missed it too hold this peer's state, and do not outvote it for that
        extends = own is not None and donor in partners and priority == min_priority
        verdict = await judge(
            core,
            prefix,
            donor,
            others[:CORROBORATORS],
            digest,
            request_timeout,
            own=None if extends else own,
            refusals=refusals,
            priority=priority,
        )
        holder_refuses = own is not None and not extends and not sole
        if verdict.kind == "outvoted" and verdict.contested:
            # two forks of one stage (a healed split): the claim is not a lone one, so it is
            # refused as an unconfirmed one is, not for good: asked again once it declares a
            # newer state, which the others may then confirm
            logger.warning(
                "state from %s (priority %g) not used: %s, but another volunteer declares "
                "its priority with another state; asked again once it declares a newer one",
                donor,
                priority,
                verdict.why,
            )
            refusals.refused(person, donor, priority)
            continue
        if verdict.kind == "outvoted":
            logger.warning(
                "state from %s (priority %g) dropped: %s; this peer downloads from its "
                "volunteer no more",
                donor,
                priority,
                verdict.why,
            )
            refusals.outvoted(person, donor, verdict.why)
            continue
        if verdict.kind == "unconfirmed":
            if holder_refuses:
                logger.warning(
                    "state from %s (priority %g) not used: this peer replaces its own state "
                    "only with one another volunteer confirms, and %s",
                    donor,
                    priority,
                    verdict.why,
                )
                refusals.refused(person, donor, priority)
                continue
            logger.info("a downloaded state could not be checked: %s", verdict.why)
        return metadata, tensors, donor
    return None


def parse_state_info(fields: Any, max_bytes: int) -> tuple[Any, list[Any], int]:
    """``(metadata, [[header, nbytes], ...], total bytes)`` of a donor's ``avg.state_info``
    (fields already checked against its schema), before anything is allocated for it.
    ``ValueError`` for anything malformed or a state over ``max_bytes``."""
    items = fields["x"]
    if not isinstance(items, list) or not all(
        isinstance(x, list)
        and len(x) == 2
        and isinstance(x[0], dict)
        and type(x[1]) is int
        and x[1] >= 0
        for x in items
    ):
        raise ValueError("malformed tensor list")
    total = sum(x[1] for x in items)
    if total > min(max_bytes, _MAX_STATE_BYTES):
        raise ValueError(
            f"the donor announced a state of {total} bytes; this peer expects at most "
            f"{min(max_bytes, _MAX_STATE_BYTES)}"
        )
    chunk_bytes, num_chunks = fields["b"], fields["n"]
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError("bad chunk size")
    if num_chunks != max(1, math.ceil(total / chunk_bytes)):
        raise ValueError("chunk count does not match the state size")
    try:
        metadata = msgpack.unpackb(fields["m"], raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"the state's metadata is not msgpack ({type(exc).__name__})") from None
    return metadata, items, total


async def _download_from(
    core: NodeCore,
    prefix: str,
    donor: str,
    request_timeout: float,
    chunk_timeout: float,
    max_bytes: int,
) -> tuple[Any, list[torch.Tensor], bytes]:
    """``(metadata, tensors, the state's digest as received)`` from ``donor``."""
    info = await core.request(donor, Frame(STATE_BEGIN, {"p": prefix}), request_timeout)
    if info.type != STATE_INFO:
        raise ValueError(f"expected {STATE_INFO}, got {info.type}")
    tid, num_chunks, chunk_bytes = info.fields["t"], info.fields["n"], info.fields["b"]
    metadata, items, total = parse_state_info(info.fields, max_bytes)
    buffer = bytearray(total)
    indices = iter(range(num_chunks))

    async def fetch_some() -> None:
        for index in indices:
            frame = Frame(STATE_CHUNK, {"p": prefix, "t": tid, "i": index})
            reply = await core.request(donor, frame, chunk_timeout)
            if reply.type != STATE_DATA:
                raise ValueError(f"expected {STATE_DATA}, got {reply.type}")
            start = index * chunk_bytes
            expected = min(chunk_bytes, total - start)
            data = memoryview(reply.payload).cast("B")
            if data.nbytes != expected:
                raise ValueError(f"chunk {index} has {data.nbytes} bytes, expected {expected}")
            buffer[start : start + expected] = data

    try:
        async with asyncio.TaskGroup() as tasks:
            for _ in range(min(_WINDOW, num_chunks)):
                tasks.create_task(fetch_some())
    except ExceptionGroup as group:
        raise group.exceptions[0] from None
    tensors = []
    wires = []
    offset = 0
    view = memoryview(buffer)
    for header, nbytes in items:
        wires.append((header, view[offset : offset + nbytes]))
        compressed = CompressedTensor.from_wire(header, view[offset : offset + nbytes])
        tensors.append(extract(compressed).clone())
        offset += nbytes
    return metadata, tensors, state_digest(wires)
