"""What each member tells its group (peer.averaging.allreduce.members): pure, no sockets."""

from __future__ import annotations

import math

import pytest

from peer.averaging.allreduce.members import certified, pack_metadata, parse_members
from peer.averaging.allreduce.round import MemberInfo
from peer.averaging.matchmaking.machine import GroupInfo


def _group(gathered: list[bytes], client_mode: tuple[bool, ...] | None = None) -> GroupInfo:
    ids = tuple(f"p{i}" for i in range(len(gathered)))
    client = client_mode or (False,) * len(ids)
    return GroupInfo(b"g" * 8, "key", ids[0], ids, tuple(gathered), client)


def test_metadata_round_trips_into_member_info_and_gathered_data() -> None:
    group = _group(
        [pack_metadata(2.5, False, 3.0, {"epoch": 4}), pack_metadata(None, True, 0.0, None)],
        client_mode=(False, True),
    )
    members, gathered = parse_members(group)
    assert members == [
        MemberInfo("p0", False, 2.5, False, 3.0),
        MemberInfo("p1", True, None, True, 0.0),
    ]
    assert gathered == {"p0": {"epoch": 4}, "p1": None}


def test_gather_that_msgpack_cannot_carry_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="msgpack-serialisable"):
        pack_metadata(1.0, False, 1.0, object())


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # not msgpack
        pack_metadata(-1.0, False, 1.0, None),  # negative bandwidth
        pack_metadata(math.inf, False, 1.0, None),
        pack_metadata(1.0, False, math.nan, None),
        pack_metadata(1.0, False, -2.0, None),
        pack_metadata(1.0, "yes", 1.0, None),  # type: ignore[arg-type]
    ],
)
def test_malformed_metadata_makes_the_member_auxiliary_with_no_span(raw: bytes) -> None:
    """Every member parses the same bytes the same way: the offender reduces and
    contributes nothing, and the others still agree on the partition."""
    members, gathered = parse_members(_group([pack_metadata(1.0, False, 1.0, None), raw]))
    assert members[1] == MemberInfo("p1", False, 0.0, True)
    assert gathered["p1"] is None and members[0].weight == 1.0


def test_a_certificate_caps_what_a_member_claims() -> None:
    claims = MemberInfo("p0", False, 1.0, False, 1.0)
    assert certified(claims, "client").client_mode
    assert certified(claims, "auxiliary").auxiliary
    assert certified(claims, "peer") == claims and certified(claims, None) == claims
