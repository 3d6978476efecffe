"""``DecentralizedAverager``: average tensors with peers in groups, without a server.

The public signature mirrors hivemind's ``hivemind.averaging.DecentralizedAverager`` (pass a
:class:`peer.Node` where hivemind took a ``DHT``). Inside, the options are grouped into
small frozen configs (:class:`~peer.averaging.matchmaking.machine.MatchmakingConfig`,
:class:`~peer.averaging.allreduce.runner.AllreduceConfig`, :class:`AveragerConfig`) and the work
is split into layers beside this module: ``group_step`` (one step: find a group and average
with it; mixed into the averager), ``matchmaking`` (pure state machine) and
``matchmaking_io`` (its I/O), ``members`` (what each member tells its group), ``butterfly``
(one round, pure) and ``allreduce`` (its driver), ``sharing`` (a
:class:`~peer.averaging.sharing.state_sharing.StateSharing` the averager owns: declaring, serving
and downloading state) over ``state`` (its protocol), ``control`` (:class:`StepControl`),
``round_tensors`` (the tensors' lock and each round's flat buffer).

Use: build one over the tensors to average, call :meth:`~DecentralizedAverager.step` (the
class docstring has its failure contract), and :meth:`~DecentralizedAverager.shutdown`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from peer.averaging.allreduce.inbox import RoundInbox
from peer.averaging.allreduce.partition import FlatLayout, schema_hash
from peer.averaging.allreduce.runner import AllreduceConfig, AllreduceRunner, RunnerFactory
from peer.averaging.group_step import GroupSteps
from peer.averaging.matchmaking.driver import MatchmakingDriver
from peer.averaging.matchmaking.grid import (
    GridHistory,
    claim,
    grid_key,
    place_next,
    with_claims,
)
from peer.averaging.matchmaking.group_bits import (
    group_key,
    validate_group_bits,
)
from peer.averaging.matchmaking.messages import MatchmakingConfig
from peer.averaging.protocol import (
    ABORT,
    AVERAGE,
    JOIN,
    NOTICE,
    PART,
    STATE_BEGIN,
    STATE_CHUNK,
    STATE_DIGEST,
    Router,
)
from peer.averaging.round_tensors import AveragedTensors
from peer.averaging.seam import Link, NodeCore, NodeHandle
from peer.averaging.sharing.download import StateServer
from peer.averaging.sharing.state_sharing import StateServerFactory, StateSharing
from peer.compression import Compression, CompressionInfo, NoCompression, TensorRole
from peer.exceptions import SwarmgradError
from peer.wire import Frame

logger = logging.getLogger("peer.averaging")

#: seconds a peer's claim of its grid cell lives; it is stored again when the cell
#: changes and half-way through (a claim only guides newcomers, so it may be old)
GRID_CLAIM_TTL = 600.0

__all__ = ["AveragerConfig", "DecentralizedAverager"]


@dataclass(frozen=True)
class AveragerConfig:
    """Per-averager options that are neither matchmaking nor all-reduce."""

    prefix: str
    averaging_alpha: float = 1.0
    allreduce_timeout: float | None = None
    next_chunk_timeout: float = 10.0
    bandwidth: float | None = None
    auxiliary: bool = False
    client_mode: bool = False
    declare_state_period: float = 30.0
    shutdown_timeout: float = 5.0
    poll_interval: float = 0.1
    concurrent_updates: bool = False

    def __post_init__(self) -> None:
        if not self.prefix or not isinstance(self.prefix, str):
            raise ValueError("prefix must be a non-empty string")
        if not 0.0 <= self.averaging_alpha <= 1.0:
            raise ValueError("averaging_alpha must be in [0, 1]")
        if self.client_mode and self.auxiliary:
            raise ValueError("an auxiliary peer must reduce, so it cannot be in client mode")
        if self.bandwidth is not None and self.bandwidth < 0:
            raise ValueError("bandwidth must be non-negative")
        if self.declare_state_period <= 0:
            raise ValueError("declare_state_period must be positive")


class DecentralizedAverager(GroupSteps):
    """Average ``averaged_tensors`` with other peers of the swarm sharing ``prefix``.

    Arguments keep hivemind's names and meanings; the notable ones:

    * ``target_group_size`` / ``min_group_size`` / ``min_matchmaking_time``: groups of at most
      / at least that many, assembled about ``min_matchmaking_time`` after a step begins;
    * ``initial_group_bits``: Moshpit grid coordinates (see
      :mod:`peer.averaging.matchmaking.group_bits`);
    * ``part_size_bytes``: parts streamed during all-reduce (after compression);
    * ``sender_timeout`` (default ``next_chunk_timeout``, itself default 10 s) /
      ``reducer_timeout`` (default twice ``sender_timeout``) / ``allreduce_timeout``;
    * ``bandwidth`` (relative; 0 reduces nothing), ``client_mode`` (dial out only),
      ``auxiliary`` (reduces, contributes weight 0);
    * ``allow_state_sharing`` (default: not client and not auxiliary),
      ``declare_state_period``;
    * ``concurrent_updates`` (not in hivemind): average a snapshot so that the tensors may
      be updated during a round (see "Tensor access" below);
    * ``max_weight`` (not in hivemind): a contribution weighing more is refused and its
      sender excluded from the round, named in the log (default: no bound);
    * ``relative_weight_bound`` (not in hivemind): each member declares its weight when the
      group forms; a member that declared more than this factor times the group's median
      is excluded from the round, named in the log (default: None, no bound);
    * ``aggregator`` (not in hivemind): ``"mean"`` (default, streamed), ``"trimmed_mean"`` or
      ``"centered_clip"``: how a reducer combines the contributions to each part of its
      span (see :mod:`peer.averaging.allreduce.robust`). Every member should use the same.

    What a subclass overrides (not in hivemind; tests and benchmarks use it for doubles that
    misbehave or count): :attr:`runner_class` builds each round's
    :class:`~peer.averaging.allreduce.runner.AllreduceRunner` and :attr:`state_server_class`
    the donor side :class:`~peer.averaging.sharing.download.StateServer`, each given that
    class's arguments (a subclass, or any callable returning one).

    ``start=False`` defers registration on the node until :meth:`run`. Call
    :meth:`shutdown` when done (or use as a context manager); the node is not shut down.

    Failure contract: :meth:`DecentralizedAverager.step` either returns a dict peer id →
    gathered data (every member of the group, this peer included) with the averaged tensors
    updated in place, or raises a :class:`~peer.averaging.exceptions.StepFailed` subclass —
    ``MatchmakingFailed``, ``AllreduceFailed`` (``AllreduceTimeout``) or ``StepCancelled`` —
    and leaves the tensors unchanged — except that in the default in-place mode a round that
    fails after its all-reduce began (``allreduce_timeout``) keeps the parts it finished: each
    element then holds either its local value or its group's average. It never returns ``None``.

    Tensor access: by default (as in hivemind) a round holds the tensors' lock from the start
    of its all-reduce to the end and averages them in place; with ``concurrent_updates=True``
    it averages a snapshot and adds the change back at the end, so that the tensors may be
    updated during the round. :class:`~peer.averaging.round_tensors.AveragedTensors` owns the
    lock and does that tensor handling (its docstring has the details and costs).
    """

    runner_class: ClassVar[RunnerFactory] = AllreduceRunner
    state_server_class: ClassVar[StateServerFactory] = StateServer

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        node: NodeHandle,
        *,
        start: bool,
        prefix: str,
        target_group_size: int | None = None,
        min_group_size: int = 2,
        initial_group_bits: str = "",
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        averaging_alpha: float = 1.0,
        part_size_bytes: int = 2**19,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        compression: Compression = NoCompression(),
        state_compression: Compression = NoCompression(),
        tensor_infos: Sequence[CompressionInfo] | None = None,
        bandwidth: float | None = None,
        min_vector_size: int = 0,
        auxiliary: bool = False,
        allow_state_sharing: bool | None = None,
        declare_state_period: float = 30,
        client_mode: bool | None = None,
        shutdown_timeout: float = 5,
        concurrent_updates: bool = False,
        max_weight: float = math.inf,
        relative_weight_bound: float | None = None,
        aggregator: str = "mean",
    ) -> None:
        tensors = tuple(averaged_tensors)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError("averaged_tensors must be torch tensors")
            if t.device.type != "cpu":
                raise ValueError("averaged tensors must live on the CPU")
        if client_mode is None:
            client_mode = bool(node.client_mode)
        if node.client_mode and not client_mode:
            raise ValueError("a node in client mode cannot host a non-client averager")
        if tensor_infos is not None and len(tensor_infos) != len(tensors):
            raise ValueError("tensor_infos must describe every averaged tensor")
        chunk_timeout = 10.0 if next_chunk_timeout is None else float(next_chunk_timeout)
        sender = chunk_timeout if sender_timeout is None else float(sender_timeout)
        self.config = AveragerConfig(
            prefix=prefix,
            averaging_alpha=float(averaging_alpha),
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=chunk_timeout,
            bandwidth=bandwidth,
            auxiliary=auxiliary,
            client_mode=client_mode,
            declare_state_period=float(declare_state_period),
            shutdown_timeout=float(shutdown_timeout),
            concurrent_updates=bool(concurrent_updates),
        )
        self.matchmaking_config = MatchmakingConfig(
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=float(min_matchmaking_time),
            request_timeout=float(request_timeout),
        )
        self.allreduce_config = AllreduceConfig(
            part_size_bytes=int(part_size_bytes),
            sender_timeout=sender,
            reducer_timeout=2 * sender if reducer_timeout is None else float(reducer_timeout),
            min_vector_size=int(min_vector_size),
            max_weight=float(max_weight),
            relative_weight_bound=(
                None if relative_weight_bound is None else float(relative_weight_bound)
            ),
            aggregator=aggregator,
        )
        self.node = node
        self._averaged_tensors = tensors
        self.layout = FlatLayout.from_tensors(tensors)
        # their lock, and the buffers each round averages (snapshot, copy, accumulator)
        self._tensors = AveragedTensors(tensors, self.layout)
        self.compression = compression
        self.state_compression = state_compression
        self.roles: list[TensorRole] | None = (
            [info.role for info in tensor_infos] if tensor_infos is not None else None
        )
        self.schema_hash = schema_hash(tensors, compression, self.roles)
        self._group_bits = validate_group_bits(initial_group_bits)
        # place_on_grid: the placement, membership and round count carried to the next round,
        # and the cell this peer claims (and until when)
        self._grid = GridHistory()
        self._claimed: list[int] = []
        self._claimed_until = 0.0
        self._running = False
        self._shut = False
        self._step_futures: set[concurrent.futures.Future[Any]] = set()
        # loop-side state, created in run()
        self._core: NodeCore | None = None
        self._driver: MatchmakingDriver | None = None
        self._inbox = RoundInbox(prefix, self.layout.total * self.layout.dtype.itemsize)
        self._step_lock: asyncio.Lock | None = None
        self.sharing = StateSharing(
            node,
            prefix,
            get_state=self.get_current_state,
            locked=self._locked,
            hold=self.get_tensors,
            compression=state_compression,
            chunk_bytes=self.allreduce_config.part_size_bytes * 2,
            request_timeout=self.matchmaking_config.request_timeout,
            chunk_timeout=self.config.next_chunk_timeout,
            declare_period=self.config.declare_state_period,
            allow=(
                (not client_mode and not auxiliary)
                if allow_state_sharing is None
                else bool(allow_state_sharing)
            ),
            client_mode=client_mode,
            server_factory=type(self).state_server_class,
        )
        if start:
            self.run()

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """Register on the node and start declaring state (done by ``start=True``)."""
        if self._running:
            return
        caller_threads = torch.get_num_threads()
        self.node.run_coroutine(self._start())
        # torch.set_num_threads, called in the loop thread by _start, also changes the
        # process-wide default that threads started later take: put that back (the loop
        # thread keeps its own setting, which is per thread; so does this one)
        torch.set_num_threads(caller_threads)
        self._running = True

    async def _start(self) -> None:
        # Torch in the node's loop thread runs single-threaded. Its operations are small
        # (a part or a batch of parts at a time) and the network is slower than one core;
        # an OpenMP team per operation would compete with the threads that train (or with
        # other peers' processes) for the same cores, and each of its barriers waits until
        # every one of its threads has had a core: seen as stalls of seconds per round when
        # cores are oversubscribed. (A thread takes the process-wide setting on its first
        # parallel operation, get_num_threads included: done first, so that it does not
        # undo this one later.)
        torch.get_num_threads()
        torch.set_num_threads(1)
        core = self._core = self.node.core
        self._driver = MatchmakingDriver(
            core, self.config.prefix, self.matchmaking_config, self.config.poll_interval
        )
        self._step_lock = asyncio.Lock()
        Router.of(core).add(self.config.prefix, self._endpoint, self._route_round)
        self.sharing.start(core)

    def shutdown(self) -> None:
        """Cancel pending steps, stop declaring state and unregister. Idempotent."""
        if self._shut:
            return
        self._shut = True
        for future in list(self._step_futures):
            future.cancel()
        if not self._running:
            return
        with contextlib.suppress(SwarmgradError, concurrent.futures.TimeoutError, RuntimeError):
            future = self.node.run_coroutine(self._stop(), wait=False)
            future.result(self.config.shutdown_timeout)

    async def _stop(self) -> None:
        core = self.core
        Router.of(core).remove(self.config.prefix)
        await self.sharing.stop()
        if self._driver is not None:
            await self._driver.close()
        self._inbox.early.drop()

    def __enter__(self) -> DecentralizedAverager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def client_mode(self) -> bool:
        return self.config.client_mode

    @property
    def mode_auxiliary(self) -> bool:
        return self.config.auxiliary

    # -------------------------------------------------------------------- tensors

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        """The averaged tensors, locked against concurrent all-reduce writes. Modify them
        in place inside the ``with`` block only."""
        with self._tensors.hold() as tensors:
            yield tensors

    def _locked(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The tensors' lock, taken on the event loop (see :mod:`peer.averaging.round_tensors`)."""
        return self._tensors.locked()

    # ------------------------------------------------------------------ group bits

    def get_group_bits(self) -> str:
        return self._group_bits

    def set_group_bits(self, group_bits: str) -> None:
        self._group_bits = validate_group_bits(group_bits)

    def place_on_grid(
        self, members: Iterable[str], round_index: int, clients: Iterable[str] = ()
    ) -> float:
        """Take this round's place on the Moshpit grid that fits ``members`` (the swarm as
        this peer sees it, itself included: e.g. the run's peers with a live progress report)
        for round ``round_index`` (a counter every peer shares, such as the epoch): sets the
        group bits and returns the factor to multiply this round's step weight by when the
        averaged values carry over from round to round (a model's parameters; not fresh
        gradients, whose weight stays their own). The placement carries over from the round
        before (:func:`~peer.averaging.matchmaking.grid.place_next`): with equal step weights
        every peer holds the mean after ``rounds_to_mean(N, target_group_size)`` rounds.
        ``clients``: the members in client mode (no group can be led by one; the others take
        cells that put one on every line). Needs ``target_group_size``."""
        target = self.matchmaking_config.target_group_size
        if target is None:
            raise ValueError("a Moshpit grid needs target_group_size")
        view = frozenset(members) | {self.peer_id}
        in_client_mode = frozenset(clients) & view
        hosts = view - in_client_mode if in_client_mode else None
        # the others' cells as they claim them: a newcomer takes a free one, and a peer whose
        # view differed from the others' falls back into their placement
        claims = self._grid_claims()
        history = with_claims(self._grid, view, self.peer_id, target, round_index, claims)
        place, self._grid = place_next(history, view, self.peer_id, target, round_index, hosts)
        self._group_bits = place.bits
        self._claim(claim(place, round_index, self._claimed))
        return place.weight

    def _grid_claims(self) -> dict[str, object]:
        """The cells the peers averaging under this prefix claim, as this node knows them."""
        core = self.node.core
        try:
            found = self.node.run_coroutine(core.get(grid_key(self.config.prefix)))
        except SwarmgradError:
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(k): getattr(item, "value", None) for k, item in found.value.items()}

    def _claim(self, value: list[int]) -> None:
        """Announce this peer's cell (:func:`~peer.averaging.matchmaking.grid.claim`) when it
        changed, and again before the last announcement expires (once running)."""
        if not self._running:
            return
        core = self.node.core
        now = core.now()
        if value == self._claimed and now < self._claimed_until - GRID_CLAIM_TTL / 2:
            return
        expiration = max(now + GRID_CLAIM_TTL, self._claimed_until + 1e-3)
        self._claimed, self._claimed_until = value, expiration
        key = grid_key(self.config.prefix)

        async def store() -> None:
            with contextlib.suppress(SwarmgradError):
                await core.store(key, value, expiration, subkey=core.peer_id)

        self.node.run_coroutine(store(), wait=False)

    def _group_key(self) -> str:
        target = self.matchmaking_config.target_group_size
        if target is None:
            return f"{self.config.prefix}.0b{self._group_bits}"
        return group_key(self.config.prefix, self._group_bits, target)

    # --------------------------------------------------------------- state sharing

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        """What this peer shares with newcomers: ``(metadata, tensors)``. Override to share
        more (e.g. optimizer state). Metadata must be msgpack-serialisable. Called on the
        node's event loop with the tensors locked (and in the thread of
        :meth:`load_state_from_peers`, to bound what a donor may send)."""
        return {"group_bits": self.get_group_bits()}, self._averaged_tensors

    def load_state_from_peers(
        self,
        wait: bool = True,
        timeout: float | None = None,
        *,
        max_priority: float = math.inf,
        min_priority: float = -math.inf,
        check: Callable[[Any], str | None] | None = None,
        holding: bool = False,
        partners: Collection[str] = (),
        prefer: Collection[str] = (),
    ) -> tuple[Any, list[torch.Tensor]] | concurrent.futures.Future[Any] | None:
        """Download ``(metadata, tensors)`` from the donor with the highest
        ``state_sharing_priority`` (among ties those in ``prefer`` first, such as the
        peers of this peer's Moshpit slab, then at random), falling back to the next one if a donor
        fails. Returns None if no donor could provide it within ``timeout``. Donors declaring a
        priority over ``max_priority`` or under ``min_priority`` are not asked; a state whose
        metadata ``check`` refuses (it returns why; called on the node's loop) is dropped and the
        next donor asked. Other donors judge the state (:mod:`peer.averaging.sharing.witnesses`);
        with ``holding`` (this peer holds a state worth keeping) only a state another volunteer
        confirms is used, or one at ``min_priority`` from one of ``partners`` (the peers that began,
        with this peer, the round that produced it). A donor's state may take at most
        :data:`~peer.averaging.sharing.state_sharing.STATE_SIZE_FACTOR` times this peer's own
        (:meth:`get_current_state`) plus
        :data:`~peer.averaging.sharing.state_sharing.STATE_SIZE_SLACK` bytes."""
        return self.sharing.load(
            wait,
            timeout,
            max_priority=max_priority,
            min_priority=min_priority,
            check=check,
            holding=holding,
            partners=partners,
            prefer=prefer,
        )

    @property
    def last_state_donor(self) -> str | None:
        """The donor of the last state downloaded (None: none yet)."""
        return self.sharing.last_donor

    @property
    def allow_state_sharing(self) -> bool:
        """Whether this peer declares itself a donor and serves its state."""
        return self.sharing.allow

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        self.sharing.allow = value

    @property
    def state_sharing_priority(self) -> float:
        """The priority this peer declares as a donor (newcomers ask the highest first)."""
        return self.sharing.priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self.sharing.priority = value

    # ------------------------------------------------------------------- routing

    async def _endpoint(self, link: Link, frame: Frame) -> Frame | None:
        kind = frame.type
        if kind in (PART, AVERAGE, ABORT):
            self._route_round(link.peer_id, frame)
            return None
        if kind == JOIN:
            assert self._driver is not None
            return await self._driver.on_join(link, frame)
        if kind == NOTICE:
            assert self._driver is not None
            await self._driver.on_notice(link, frame)
            return None
        if kind in (STATE_BEGIN, STATE_CHUNK, STATE_DIGEST):
            return await self.sharing.serve(link, frame)
        return None

    def _route_round(self, sender: str, frame: Frame) -> None:
        driver = self._driver
        self._inbox.route(self.core, driver.machine if driver is not None else None, sender, frame)

    @property
    def core(self) -> NodeCore:
        """The node's event-loop side this averager runs on (once started)."""
        if self._core is None:
            raise RuntimeError("the averager has not started: call run() first")
        return self._core

    def __repr__(self) -> str:
        return f"DecentralizedAverager(prefix={self.config.prefix!r}, peer_id={self.peer_id!r})"
