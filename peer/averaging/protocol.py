"""Wire messages of the averager, their encoding, and routing by ``prefix`` on one node.

Every averager message names the averager's ``prefix`` (field ``p``), so several averagers
(e.g. parameters and optimizer state) can share one node; :class:`Router` registers the
message types once per node and hands each frame to the averager of that prefix.

:class:`Router`'s docstring lists the message types. The requester of ``avg.join`` is the
authenticated peer of the link, never a field.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from peer.averaging.matchmaking.messages import (
    Declaration,
    GroupAssembled,
    GroupDisbanded,
    GroupInfo,
    JoinResponse,
    LeaveGroup,
    Notice,
    Redirected,
    RefuseReason,
    ResponseStatus,
)
from peer.averaging.seam import Link, NodeCore
from peer.wire import BYTES, FLOAT, INT, STR, AnyValue, Frame, ListOf, Scalar, Schema

JOIN = "avg.join"
JOIN_REPLY = "avg.join_reply"
NOTICE = "avg.notice"
PART = "avg.part"
AVERAGE = "avg.average"
ABORT = "avg.abort"
STATE_BEGIN = "avg.state_begin"
STATE_INFO = "avg.state_info"
STATE_CHUNK = "avg.state_chunk"
STATE_DATA = "avg.state_data"
STATE_DIGEST = "avg.state_digest"  # a donor's digest of the state it would serve now
STATE_HASH = "avg.state_hash"

PREFIX = Scalar(str, max_length=512)
GROUP_ID = Scalar(bytes, max_length=64)
PEER_ID = Scalar(str, max_length=128)
MAX_BRINGING = 256  # peers a join request may announce (the leader keeps a group's worth)

HANDLED: dict[str, Schema] = {
    JOIN: Schema(
        required={"p": PREFIX, "d": AnyValue(), "l": STR, "m": BYTES},
        optional={"b": ListOf(PEER_ID, max_length=MAX_BRINGING)},  # JoinRequest.bringing
    ),
    NOTICE: Schema(
        required={"p": PREFIX, "k": STR},
        optional={
            "g": AnyValue(),
            "d": AnyValue(),
            "f": STR,
            "l": STR,
            "b": ListOf(PEER_ID, max_length=MAX_BRINGING),  # Redirected.peer_ids
        },
    ),
    PART: Schema(
        required={"p": PREFIX, "g": GROUP_ID, "l": STR, "i": INT, "w": FLOAT, "c": AnyValue()},
        optional={"k": INT},  # parts i..i+k-1 in one frame (default 1)
        payload=True,
    ),
    AVERAGE: Schema(
        required={"p": PREFIX, "g": GROUP_ID, "l": STR, "i": INT},
        optional={"c": AnyValue(), "k": INT},
        payload=True,
    ),
    ABORT: Schema(required={"p": PREFIX, "g": GROUP_ID}, optional={"why": STR}),
    STATE_BEGIN: Schema(required={"p": PREFIX}),
    STATE_CHUNK: Schema(required={"p": PREFIX, "t": INT, "i": INT}),
    STATE_DIGEST: Schema(required={"p": PREFIX}),
}
REPLIES: dict[str, Schema] = {
    JOIN_REPLY: Schema(required={"s": STR}, optional={"r": STR, "d": AnyValue()}),
    STATE_INFO: Schema(required={"t": INT, "m": BYTES, "x": AnyValue(), "n": INT, "b": INT}),
    STATE_DATA: Schema(payload=True),
    STATE_HASH: Schema(required={"e": FLOAT, "d": Scalar(bytes, max_length=64)}),
}

Endpoint = Callable[[Any, Frame], Awaitable[Frame | None]]
RoundEndpoint = Callable[[str, Frame], None]  # (sender's peer id, part or average frame)


class Router:
    """Per-node dispatch of averager messages by prefix (one per :class:`AsyncNode`).

    The message types:

    ====================  ========  ===========================================================
    type                  kind      meaning
    ====================  ========  ===========================================================
    ``avg.join``          request   matchmaking :class:`~peer.averaging.matchmaking.machine.JoinRequest`
    ``avg.join_reply``    reply     its :class:`~peer.averaging.matchmaking.machine.JoinResponse`
    ``avg.notice``        one-way   ``GroupAssembled`` / ``GroupDisbanded`` / ``LeaveGroup`` /
                                    ``Redirected``
    ``avg.part``          one-way   a sender's values for one part of the receiver's span
    ``avg.average``       one-way   a reducer's average of one part of its span
    ``avg.abort``         one-way   "I am not (or no longer) in group ``g``": exclude me
    ``avg.state_begin``   request   start a state download; reply ``avg.state_info``
    ``avg.state_chunk``   request   one chunk of a state download; reply ``avg.state_data``
    ``avg.state_digest``  request   a donor's digest of the state it would serve now; reply
                                    ``avg.state_hash``
    ====================  ========  ===========================================================
    """

    _by_node: weakref.WeakKeyDictionary[Any, Router] = weakref.WeakKeyDictionary()

    def __init__(self, core: NodeCore) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        self.rounds: dict[str, RoundEndpoint] = {}
        for message_type, schema in REPLIES.items():
            core.registry.register(message_type, schema)
        for message_type, schema in HANDLED.items():
            core.register_handler(message_type, schema, self._dispatch)
        for message_type in (PART, AVERAGE):  # tensor payloads: bulk lanes where possible
            core.accept_bulk(message_type, inline=self._dispatch_round)

    @classmethod
    def of(cls, core: NodeCore) -> Router:
        router = cls._by_node.get(core)
        if router is None:
            router = cls._by_node[core] = cls(core)
        return router

    def add(self, prefix: str, endpoint: Endpoint, rounds: RoundEndpoint) -> None:
        """Route ``prefix``'s messages to ``endpoint``, and its round frames (parts and
        averages) that arrive on bulk lanes to ``rounds(peer_id, frame)``, called inline."""
        if prefix in self.endpoints:
            raise ValueError(f"an averager with prefix {prefix!r} already runs on this node")
        self.endpoints[prefix] = endpoint
        self.rounds[prefix] = rounds

    def remove(self, prefix: str) -> None:
        self.endpoints.pop(prefix, None)
        self.rounds.pop(prefix, None)

    def _dispatch_round(self, peer_id: str, frame: Frame) -> None:
        rounds = self.rounds.get(frame.fields["p"])
        if rounds is not None:
            rounds(peer_id, frame)

    async def _dispatch(self, link: Link, frame: Frame) -> Frame | None:
        endpoint = self.endpoints.get(frame.fields["p"])
        if endpoint is None:
            if frame.request_id:
                raise ValueError(f"no averager with prefix {frame.fields['p']!r} here")
            return None
        return await endpoint(link, frame)


# ------------------------------------------------------------------ declarations


def encode_declaration(d: Declaration) -> dict[str, object]:
    return {
        "k": d.group_key,
        "id": d.peer_id,
        "s": d.start_time,
        "h": d.schema_hash,
        "c": d.client_mode,
        "r": d.revision,
        "d": None if math.isinf(d.deadline) else d.deadline,
    }


def decode_declaration(value: object) -> Declaration:
    """Parse a declaration from the wire or gossip; ``ValueError`` if malformed."""
    if not isinstance(value, dict):
        raise ValueError("declaration must be a map")
    try:
        key, peer_id, start, digest = value["k"], value["id"], value["s"], value["h"]
        client, revision, deadline = value["c"], value["r"], value["d"]
    except KeyError as exc:
        raise ValueError(f"declaration lacks {exc}") from None
    if not (isinstance(key, str) and isinstance(peer_id, str) and isinstance(digest, bytes)):
        raise ValueError("declaration has bad key, peer id or schema hash")
    for number in (start, deadline):
        if number is not None and (
            isinstance(number, bool)
            or not isinstance(number, int | float)
            or not math.isfinite(number)
        ):
            raise ValueError("declaration has a bad time")
    if start is None or not isinstance(client, bool):
        raise ValueError("declaration has a bad start time or client flag")
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise ValueError("declaration has a bad revision")
    return Declaration(
        key,
        peer_id,
        float(start),
        digest,
        client,
        revision,
        math.inf if deadline is None else float(deadline),
    )


# ------------------------------------------------------------------ join replies


def encode_response(response: JoinResponse) -> Frame:
    fields: dict[str, Any] = {"s": response.status.value}
    if response.reason is not None:
        fields["r"] = response.reason.value
    if response.redirect_to is not None:
        fields["d"] = encode_declaration(response.redirect_to)
    return Frame(JOIN_REPLY, fields)


def decode_response(sender: str, frame: Frame) -> JoinResponse:
    if frame.type != JOIN_REPLY:
        raise ValueError(f"expected {JOIN_REPLY}, got {frame.type}")
    f = frame.fields
    status = ResponseStatus(f["s"])
    reason = RefuseReason(f["r"]) if "r" in f else None
    redirect = decode_declaration(f["d"]) if "d" in f else None
    return JoinResponse(sender, status, reason, redirect)


# ------------------------------------------------------------------ notices


def encode_group(group: GroupInfo) -> dict[str, object]:
    return {
        "id": group.group_id,
        "k": group.group_key,
        "l": group.leader,
        "p": list(group.peer_ids),
        "g": list(group.gathered),
        "c": list(group.client_mode),
    }


def decode_group(value: object) -> GroupInfo:
    if not isinstance(value, dict):
        raise ValueError("group must be a map")
    try:
        group = GroupInfo(
            value["id"],
            value["k"],
            value["l"],
            tuple(value["p"]),
            tuple(value["g"]),
            tuple(value["c"]),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed group: {exc}") from None
    n = len(group.peer_ids)
    if (
        not isinstance(group.group_id, bytes)
        or not isinstance(group.group_key, str)
        or not all(isinstance(p, str) for p in group.peer_ids)
        or len(set(group.peer_ids)) != n
        or len(group.gathered) != n
        or len(group.client_mode) != n
        or not all(isinstance(g, bytes) for g in group.gathered)
        or not all(isinstance(c, bool) for c in group.client_mode)
        or group.leader not in group.peer_ids
    ):
        raise ValueError("malformed group")
    return group


def encode_notice(prefix: str, notice: Notice) -> Frame:
    if isinstance(notice, GroupAssembled):
        return Frame(NOTICE, {"p": prefix, "k": "assembled", "g": encode_group(notice.group)})
    if isinstance(notice, GroupDisbanded):
        fields: dict[str, Any] = {"p": prefix, "k": "disbanded", "l": notice.leader_id}
        if notice.redirect_to is not None:
            fields["d"] = encode_declaration(notice.redirect_to)
        return Frame(NOTICE, fields)
    if isinstance(notice, LeaveGroup):
        return Frame(
            NOTICE, {"p": prefix, "k": "leave", "f": notice.follower_id, "l": notice.leader_id}
        )
    if isinstance(notice, Redirected):
        return Frame(
            NOTICE,
            {"p": prefix, "k": "redirected", "f": notice.follower_id, "b": list(notice.peer_ids)},
        )
    raise TypeError(f"unknown notice {notice!r}")


def decode_notice(sender: str, frame: Frame) -> Notice:
    f = frame.fields
    kind = f["k"]
    if kind == "assembled":
        return GroupAssembled(decode_group(f.get("g")))
    if kind == "disbanded":
        redirect = decode_declaration(f["d"]) if "d" in f else None
        return GroupDisbanded(sender, redirect)
    if kind == "leave":
        return LeaveGroup(sender, str(f.get("l", "")))
    if kind == "redirected":
        return Redirected(sender, tuple(f.get("b", ())))
    raise ValueError(f"unknown notice kind {kind!r}")


__all__ = [
    "ABORT",
    "AVERAGE",
    "JOIN",
    "JOIN_REPLY",
    "NOTICE",
    "PART",
    "STATE_BEGIN",
    "STATE_CHUNK",
    "STATE_DATA",
    "STATE_DIGEST",
    "STATE_HASH",
    "STATE_INFO",
    "Router",
    "decode_declaration",
    "decode_group",
    "decode_notice",
    "decode_response",
    "encode_declaration",
    "encode_group",
    "encode_notice",
    "encode_response",
]
