"""Grids that fit any swarm size (peer/averaging/matchmaking/grid.py): shape, weights and places,
checked by averaging whole swarms without a network."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import pytest
import torch

from peer.averaging.matchmaking.grid import (
    GridHistory,
    Placement,
    grid_for,
    home_coordinate,
    leader_cells,
    place_all,
    place_in_grid,
    place_next,
    rank_order,
    rounds_to_mean,
)
from peer.averaging.matchmaking.group_bits import group_key

G = 16


def log_g(n: int, g: int = G) -> int:
    d = 0
    while g**d < n:
        d += 1
    return d


def run_rounds(
    ids: list[str],
    rounds: int,
    view: Callable[[str, int], list[str]] = lambda peer, r: [],
    g: int = G,
    seed: int = 0,
    reference_round: int = 0,
) -> tuple[list[float], list[list[int]], float, list[float]]:
    """Average ``ids`` for ``rounds`` rounds, each peer placed from its own view
    (``view(peer, r)``, default: everyone), groups by key, each group's weighted mean.
    Returns the largest distance from the global mean (of the values before round
    ``reference_round``) after each round, the group sizes
    of each round, the largest weight ratio seen within a group, and the largest distance
    between two peers after each round."""
    gen = torch.Generator().manual_seed(seed)
    values = {p: torch.randn(4, generator=gen, dtype=torch.float64) for p in ids}
    mean = torch.stack(list(values.values())).mean(0)
    last_view: dict[str, tuple[str, ...]] = {}
    stable = dict.fromkeys(ids, 0)
    deviations, sizes, ratio, spreads = [], [], 1.0, []
    for r in range(rounds):
        if r == reference_round:
            mean = torch.stack(list(values.values())).mean(0)
        groups: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for p in ids:
            seen = tuple(sorted(view(p, r) or ids))
            stable[p] = stable[p] + 1 if last_view.get(p) == seen else 0
            last_view[p] = seen
            place = place_in_grid(seen, p, g, r, stable[p])
            groups[group_key("run", place.bits, g)].append((p, place.weight))
        sizes.append(sorted(len(members) for members in groups.values()))
        for members in groups.values():
            weights = torch.tensor([w for _, w in members], dtype=torch.float64)
            ratio = max(ratio, float(weights.max() / weights.min()))
            stacked = torch.stack([values[p] for p, _ in members])
            avg = (stacked * weights[:, None]).sum(0) / weights.sum()
            for p, _ in members:
                values[p] = avg.clone()
        deviations.append(max(float((v - mean).abs().max()) for v in values.values()))
        stacked = torch.stack(list(values.values()))
        spreads.append(float((stacked.max(0).values - stacked.min(0).values).max()))
    return deviations, sizes, ratio, spreads


def peer_ids(n: int, tag: str = "p") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


@pytest.mark.parametrize("n", [20, 37, 50, 64, 100, 130, 250, 500, 1000])
def test_every_peer_holds_the_global_mean_after_the_bound(n: int) -> None:
    bound = rounds_to_mean(n, G)
    # ⌈log_16 N⌉ rounds; 250 (between 240 and 256) is one of the sizes that forbid it
    assert bound == log_g(n) + (1 if n == 250 else 0)
    deviations, sizes, ratio, _ = run_rounds(peer_ids(n), bound + 1)
    assert deviations[bound - 1] <= 1e-12, deviations
    assert deviations[bound] <= 1e-12  # and keeps it
    if bound > 1:
        assert deviations[bound - 2] > 1e-3  # one round fewer is not enough
    for round_sizes in sizes:  # as equal as they can be, never above g
        assert round_sizes[-1] - round_sizes[0] <= 1 and round_sizes[-1] <= G, round_sizes
        assert sum(round_sizes) == n
    assert ratio <= 2.5  # far inside a run's relative weight bound of 16


def test_the_bound_is_log_g_n_exactly_where_two_rounds_can_reach_the_mean() -> None:
    # two rounds reach the mean exactly iff some k1 first-round groups and k2 second-round
    # groups of at most g fit: k1·k2 ≤ N ≤ g·min(k1, k2); the grid finds one whenever it exists
    for n in range(17, 257):
        possible = any(
            k1 * k2 <= n <= G * min(k1, k2) for k1 in range(1, G + 1) for k2 in range(1, G + 1)
        )
        assert rounds_to_mean(n, G) == (2 if possible else 3), n
    assert [n for n in range(17, 257) if rounds_to_mean(n, G) == 3] == list(range(241, 256))


@pytest.mark.parametrize("n", [257, 333, 3000, 4095, 4096, 4097])
def test_larger_swarms_within_one_round_of_the_bound(n: int) -> None:
    grid = grid_for(n, G)
    assert log_g(n) <= grid.dims <= log_g(n) + 1
    assert grid.cells + len(grid.extras) == n and len(set(grid.extras)) == len(grid.extras)
    for dim in range(grid.dims):
        sizes = grid.line_sizes(dim).values()
        assert max(sizes) <= G and max(sizes) - min(sizes) <= 1


def test_small_swarms_are_one_group_and_impossible_ones_refused() -> None:
    assert grid_for(5, G).sides == (5,) and rounds_to_mean(5, G) == 1
    assert rounds_to_mean(1, G) == 0
    with pytest.raises(ValueError, match="no exact grid"):
        grid_for(3, 2)  # pairs cannot average three peers exactly
    with pytest.raises(ValueError):
        place_in_grid(["a", "b"], "c", G, 0, 0)
    with pytest.raises(ValueError):
        place_in_grid(["a", "b"], "a", G, -1, 0)


def test_places_come_from_the_membership_alone() -> None:
    ids = peer_ids(50)
    assert rank_order(ids) == rank_order(reversed(ids)) == rank_order(ids + ids[:3])
    places = [place_in_grid(ids, p, G, 0, 0) for p in ids]
    assert len({p.cell for p in places}) == grid_for(50, G).cells  # every cell taken


@pytest.mark.parametrize("n", [50, 100, 1000])
def test_peers_with_views_off_by_one_still_converge(n: int) -> None:
    # for the first 3 rounds a tenth of the peers miss one member (N - 1) and another tenth
    # see a departed one (N + 1, a ghost that does not average); then the views agree
    ids = peer_ids(n)
    ghost, missing = "ghost", ids[n // 2]
    stale = set(ids[: n // 10])
    haunted = set(ids[n // 10 : n // 5])
    agree_at = 3

    def view(peer: str, r: int) -> list[str]:
        if r < agree_at and peer in stale:
            return [p for p in ids if p != missing]
        if r < agree_at and peer in haunted:
            return [*ids, ghost]
        return ids

    d = rounds_to_mean(n, G)
    deviations, _, _, spreads = run_rounds(ids, agree_at + 3 * d, view)
    # every round averages with positive weights: the peers keep drawing together
    assert spreads[agree_at - 1] < 0.5 * spreads[0]
    # the views agree: every peer holds the same values once the late peers are back in
    # step with the phase (at most d rounds) and one full cycle has run (2d - 1 more) ...
    assert spreads[agree_at + 3 * d - 2] <= 1e-9, spreads
    # ... close to the global mean: the rounds with wrong weights shifted it a little
    assert deviations[-1] < 0.01 * deviations[0]


@pytest.mark.parametrize("n", [37, 100])
def test_a_membership_change_seen_by_all_is_exact_d_rounds_later(n: int) -> None:
    # a crashed peer's record expires everywhere before round 1: the count restarts, and
    # d rounds later every peer holds the mean of the values before it
    ids = peer_ids(n)
    d = rounds_to_mean(n, G)
    deviations, _, _, _ = run_rounds(
        ids, 1 + d, lambda p, r: [*ids, "crashed"] if r < 1 else [], reference_round=1
    )
    assert deviations[d] <= 1e-12, deviations


def test_weights_are_what_exactness_needs_and_bounded() -> None:
    grid = grid_for(37, G)  # 6 x 6 and one extra
    assert grid.sides == (6, 6) and len(grid.extras) == 1
    extra = grid.extras[0]
    assert grid.multiplicity(extra) == 2
    # after averaging dimension 0, the extra's line holds 7 peers: its two members weigh
    # 7 / 2 each against 6 for every other line's one member (normalised by 6 cells)
    assert grid.weight(extra, frozenset({0})) == pytest.approx(7 / 2 / 6)
    other = next(c for c in range(grid.cells) if grid.coords(c)[1] != grid.coords(extra)[1])
    assert grid.weight(other, frozenset({0})) == 1.0
    assert grid.weight(extra, frozenset()) == 1.0  # first round: every peer alike


def test_an_averager_takes_its_place_from_the_membership_it_is_given() -> None:
    from peer.averaging.averager import DecentralizedAverager
    from peer.node.core import AsyncNode, NodeConfig
    from peer.transport.memory import MemoryNetwork
    from swarmlab.sim import LoopHandle, VirtualTimeLoop

    async def body() -> None:
        node = AsyncNode([], transport=MemoryNetwork().transport("h"), config=NodeConfig())
        handle = LoopHandle(node)
        averager = DecentralizedAverager(
            [torch.zeros(3)], handle, start=False, prefix="run", target_group_size=G
        )
        others = [f"p{i}" for i in range(36)]  # with this peer: 37, a 6 x 6 grid and one extra
        members = [*others, averager.peer_id]
        history = GridHistory()
        for r in range(3):  # the same view: the count goes on, the weights follow it
            expected, history = place_next(history, members, averager.peer_id, G, r)
            weight = averager.place_on_grid(others, r)  # this peer is added if missing
            assert averager.get_group_bits() == expected.bits
            assert weight == expected.weight
        # a newcomer: the placement carries over, this peer keeps its cell
        moved, _ = place_next(history, [*members, "new"], averager.peer_id, G, 3)
        assert averager.place_on_grid([*members, "new"], 3) == moved.weight
        assert moved.cell == expected.cell
        # client-mode members: the others are the hosts of the placement
        clients = [p for p in others if p.endswith(("1", "2", "3", "4"))]
        hosted = DecentralizedAverager(
            [torch.zeros(3)], handle, start=False, prefix="hosted", target_group_size=G
        )
        view = frozenset([*others, hosted.peer_id])
        expected, _ = place_next(
            GridHistory(), view, hosted.peer_id, G, 0, view - frozenset(clients)
        )
        assert hosted.place_on_grid(others, 0, clients) == expected.weight
        assert hosted.get_group_bits() == expected.bits
        no_grid = DecentralizedAverager([torch.zeros(3)], handle, start=False, prefix="x")
        with pytest.raises(ValueError, match="target_group_size"):
            no_grid.place_on_grid(members, 0)

    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(body())
    finally:
        loop.close()


@pytest.mark.parametrize("n", [37, 500])
def test_centered_clip_returns_the_weighted_mean_of_a_grid_group_that_agrees(n: int) -> None:
    # the robust aggregator with the grid's weights: honest members whose values agree
    # (none beyond its clip radius) get the exact weighted mean the grid needs
    from peer.averaging.allreduce.robust import centered_clip

    ids = peer_ids(n)
    d = rounds_to_mean(n, G)
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for r in range(1, d):  # the rounds whose weights are not all 1
        groups: dict[str, list[float]] = defaultdict(list)
        for p in ids:
            place = place_in_grid(ids, p, G, r, r)
            groups[group_key("run", place.bits, G)].append(place.weight)
        for weights in groups.values():
            if len(set(weights)) == 1:
                continue
            values = 3.0 + 0.01 * torch.randn(len(weights), 16, generator=gen, dtype=torch.float64)
            w = torch.tensor(weights, dtype=torch.float64)
            expected = (values * w[:, None]).sum(0) / w.sum()
            torch.testing.assert_close(centered_clip(values, w), expected, rtol=0, atol=1e-12)
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("n", [100, 950])
def test_a_placement_carried_over_moves_nobody_when_peers_leave_and_arrive(n: int) -> None:
    # 5 % leave and as many arrive: every peer that stays keeps its cell, the newcomers take
    # the cells left, and the layout is still the full grid's (every cell held, its extras)
    ids = peer_ids(n)
    before = place_all(ids, G)
    gone = set(ids[::20])
    newcomers = peer_ids(len(gone), tag="new")
    members = [p for p in ids if p not in gone] + newcomers
    after = place_all(members, G, 1, before)
    assert after.grid == before.grid
    assert all(after.cells[p] == before.cells[p] for p in ids if p not in gone)
    assert {after.cells[p] for p in newcomers} == {before.cells[p] for p in gone}
    held = Counter(after.cells.values())
    assert held == Counter(before.cells.values())  # one per cell, two in the extras' cells
    # most newcomers sit at their home coordinate along the round's dimension (1 here)
    home = [
        after.grid.coords(after.cells[p])[1] == home_coordinate(p, after.grid, 1) for p in newcomers
    ]
    assert sum(home) >= len(home) // 2, home


def test_a_placement_keeps_its_layout_when_extras_come_and_go() -> None:
    ids = peer_ids(950)  # 10 x 10 x 9 and 50 extras
    before = place_all(ids, G)
    fewer = ids[:940]  # ten extras fewer: the grid's layout for 940, all cells held
    after = place_all(fewer, G, 0, before)
    assert after.grid == grid_for(940, G) and after.grid.sides == before.grid.sides
    held = Counter(after.cells.values())
    assert all(held[c] == after.grid.multiplicity(c) for c in range(after.grid.cells))
    moved = [p for p in fewer if after.cells[p] != before.cells[p]]
    assert len(moved) <= 10  # only peers of cells whose extra place went
    # a grid of other sides starts over from the rank order
    assert place_all(ids[:800], G, 0, before).cells == place_all(ids[:800], G).cells


def test_places_carried_over_reach_the_mean_once_the_membership_stops_changing() -> None:
    # five leave and five arrive before rounds 1 and 2, each peer keeping its cell and its
    # count; round 3 is the first whose membership held: the count starts over, and d
    # rounds later every peer holds the mean of the values present then
    gen = torch.Generator().manual_seed(3)
    members = peer_ids(100)
    values = {p: torch.randn(4, generator=gen, dtype=torch.float64) for p in members}
    d = rounds_to_mean(100, G)
    history = dict.fromkeys(members, GridHistory())
    reference = torch.zeros(4, dtype=torch.float64)
    counts = []
    for r in range(3 + d):
        if r in (1, 2):
            gone, members = members[:5], members[5:] + peer_ids(5, tag=f"r{r}-")
            for new, donor in zip(members[-5:], members[:5], strict=True):
                values[new] = torch.randn(4, generator=gen, dtype=torch.float64)
                history[new] = history[donor]  # the placement comes with the state
            for p in gone:
                del values[p]
        if r == 3:
            reference = torch.stack(list(values.values())).mean(0)
        groups: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for p in members:
            before = history[p].placement
            place, history[p] = place_next(history[p], members, p, G, r)
            if before is not None and p in before.cells:
                assert place.cell == before.cells[p]  # nobody moves
            groups[group_key("run", place.bits, G)].append((p, place.weight))
        counts.append(history[members[0]].stable)
        for group in groups.values():
            w = torch.tensor([x for _, x in group], dtype=torch.float64)
            avg = (torch.stack([values[p] for p, _ in group]) * w[:, None]).sum(0) / w.sum()
            for p, _ in group:
                values[p] = avg.clone()
    assert counts[:4] == [0, 1, 2, 0]
    assert max(float((v - reference).abs().max()) for v in values.values()) <= 1e-12


def _lines_without_a_host(placement: Placement, hosts: frozenset[str]) -> int:
    grid = placement.grid
    missing = 0
    for dim in range(grid.dims):
        led: dict[tuple[int, ...], bool] = {}
        for peer, cell in placement.cells.items():
            coords = grid.coords(cell)
            line = coords[:dim] + coords[dim + 1 :]
            led[line] = led.get(line, False) or peer in hosts
        missing += sum(not has for has in led.values())
    return missing


@pytest.mark.parametrize("g", [4, 16])
@pytest.mark.parametrize("n", [20, 37, 50, 64, 100, 130, 250, 500, 1000])
def test_the_leader_cells_meet_every_line_of_every_dimension(n: int, g: int) -> None:
    grid = grid_for(n, g)
    leaders = set(leader_cells(grid))
    for dim in range(grid.dims):
        for line, _ in grid.line_sizes(dim).items():
            cells = [
                c for c in range(grid.cells)
                if grid.coords(c)[:dim] + grid.coords(c)[dim + 1 :] == line[:dim] + line[dim + 1 :]
            ]  # fmt: skip
            assert leaders & set(cells), (n, g, dim, line)
    assert len(leaders) <= grid.cells // min(grid.sides) + grid.cells // grid.dims


@pytest.mark.parametrize("n", [37, 100, 250])
def test_hosts_take_the_leader_cells_so_no_line_is_all_clients(n: int) -> None:
    """With just enough peers accepting connections (one per leader cell), a plain rank
    placement leaves lines of client-mode peers only (no group can form there); hosts on
    the leader cells leave none, and the placement is still one of the grid's layout."""
    members = [f"p{i}" for i in range(n)]
    hosts = frozenset(members[: len(leader_cells(grid_for(n, G)))])
    plain = place_all(members, G)
    assert _lines_without_a_host(plain, hosts) > 0
    placed = place_all(members, G, hosts=hosts)
    assert _lines_without_a_host(placed, hosts) == 0
    assert Counter(placed.cells.values()) == Counter(plain.cells.values())
    assert place_all(members, G, hosts=frozenset(members)).cells == plain.cells


def test_a_newcomer_host_takes_a_free_leader_cell() -> None:
    """On a carried placement (the same count, so the same grid): a host on a leader cell
    and a client elsewhere leave, a host and a client arrive; nobody else moves, and the new
    host takes the leader cell, the new client the other."""
    members = [f"p{i}" for i in range(105)]  # 10 x 10 and five extras
    hosts = frozenset(members[:20])
    before = place_all(members, G, hosts=hosts)
    leaders = set(leader_cells(before.grid))
    alone = Counter(before.cells.values())
    host = next(
        p for p in sorted(hosts) if before.cells[p] in leaders and alone[before.cells[p]] == 1
    )
    client = next(
        p for p in members
        if p not in hosts and before.cells[p] not in leaders and alone[before.cells[p]] == 1
    )  # fmt: skip
    staying = [p for p in members if p not in (host, client)]
    now_hosts = hosts - {host} | {"new-host"}
    after = place_all([*staying, "new-host", "new-client"], G, 1, before, hosts=now_hosts)
    assert all(after.cells[p] == before.cells[p] for p in staying)
    assert after.cells["new-host"] == before.cells[host]
    assert after.cells["new-client"] == before.cells[client]
