"""The order leaders are followed in, and the groups a follower accepts (no I/O): by
default no declaration wins the order, and a leader cannot cut a group below the
followers' own bounds."""

from __future__ import annotations

from peer.averaging.matchmaking.machine import (
    BeginAllreduce,
    Declaration,
    GroupAssembled,
    GroupInfo,
    JoinResponse,
    Matchmaker,
    MatchmakingConfig,
    MatchState,
    ResponseStatus,
    SendRequest,
)

KEY = "run.0b01"
SCHEMA = b"schema"


def test_by_default_the_order_is_a_rank_no_declared_time_changes() -> None:
    assert MatchmakingConfig().order == "rank"
    early = Declaration(KEY, "x", 0.0, SCHEMA)
    late = Declaration(KEY, "x", 1e9, SCHEMA)
    assert early.order_key() == late.order_key() and early.rank == late.rank
    # the rank is new with each group key, the same for everyone who computes it
    assert Declaration("run.0b10", "x", 0.0, SCHEMA).rank != early.rank
    # by start time (trusted swarms only), the earliest declaration goes first
    other = Declaration(KEY, "y", 5.0, SCHEMA)
    assert early.precedes(other, "start_time") and not other.precedes(early, "start_time")
    assert early.precedes(other) == (early.rank < other.rank)


def _following(peer: str, config: MatchmakingConfig, leader: Declaration) -> Matchmaker:
    m = Matchmaker(peer, config)
    m.start(0.0, group_key=KEY, schema_hash=SCHEMA, deadline=60.0)
    (request,) = [c for c in m.on_declaration(0.1, leader) if isinstance(c, SendRequest)]
    assert request.to == leader.peer_id
    m.on_join_response(0.2, leader.peer_id, JoinResponse(leader.peer_id, ResponseStatus.ACCEPTED))
    assert m.state is MatchState.FOLLOWING
    return m


def _group(*peers: str) -> GroupInfo:
    return GroupInfo(b"g", KEY, peers[0], peers, (b"",) * len(peers), (False,) * len(peers))


def _leader_before(peer: str) -> Declaration:
    """A leader that precedes ``peer`` in the default order, starting at 5."""
    name = next(
        f"L{i}"
        for i in range(100)
        if Declaration(KEY, f"L{i}", 5.0, SCHEMA).precedes(Declaration(KEY, peer, 5.0, SCHEMA))
    )
    return Declaration(KEY, name, 5.0, SCHEMA, deadline=60.0)


def test_a_follower_refuses_a_group_cut_below_its_own_target_before_the_start_time() -> None:
    """A leader assembles before its start time only when full: a smaller group then is the
    leader choosing the size (for instance, pairing itself with one peer)."""
    config = MatchmakingConfig(target_group_size=4, min_matchmaking_time=5.0, request_timeout=1.0)
    leader = _leader_before("f")
    m = _following("f", config, leader)
    out = m.on_notice(0.3, leader.peer_id, GroupAssembled(_group(leader.peer_id, "f")))
    assert not any(isinstance(c, BeginAllreduce) for c in out)
    assert m.state is not MatchState.GROUPED
    # the same group at the leader's start time is an honest one: only two were there
    m = _following("f", config, leader)
    out = m.on_notice(5.0, leader.peer_id, GroupAssembled(_group(leader.peer_id, "f")))
    assert any(isinstance(c, BeginAllreduce) for c in out)
    # a full group may assemble at once
    m = _following("f", config, leader)
    full = _group(leader.peer_id, "f", "g", "h")
    assert any(
        isinstance(c, BeginAllreduce)
        for c in m.on_notice(0.3, leader.peer_id, GroupAssembled(full))
    )


def test_a_follower_refuses_a_group_outside_its_own_bounds_or_listing_a_peer_twice() -> None:
    config = MatchmakingConfig(target_group_size=3, min_group_size=3, request_timeout=1.0)
    leader = _leader_before("f")
    for peers in (
        (leader.peer_id, "f"),  # under min_group_size, even at the start time
        (leader.peer_id, "f", "g", "h"),  # over the target
        (leader.peer_id, "f", "f"),  # a peer listed twice
    ):
        m = _following("f", config, leader)
        out = m.on_notice(5.0, leader.peer_id, GroupAssembled(_group(*peers)))
        assert not any(isinstance(c, BeginAllreduce) for c in out), peers


def test_a_leader_that_assembles_after_this_peers_deadline_is_not_asked() -> None:
    m = Matchmaker("f", MatchmakingConfig())
    m.start(0.0, group_key=KEY, schema_hash=SCHEMA, deadline=10.0)
    late = _leader_before("f")
    late = Declaration(KEY, late.peer_id, 30.0, SCHEMA, deadline=60.0)
    assert not any(isinstance(c, SendRequest) for c in m.on_declaration(0.1, late))
    in_time = Declaration(KEY, late.peer_id, 8.0, SCHEMA, deadline=60.0)
    assert any(isinstance(c, SendRequest) for c in m.on_declaration(0.2, in_time))
