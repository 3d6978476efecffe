"""Moshpit grids that fit any swarm size: shape, places and weights (pure functions).

:mod:`peer.averaging.matchmaking.group_bits` averages along one dimension of a ``d``-dimensional
grid per round; the global mean after ``d`` rounds needs every cell taken. :func:`grid_for` picks a
grid from N that is always full (``d = ⌈log_g N⌉`` dimensions of sides ``m`` or
``m + 1``, the remaining peers as *extras*, a second peer in a cell, spread evenly), so
every peer holds the mean within :func:`rounds_to_mean` rounds. :func:`place_all` and
:func:`place_next` place peers and carry the placement from round to round (a peer keeps
its cell while the grid's sides hold; a newcomer takes a free cell, preferring its
:func:`home_coordinate`; the others' cells are those they :func:`claim`);
:func:`place_in_grid` gives a peer its group bits and its
step's weight (``|slab| / peers in its cell``, so a group's weighted mean is the mean of
the union of its slabs). Every peer computes from the membership it sees and the cells
the others claim over gossip (:func:`with_claims`). The shape, the weights, the bound, churn and gossip lag are explained in
``docs/averaging.md`` ("Grids that fit any N").
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from peer.averaging.matchmaking.group_bits import bits_per_coordinate

__all__ = [
    "Grid",
    "GridHistory",
    "GridPlace",
    "Placement",
    "claim",
    "grid_for",
    "grid_key",
    "home_coordinate",
    "leader_cells",
    "place_all",
    "place_in_grid",
    "place_next",
    "rank_order",
    "rounds_to_mean",
    "with_claims",
]


@dataclass(frozen=True)
class Grid:
    """A full grid of ``sides`` (dimension 0 first) for ``n`` peers; ``extras[k]`` is the
    cell of the peer ranked ``M + k`` (``M = ∏ sides``)."""

    n: int
    sides: tuple[int, ...]
    extras: tuple[int, ...]

    @property
    def dims(self) -> int:
        return len(self.sides)

    @property
    def cells(self) -> int:
        return math.prod(self.sides)

    def coords(self, cell: int) -> tuple[int, ...]:
        out = []
        for side in self.sides:
            out.append(cell % side)
            cell //= side
        return tuple(out)

    def cell_of(self, rank: int) -> int:
        if not 0 <= rank < self.n:
            raise ValueError(f"rank {rank} out of range for {self.n} peers")
        return rank if rank < self.cells else self.extras[rank - self.cells]

    def multiplicity(self, cell: int) -> int:
        return 1 + _extra_counts(self)[cell]

    def line_sizes(self, dim: int) -> Counter[tuple[int, ...]]:
        """Peers on each line along ``dim`` (keyed by the other coordinates)."""
        return _slab_counts(self, frozenset((dim,)))

    def slab_size(self, cell: int, averaged: frozenset[int]) -> int:
        """Peers in the cells that agree with ``cell`` outside the dimensions ``averaged``."""
        return _slab_counts(self, averaged)[_project(self.coords(cell), averaged)]

    def weight(self, cell: int, averaged: frozenset[int]) -> float:
        """The weight of a peer in ``cell`` holding its slab's mean over ``averaged``: the
        slab's peers per holder in the next group, over the slab's cell count (near 1)."""
        nominal = math.prod(self.sides[j] for j in averaged)
        return self.slab_size(cell, averaged) / self.multiplicity(cell) / nominal


def _project(coords: tuple[int, ...], averaged: frozenset[int]) -> tuple[int, ...]:
    return tuple(-1 if j in averaged else c for j, c in enumerate(coords))


@functools.lru_cache(maxsize=64)
def _extra_counts(grid: Grid) -> Counter[int]:
    return Counter(grid.extras)


@functools.lru_cache(maxsize=64)
def _slab_counts(grid: Grid, averaged: frozenset[int]) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    for cell in range(grid.cells):
        counts[_project(grid.coords(cell), averaged)] += 1
    for cell in grid.extras:
        counts[_project(grid.coords(cell), averaged)] += 1
    return counts


def _root(n: int, d: int) -> int:
    """``⌊n^{1/d}⌋`` in integers."""
    m = max(1, round(math.pow(n, 1 / d)))
    while m**d > n:
        m -= 1
    while (m + 1) ** d <= n:
        m += 1
    return m


def _spread_extras(sides: tuple[int, ...], extras: int) -> tuple[int, ...]:
    """``extras`` distinct cells, as few as possible on any line of any dimension: passes
    over the cells in diagonal order (layer ``l``: every cell of the hyperplane of
    dimensions 1… with ``c₀ = (Σ cⱼ + l) mod m₀``, a transversal: one cell per line of
    dimension 0, and per line of any other no longer than ``m₀``), taking a cell while each
    of its lines is under that dimension's cap (``⌈extras / lines⌉``, raised where a pass
    falls short)."""
    cells = math.prod(sides)
    plane = cells // sides[0]
    order = []
    for layer in range(sides[0]):
        for t in range(plane):
            rest, coords = t, []
            for side in sides[1:]:
                coords.append(rest % side)
                rest //= side
            order.append((sum(coords) + layer) % sides[0] + sides[0] * t)
    lines = [cells // side for side in sides]
    caps = [-(-extras // count) for count in lines]
    used: list[Counter[tuple[int, ...]]] = [Counter() for _ in sides]
    taken: list[int] = []
    chosen: set[int] = set()
    while len(taken) < extras:
        before = len(taken)
        for cell in order:
            if len(taken) == extras:
                break
            if cell in chosen:
                continue
            coords = []
            rest = cell
            for side in sides:
                coords.append(rest % side)
                rest //= side
            keys = [tuple(coords[:j] + coords[j + 1 :]) for j in range(len(sides))]
            if all(used[j][keys[j]] < caps[j] for j in range(len(sides))):
                for j in range(len(sides)):
                    used[j][keys[j]] += 1
                taken.append(cell)
                chosen.add(cell)
        if len(taken) == before:
            caps = [cap + 1 for cap in caps]
    return tuple(taken)


@functools.lru_cache(maxsize=64)
def grid_for(n: int, target_group_size: int) -> Grid:
    """The full grid for ``n`` peers in groups of at most ``target_group_size`` (see the
    module docstring); ``d = 1`` (one group) for ``n ≤ g``. For ``g ≥ 8`` it has at most
    ``⌈log_g n⌉ + 1`` dimensions (checked for every ``n`` up to 5,000 at ``g`` = 8 and 16);
    smaller groups may need more, and ``ValueError`` where none fits (``g = 2``, odd n)."""
    g = target_group_size
    if n < 1 or g < 2:
        raise ValueError("need at least one peer and a target group size of at least 2")
    if n <= g:
        return Grid(n, (n,), ())
    d = 1
    while g**d < n:
        d += 1
    while True:
        m = _root(n, d)
        if m < 2:
            raise ValueError(f"no exact grid for {n} peers in groups of at most {g}")
        k = 0
        while k < d and m ** (d - k - 1) * (m + 1) ** (k + 1) <= n:
            k += 1
        sides = (m + 1,) * k + (m,) * (d - k)
        grid = Grid(n, sides, _spread_extras(sides, n - math.prod(sides)))
        if all(max(grid.line_sizes(j).values()) <= g for j in range(d)):
            return grid
        d += 1


def rounds_to_mean(n: int, target_group_size: int) -> int:
    """Rounds after which every peer holds the global mean (no churn): ``⌈log_g n⌉``, or
    one more where no exact scheme with groups of at most ``g`` exists in that many."""
    return 0 if n <= 1 else grid_for(n, target_group_size).dims


def rank_order(peer_ids: Iterable[str]) -> list[str]:
    """The peers in grid order: by ``sha256(peer id)`` (ids and order from any view)."""
    return sorted(set(peer_ids), key=lambda p: (hashlib.sha256(p.encode()).digest(), p))


@dataclass(frozen=True, eq=False)
class Placement:
    """Every member's cell on ``grid`` (as many peers per cell as the grid's layout holds)."""

    grid: Grid
    cells: dict[str, int]


def home_coordinate(peer_id: str, grid: Grid, dim: int) -> int:
    """The coordinate along ``dim`` that a peer new to ``grid`` prefers (from its id alone,
    so that it can pick a state donor there before it knows its cell)."""
    digest = hashlib.sha256(f"{dim}:{peer_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % grid.sides[dim]


def _capacities(grid: Grid) -> Counter[int]:
    capacity = Counter(range(grid.cells))
    capacity.update(grid.extras)
    return capacity


def leader_cells(grid: Grid) -> list[int]:
    """Cells of which every line of every dimension holds at least one: those whose
    coordinates sum to a multiple of the shortest side (a line along a side of ``s ≥ m``
    runs through ``s`` consecutive sums, so through a multiple of ``m``)."""
    m = min(grid.sides)
    return [c for c in range(grid.cells) if sum(grid.coords(c)) % m == 0]


def place_all(
    members: Iterable[str],
    target_group_size: int,
    round_index: int = 0,
    previous: Placement | None = None,
    hosts: frozenset[str] | None = None,
) -> Placement:
    """Every member's cell for round ``round_index``. Without ``previous`` (or when the
    grid's sides changed) the peers take the places of :func:`rank_order`. Otherwise every
    member keeps its cell from ``previous`` while the layout has room there (in rank
    order), and the others (newcomers, and peers of a cell that lost its extra) fill the
    free places: first the cells nobody holds, then the extra places, each peer taking a
    free one at its :func:`home_coordinate` along this round's dimension where one is left,
    else the first free one. A departure or an arrival moves no other peer unless the
    number of extras drops; the layout stays that of :func:`grid_for` (full, balanced).

    ``hosts``: the members that accept connections (None: all of them). A group needs one
    to lead it, so on a new grid the hosts take the :func:`leader_cells` first, in rank
    order, and every line holds one wherever there are enough of them; a newcomer that is
    a host takes a free leader cell first."""
    order = rank_order(members)
    grid = grid_for(len(order), target_group_size)
    if previous is None or previous.grid.sides != grid.sides:
        if hosts is None or len(hosts) >= len(order):
            return Placement(grid, {p: grid.cell_of(i) for i, p in enumerate(order)})
        return Placement(grid, _leaders_first(grid, order, hosts))
    room = _capacities(grid)
    cells: dict[str, int] = {}
    for peer in order:
        cell = previous.cells.get(peer)
        if cell is not None and room[cell] > 0:
            room[cell] -= 1
            cells[peer] = cell
    held = Counter(cells.values())
    empty = [c for c in range(grid.cells) if room[c] > 0 and held[c] == 0]
    extra = [c for c in range(grid.cells) for _ in range(room[c] - (held[c] == 0))]
    dim = round_index % grid.dims
    waiting = [p for p in order if p not in cells]
    if hosts is not None:  # hosts first, to the free leader cells of lines without a host
        leaders = set(leader_cells(grid))
        led = {c for p, c in cells.items() if p in hosts}
        for peer in [p for p in waiting if p in hosts]:
            free_leader = next((c for c in empty if c in leaders and c not in led), None)
            if free_leader is None:
                break
            empty.remove(free_leader)
            cells[peer] = free_leader
            led.add(free_leader)
        waiting = [p for p in waiting if p not in cells]
    for free in (empty, extra):
        by_coordinate: dict[int, list[int]] = {}
        for cell in free:
            by_coordinate.setdefault(grid.coords(cell)[dim], []).append(cell)
        unplaced = []
        for peer in waiting:
            there = by_coordinate.get(home_coordinate(peer, grid, dim))
            if there:
                cells[peer] = there.pop(0)
            else:
                unplaced.append(peer)
        left = sorted(c for cs in by_coordinate.values() for c in cs)
        for peer, cell in zip(unplaced, left, strict=False):
            cells[peer] = cell
        waiting = unplaced[len(left) :]
    assert not waiting, "the layout holds exactly one place per member"
    return Placement(grid, cells)


def _leaders_first(grid: Grid, order: list[str], hosts: frozenset[str]) -> dict[str, int]:
    """A new grid's places with the hosts on the leader cells first (then the cells and
    the extras' places in order, as :meth:`Grid.cell_of` lays them out)."""
    places = [grid.cell_of(i) for i in range(len(order))]
    leaders = set(leader_cells(grid))
    first = [c for c in places[: grid.cells] if c in leaders]
    rest = [c for c in places[: grid.cells] if c not in leaders] + places[grid.cells :]
    leading = [p for p in order if p in hosts][: len(first)]
    taken = set(leading)
    cells = dict(zip(leading, first, strict=False))
    free = first[len(leading) :] + rest
    cells.update(zip([p for p in order if p not in taken], free, strict=True))
    return cells


