"""What each member tells its group, and what the group makes of it: pure, no I/O.

A peer joining a group sends its metadata once, with its join request (:func:`pack_metadata`:
its bandwidth, whether it is auxiliary, the weight its parts will carry, and the caller's
``gather``). When the group begins, every member parses the same gathered metadata the same
way (:func:`parse_members`) and applies the same certificates (:func:`certified`), so the
honest members agree on the partition and on who contributes what.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import msgpack

from peer.averaging.allreduce.round import MemberInfo
from peer.averaging.matchmaking.messages import GroupInfo
from peer.formats.open_types import UserMetadata

logger = logging.getLogger("peer.averaging.averager")

__all__ = ["certified", "pack_metadata", "parse_members"]


def pack_metadata(bandwidth: float | None, auxiliary: bool, weight: float, gather: object) -> bytes:
    """This member's metadata for its group; :class:`TypeError` if ``gather`` is not
    msgpack-serialisable."""
    try:
        packed = msgpack.packb(
            {"b": bandwidth, "a": auxiliary, "w": weight, "u": gather}, use_bin_type=True
        )
    except (TypeError, ValueError) as exc:
        raise TypeError(f"gather must be msgpack-serialisable: {exc}") from None
    assert isinstance(packed, bytes)
    return packed


def certified(member: MemberInfo, role: str | None) -> MemberInfo:
    """``member`` as its certificate allows, whatever its metadata claims: a ``client``
    never reduces (no span), an ``auxiliary`` never contributes. Every member applies the
    same rule to the same certificates, so the honest ones agree on the partition; a member
    that claimed more than its role computes another one, and its parts are refused."""
    if role == "client" and not member.client_mode:
        logger.warning(
            "member %s claims to reduce but its certificate makes it a client: it gets no span",
            member.peer_id,
        )
        return replace(member, client_mode=True)
    if role == "auxiliary" and not member.auxiliary:
        logger.warning(
            "member %s claims to contribute but its certificate makes it auxiliary: its parts "
            "are refused",
            member.peer_id,
        )
        return replace(member, auxiliary=True)
    return member


def parse_members(group: GroupInfo) -> tuple[list[MemberInfo], dict[str, UserMetadata]]:
    """Members' roles and gathered data from the group's metadata. A member whose metadata
    does not parse is treated as auxiliary with bandwidth 0 — the same on every member."""
    members: list[MemberInfo] = []
    gathered: dict[str, UserMetadata] = {}
    for peer_id, raw, client in zip(group.peer_ids, group.gathered, group.client_mode, strict=True):
        try:
            value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            bandwidth, auxiliary, user, weight = value["b"], value["a"], value["u"], value["w"]
            if bandwidth is not None and (
                isinstance(bandwidth, bool)
                or not isinstance(bandwidth, int | float)
                or not bandwidth >= 0
                or bandwidth == float("inf")
            ):
                raise ValueError("bad bandwidth")
            if not isinstance(auxiliary, bool):
                raise ValueError("bad auxiliary flag")
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not 0 <= weight < float("inf")
            ):
                raise ValueError("bad weight")
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            logger.warning("member %s sent malformed metadata (%s): ignoring it", peer_id, exc)
            members.append(MemberInfo(peer_id, client, 0.0, True))
            gathered[peer_id] = None
            continue
        members.append(MemberInfo(peer_id, client, bandwidth, auxiliary, float(weight)))
        gathered[peer_id] = user
    return members, gathered
