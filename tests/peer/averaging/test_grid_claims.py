"""A peer new to a swarm that averages on a Moshpit grid takes the free cell the others'
carried placement gives it, from the cells they claim over gossip, not a cell by rank."""

from __future__ import annotations

import torch

from peer.averaging.matchmaking.grid import (
    GridHistory,
    claim,
    grid_key,
    place_all,
    place_in_grid,
    place_next,
    with_claims,
)
from tests.peer.averaging.conftest import wait_for

G = 3  # six peers: a 3 x 2 grid


def test_a_newcomer_takes_the_cell_its_predecessor_left(make_swarm) -> None:
    swarm = make_swarm(7)
    averagers = swarm.add_averagers([[torch.zeros(2)] for _ in range(7)], target_group_size=G)
    *old, newcomer = averagers
    first = [a.peer_id for a in old]
    for averager in old:
        averager.place_on_grid(first, 0)
    # the leaver: one whose cell is not the newcomer's by rank, so that placing by rank
    # would put the newcomer in a taken cell
    by_rank = place_all([*first[1:], newcomer.peer_id], G)
    history = {a.peer_id: a._grid for a in old}
    placement = next(iter(history.values())).placement
    assert placement is not None
    leaver = next(
        p
        for p in first
        if placement.cells[p]
        != place_all([*(q for q in first if q != p), newcomer.peer_id], G).cells[newcomer.peer_id]
    )
    assert by_rank.grid.sides == placement.grid.sides == (3, 2)
    view = [p for p in first if p != leaver] + [newcomer.peer_id]
    assert wait_for(lambda: _claims_seen(newcomer, len(first)), 15)
    newcomer.place_on_grid(view, 1)
    # every staying peer's carried placement gives the newcomer the leaver's cell
    for peer in view[:-1]:
        expected, _ = place_next(history[peer], view, newcomer.peer_id, G, 1)
        assert expected.cell == placement.cells[leaver]
        assert newcomer.get_group_bits() == expected.bits
    assert newcomer._grid.placement is not None
    assert newcomer._grid.placement.cells[newcomer.peer_id] == placement.cells[leaver]
    # and it claims that cell in turn
    assert wait_for(lambda: _claims_seen(old[0], len(first) + 1), 15)


def _claims_seen(averager, count: int) -> bool:
    record = averager.node.get(grid_key("test"))
    return record is not None and len(record.value) >= count


def test_claims_that_do_not_fit_the_grid_or_come_from_this_round_are_ignored() -> None:
    members = [f"p{i}" for i in range(7)]
    good = {"p0": [4, 0, 3, 2], "p1": [0, 2, 3, 2]}
    hostile = {
        "p2": [9, 0, 3, 2],  # no such cell
        "p3": [1, 0, 2, 3],  # another grid
        "p4": [True, 0, 3, 2],  # not a cell number
        "outsider": [2, 0, 3, 2],  # not a member
        "p5": "cell 2",
        "p6": [3, 3, 3, 2],  # placed in this round, with this peer
    }
    history = with_claims(GridHistory(), members[:6], "p5", G, 3, {**good, **hostile})
    assert history.placement is not None
    assert history.placement.cells == {"p0": 4, "p1": 0}
    assert history.stable == history.placement.grid.dims and not history.held
    assert with_claims(GridHistory(), members[:6], "p5", G, 3, hostile) == GridHistory()


def test_a_claim_keeps_the_round_since_which_its_cell_is_held() -> None:
    members = [f"p{i}" for i in range(6)]
    place, history = place_next(GridHistory(), members, "p0", G, 0)
    first = claim(place, 0)
    assert first == [place.cell, 0, 3, 2]
    again, _ = place_next(history, members, "p0", G, 1)
    assert claim(again, 1, first) == first  # the same cell: the same claim, not stored again
    moved = place_all([*members, "p6", "p7"], G)  # 8 peers: a new grid
    assert claim(place_in_grid(moved.cells, "p0", G, 2, 0), 2, first)[1:] == [2, 2, 2, 2]


def test_a_peer_whose_view_differed_falls_back_into_the_claimed_placement() -> None:
    members = [f"p{i}" for i in range(6)]
    on_the_grid, _ = place_next(GridHistory(), members, "p0", G, 0)  # 3 x 2, by rank
    cells = on_the_grid.placement.cells
    claims = {p: [cells[p], 0, 3, 2] for p in members[:5]}
    # p5 missed a member last round: it placed itself on the grid of five (2 x 2 + 1)
    _, glitched = place_next(GridHistory(), [*members[:4], "p5"], "p5", G, 0)
    assert glitched.placement is not None and glitched.placement.grid.sides != (3, 2)
    back = with_claims(glitched, members, "p5", G, 1, claims)
    place, _ = place_next(back, members, "p5", G, 1)
    assert place.cell == cells["p5"]  # the one cell nobody claims
    # a peer's own carried cell wins over its own claim (which may be late)
    _, carried = place_next(GridHistory(), members, "p0", G, 0)
    stale = {**claims, "p0": [(cells["p0"] + 1) % 6, 0, 3, 2]}
    kept = with_claims(carried, members, "p0", G, 1, stale)
    assert kept.placement is not None and kept.placement.cells["p0"] == cells["p0"]
    assert (kept.stable, kept.held) == (carried.stable, carried.held)