@dataclass(frozen=True)
class GridPlace:
    """Where a peer averages in a round: its group-bits string (the averaged coordinate
    first, as :func:`~peer.averaging.matchmaking.group_bits.group_key` expects), its weight, and the
    placement of every member it was computed with (pass it on as ``previous``)."""

    grid: Grid
    cell: int
    dim: int  # the dimension averaged this round
    bits: str
    weight: float
    placement: Placement


def place_in_grid(
    members: Iterable[str],
    peer_id: str,
    target_group_size: int,
    round_index: int,
    stable_rounds: int,
    previous: Placement | None = None,
    hosts: frozenset[str] | None = None,
) -> GridPlace:
    """This peer's place in round ``round_index`` on the grid of ``members`` (this peer
    included, as this peer sees them), having averaged on the same grid for the previous
    ``stable_rounds`` rounds (0 when the view just changed); ``previous``: the placement
    of the round before, whose cells the members keep, and ``hosts`` (:func:`place_all`)."""
    if round_index < 0 or stable_rounds < 0:
        raise ValueError("round_index and stable_rounds must not be negative")
    view = frozenset(members)
    if peer_id not in view:
        raise ValueError("the peer must be among the members it sees")
    placement = _placement(
        view, target_group_size, 0 if previous is None else round_index, previous, hosts
    )
    grid = placement.grid
    d = grid.dims
    cell = placement.cells[peer_id]
    dim = round_index % d
    since = stable_rounds if stable_rounds < d else round_index % d
    averaged = frozenset((round_index - i) % d for i in range(1, since + 1))
    w = bits_per_coordinate(target_group_size)
    coords = grid.coords(cell)
    rotated = coords[dim:] + coords[:dim]
    bits = "".join(format(c, f"0{w}b") for c in rotated)
    return GridPlace(grid, cell, dim, bits, grid.weight(cell, averaged), placement)


