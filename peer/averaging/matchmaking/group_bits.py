"""Moshpit group keys: which peers look for each other in a round (pure functions).

Moshpit SGD (Ryabinin et al., 2021, §3.2) arranges ``N = Mᵈ`` peers on a virtual
``d``-dimensional grid with ``M`` = target group size and averages along one dimension per
round; after ``d`` rounds every peer holds the global mean, and random restarts of the grid
keep mixing when peers come and go.

A peer keeps *group bits* (its grid coordinates in binary; :func:`grid_bits` places peers
on a full grid), matches on :func:`group_key` of them each round, and after the round moves
on to :func:`next_group_bits` with its :func:`slot_in_group`.
"""

from __future__ import annotations

import hashlib
import math
import re

__all__ = [
    "bits_per_coordinate",
    "grid_bits",
    "group_key",
    "next_group_bits",
    "parse_group_key",
    "slot_in_group",
    "validate_group_bits",
]

_KEY = re.compile(r"^(?P<prefix>.+)\.0b(?P<bits>[01]*)$")


def bits_per_coordinate(target_group_size: int) -> int:
    """``w = ceil(log2 M)``: bits of one grid coordinate for groups of up to ``M``."""
    if target_group_size < 1:
        raise ValueError("target_group_size must be positive")
    return max(1, math.ceil(math.log2(target_group_size))) if target_group_size > 1 else 0


def validate_group_bits(bits: str) -> str:
    """Return ``bits`` if it is a string of ``0``/``1`` (possibly empty), else ``ValueError``."""
    if not isinstance(bits, str) or any(ch not in "01" for ch in bits):
        raise ValueError(f"group bits must be a string of 0 and 1, got {bits!r}")
    return bits


def group_key(prefix: str, bits: str, target_group_size: int) -> str:
    """The matchmaking key for a round: ``f"{prefix}.0b{bits[w:]}"``.

    A peer's *group bits* are its grid coordinates written in binary, ``w =
    ceil(log2 M)`` bits per coordinate, the coordinate along the dimension averaged *this* round
    first::

        bits = c_r  c_{r+1}  …  c_{r+d-1}        (each c is w bits)
        key  = f"{prefix}.0b{bits[w:]}"           (every coordinate but the first)

    Peers that agree on every coordinate except ``c_r`` share a key and so meet in a group.

    This differs from hivemind, whose key is *all* the bits: there, 3 bits for 8 peers give 8
    distinct keys after three rounds (nobody meets), so the grid needs ``log2(N/M)`` bits. Here
    the first coordinate is the in-group position and is not part of the key, so ``d·w`` bits
    describe a full ``d``-dimensional grid of ``Mᵈ`` peers.
    """
    validate_group_bits(bits)
    if not prefix:
        raise ValueError("prefix must not be empty")
    w = bits_per_coordinate(target_group_size)
    return f"{prefix}.0b{bits[w:]}"


def parse_group_key(key: str) -> tuple[str, str]:
    """Split a key into ``(prefix, key bits)``; ``ValueError`` if it is not one."""
    match = _KEY.match(key)
    if match is None:
        raise ValueError(f"not a group key: {key!r}")
    return match["prefix"], match["bits"]


def slot_in_group(group_id: bytes, index: int, group_size: int, target_group_size: int) -> int:
    """Member ``index``'s slot in ``0 … M-1``: distinct per member, same on every member.

    The slots are the first ``group_size`` entries of a permutation of ``range(M)`` ordered
    by ``sha256(group_id ‖ slot)``, so which coordinate a member takes is shuffled from
    group to group (hivemind draws it from a RNG seeded by the group id, to the same end).
    """
    if not 0 <= index < group_size:
        raise ValueError(f"index {index} out of range for a group of {group_size}")
    slots = max(target_group_size, group_size)
    order = sorted(
        range(slots), key=lambda s: hashlib.sha256(group_id + s.to_bytes(4, "big")).digest()
    )
    return order[index]


def next_group_bits(bits: str, slot: int, target_group_size: int) -> str:
    """Bits for the next round: rotate by one coordinate, append ``slot`` (same length).

    With no bits (``""``) there is one key for everybody and nothing changes.

    After the round each member rotates its bits by one coordinate and writes its *slot* in the
    group (a permutation of ``0 … M-1`` derived from the group id, so the members of one group
    get distinct slots) as the new last coordinate::

        bits' = bits[w:] + format(slot, f"0{w}b")

    The members of a group leave with distinct keys (they differ in the slot just written), and
    peers from different groups of the previous round that share a slot meet next — exactly
    one grid dimension further. For 8 peers, ``M = 2`` and 3 bits whose first bit splits the
    pairs (0, 1), (2, 3), … (see :func:`grid_bits`), rounds 0, 1, 2 average along the three
    dimensions of the 2x2x2 cube, every round has four groups of two, and every peer holds the
    global mean from round 3 on.
    """
    validate_group_bits(bits)
    if not bits:
        return bits
    w = bits_per_coordinate(target_group_size)
    if w == 0:
        return bits
    if not 0 <= slot < 2**w:
        raise ValueError(f"slot {slot} does not fit in {w} bits")
    return (bits[w:] + format(slot, f"0{w}b"))[-len(bits) :]


def grid_bits(peer_index: int, num_peers: int, target_group_size: int) -> str:
    """Initial bits placing peer ``peer_index`` on a full grid of ``num_peers = Mᵈ`` peers.

    The first coordinate is the peer's index within its first group, so consecutive
    indices ``(0 … M-1), (M … 2M-1), …`` share the round-0 key. With 8 peers and ``M = 2``
    this gives 3 bits and pairs ``(0, 1), (2, 3), …`` in round 0.
    """
    w = bits_per_coordinate(target_group_size)
    side = 2**w
    d = round(math.log(num_peers, side)) if num_peers > 1 and side > 1 else 0
    if side**d != num_peers or target_group_size != side:
        raise ValueError("grid_bits needs num_peers = M**d with M a power of two")
    coords = []
    rest = peer_index
    for _ in range(d):
        coords.append(format(rest % side, f"0{w}b"))
        rest //= side
    return "".join(coords)