@functools.lru_cache(maxsize=64)
def _placement(
    members: frozenset[str],
    target_group_size: int,
    round_index: int,
    previous: Placement | None,
    hosts: frozenset[str] | None,
) -> Placement:
    # every peer of a simulated swarm asks for the same placement (``Placement`` hashes by
    # identity: the same ``previous`` object)
    return place_all(members, target_group_size, round_index, previous, hosts)


@dataclass(frozen=True)
class GridHistory:
    """What a peer carries from one round to the next: the placement it averaged on, the
    membership it saw, the rounds counted for its weights (``stable_rounds``), and whether
    the membership held in that round (it was the one of the round before)."""

    placement: Placement | None = None
    view: frozenset[str] = frozenset()
    stable: int = 0
    held: bool = True


def place_next(
    history: GridHistory,
    members: Iterable[str],
    peer_id: str,
    target_group_size: int,
    round_index: int,
    hosts: frozenset[str] | None = None,
) -> tuple[GridPlace, GridHistory]:
    """This peer's place in round ``round_index`` with its placement carried over from
    ``history`` (:func:`place_all`), and the history to pass to the next round. The count
    of rounds behind the weights goes on while the placement is carried over, the
    membership changing or not: the peers kept their cells and hold the means of their
    slabs, newcomers their slab's values (``bench/scale.py``). It starts over on a grid of
    new sides and in the first round of a membership that held since the round before,
    whose values may be off the slabs' means by what the changes brought: every peer then
    holds the mean ``d`` rounds later, ``d + 1`` after the last change."""
    view = frozenset(members)
    previous = history.placement
    carried = (
        previous is not None and grid_for(len(view), target_group_size).sides == previous.grid.sides
    )
    changed = view != history.view
    if not carried:
        stable, held = 0, True
    elif changed:
        stable, held = history.stable + 1, False
    elif not history.held:
        stable, held = 0, True
    else:
        stable, held = history.stable + 1, True
    place = place_in_grid(
        view,
        peer_id,
        target_group_size,
        round_index,
        stable,
        previous if carried else None,
        hosts,
    )
    return place, GridHistory(place.placement, view, stable, held)


def grid_key(prefix: str) -> str:
    """The gossip key under which the peers averaging under ``prefix`` claim their cells."""
    return f"{prefix}.grid"


def claim(place: GridPlace, round_index: int, previous: list[int] | None = None) -> list[int]:
    """What a peer announces of its place in round ``round_index`` (under :func:`grid_key`,
    its peer id the subkey): its cell, the round since which it holds it (that of its
    ``previous`` claim where the cell and the grid are the same) and the grid's sides."""
    held = [place.cell, *place.grid.sides]
    if previous and len(previous) == len(held) + 1 and [previous[0], *previous[2:]] == held:
        return [place.cell, previous[1], *place.grid.sides]
    return [place.cell, round_index, *place.grid.sides]


def with_claims(
    history: GridHistory,
    members: Iterable[str],
    peer_id: str,
    target_group_size: int,
    round_index: int,
    claims: Mapping[str, object],
) -> GridHistory:
    """``history`` to place this peer from in round ``round_index``, with the other members'
    cells taken from their ``claims`` (peer id to :func:`claim`) made before that round on
    the grid that fits ``members``: what they hold, rather than what this peer computed for
    them from views that may have differed. A peer without a placement on that grid (new
    to the swarm, or whose view differed last round) resumes the placement the claims
    describe, with the count behind the weights as after ``d`` rounds on a grid, and takes
    the free cell the others' placements leave it. Claims made in this round are left out:
    they come from peers placed with this one (on a new grid, all by rank). A claim is the
    claimant's word: one cell per member, on this grid, or it is ignored (a false one can
    only misplace this peer within the grid). No claim: ``history`` as it is."""
    view = frozenset(members)
    grid = grid_for(len(view), target_group_size)
    cells: dict[str, int] = {}
    for peer, value in claims.items():
        if peer == peer_id or peer not in view or not isinstance(value, list | tuple):
            continue
        if len(value) != grid.dims + 2 or not all(type(v) is int for v in value):
            continue
        cell, since, *sides = value
        if tuple(sides) == grid.sides and 0 <= cell < grid.cells and since < round_index:
            cells[peer] = cell
    if not cells:
        return history
    own = history.placement
    if own is not None and own.grid.sides == grid.sides:
        if peer_id in own.cells:
            cells[peer_id] = own.cells[peer_id]
        return GridHistory(Placement(grid, cells), history.view, history.stable, history.held)
    return GridHistory(Placement(grid, cells), frozenset(), grid.dims, held=False)
