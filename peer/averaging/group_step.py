"""One averaging step of a :class:`~peer.averaging.averager.DecentralizedAverager`: find a
group, run its all-reduce, and say how it went.

Mixed into the averager (whose attributes these are): :meth:`GroupSteps.step` is the public
entry; on the node's loop a step tries matchmaking (:mod:`peer.averaging.matchmaking.driver`)
until a group forms or the step's deadline passes, waits for the caller's trigger if asked
to, then runs the group's all-reduce (:class:`~peer.averaging.allreduce.runner.AllreduceRunner`)
on the tensors — in place with their lock held, or on a snapshot whose change is added back
(``concurrent_updates``) — and retries a failed all-reduce within the deadline. What the
last round did is kept for the callers (``last_group``, ``last_round_left``, ...).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from peer.averaging.allreduce.inbox import RoundInbox
from peer.averaging.allreduce.members import certified, pack_metadata, parse_members
from peer.averaging.allreduce.partition import FlatLayout
from peer.averaging.allreduce.runner import AllreduceConfig, MemberInfo, RunnerFactory
from peer.averaging.control import AveragingStage, StepControl
from peer.averaging.exceptions import (
    AllreduceFailed,
    AllreduceTimeout,
    BadContribution,
    MatchmakingFailed,
    NonFiniteTensors,
    StepCancelled,
    StepFailed,
)
from peer.averaging.matchmaking.driver import MatchmakingDriver
from peer.averaging.matchmaking.group_bits import (
    bits_per_coordinate,
    next_group_bits,
    slot_in_group,
)
from peer.averaging.matchmaking.messages import GroupInfo, MatchmakingConfig
from peer.averaging.protocol import ABORT
from peer.averaging.round_tensors import AveragedTensors
from peer.averaging.seam import NodeCore, NodeHandle
from peer.compression import Compression, TensorRole
from peer.exceptions import SwarmgradError
from peer.formats.open_types import UserMetadata
from peer.wire import Frame

if TYPE_CHECKING:
    from peer.averaging.averager import AveragerConfig

logger = logging.getLogger("peer.averaging")

__all__ = ["GroupSteps"]


class GroupSteps:
    """Mixed into :class:`~peer.averaging.averager.DecentralizedAverager`, whose attributes
    these are (see the module docstring)."""

    node: NodeHandle
    config: AveragerConfig
    matchmaking_config: MatchmakingConfig
    allreduce_config: AllreduceConfig
    layout: FlatLayout
    compression: Compression
    roles: list[TensorRole] | None
    schema_hash: bytes
    _tensors: AveragedTensors
    _inbox: RoundInbox
    _driver: MatchmakingDriver | None
    _step_lock: asyncio.Lock | None
    _step_futures: set[concurrent.futures.Future[Any]]
    runner_class: ClassVar[RunnerFactory]
    _group_bits: str
    _running: bool
    _shut: bool

    if TYPE_CHECKING:  # what the class it is mixed into provides

        @property
        def peer_id(self) -> str: ...

        @property
        def core(self) -> NodeCore: ...

        def _group_key(self) -> str: ...

    def withdrawn_peers(self) -> frozenset[str]:
        """While a step looks for a group: the peers that looked for one under the same key
        and withdrew, because their group began without this peer or they gave up. They
        will not join this step's group, so a caller that knows who else could still come
        (e.g. from progress reports) can call the step off early. Empty otherwise."""
        driver = self._driver
        return driver.withdrawn if driver is not None else frozenset()

    def step(
        self,
        gather: object = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        wait: bool = True,
    ) -> dict[str, UserMetadata] | StepControl:
        """Find a group and average with it.

        ``gather`` (any msgpack-serialisable value) is shared with the group; the result maps
        every member's peer id to its ``gather``. ``weight`` defaults to 1 (0 for auxiliary
        peers). ``scheduled_time`` (wall clock) is when the group should assemble, at the
        earliest ``now + min_matchmaking_time``. ``timeout`` bounds the whole step;
        ``allow_retries`` retries matchmaking and a failed all-reduce within it.
        ``require_trigger`` waits for :meth:`StepControl.allow_allreduce` once the group is
        formed. ``wait=False`` returns a :class:`StepControl` at once.

        Raises a :class:`~peer.averaging.exceptions.StepFailed` subclass on failure.
        """
        if self._shut or not self._running:
            raise RuntimeError("the averager is not running (start=True or run())")
        if weight is None:
            weight = 0.0 if self.config.auxiliary else 1.0
        weight = float(weight)
        if not weight >= 0 or weight == float("inf"):
            raise ValueError("weight must be finite and non-negative")
        if self.config.auxiliary and weight != 0:
            raise ValueError("an auxiliary averager contributes nothing: weight must be 0")
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be positive")
        metadata = pack_metadata(self.config.bandwidth, self.config.auxiliary, weight, gather)
        control = StepControl(
            self.node.loop,
            scheduled_time=scheduled_time,
            weight=weight,
            require_trigger=require_trigger,
            data_for_gather=gather,
        )
        deadline = None if timeout is None else self.node.get_time() + timeout
        future = self.node.run_coroutine(
            self._step(control, metadata, deadline, allow_retries), wait=False
        )
        self._step_futures.add(future)
        future.add_done_callback(self._step_futures.discard)
        if wait:
            return control.result()
        return control

    async def _step(
        self, control: StepControl, metadata: bytes, deadline: float | None, allow_retries: bool
    ) -> None:
        assert self._step_lock is not None
        try:
            async with self._step_lock:
                result = await self._step_attempts(control, metadata, deadline, allow_retries)
        except StepFailed as exc:
            control._finish(error=exc)
        except asyncio.CancelledError:
            control._finish(error=StepCancelled("the averager was shut down"))
            raise
        except Exception as exc:
            logger.exception("averaging step failed unexpectedly")
            error = AllreduceFailed(f"unexpected error: {exc!r}")
            error.__cause__ = exc
            control._finish(error=error)
        else:
            control._finish(result)

    async def _step_attempts(
        self, control: StepControl, metadata: bytes, deadline: float | None, allow_retries: bool
    ) -> dict[str, UserMetadata]:
        core = self.core
        mm = self.matchmaking_config
        first = True
        while True:
            if control.cancel_requested:
                raise StepCancelled("step cancelled")
            control._set_stage(AveragingStage.LOOKING_FOR_GROUP)
            now = core.now()
            scheduled = control.scheduled_time if first else None
            start_time = max(now + mm.min_matchmaking_time, scheduled or now)
            # a finite attempt: a follower of a dead leader gives up by then, and we retry
            attempt_deadline = start_time + mm.min_matchmaking_time + mm.request_timeout
            if deadline is not None:
                attempt_deadline = min(attempt_deadline, deadline)
            first = False
            assert self._driver is not None
            try:
                group = await self._driver.find_group(
                    group_key=self._group_key(),
                    schema_hash=self.schema_hash,
                    metadata=metadata,
                    scheduled_time=scheduled,
                    deadline=attempt_deadline,
                    client_mode=self.config.client_mode,
                    cancel=control._cancel,
                )
            except MatchmakingFailed:
                self._inbox.early.drop()
                if deadline is not None and core.now() >= deadline:
                    raise
                continue
            self._inbox.early.drop(keep=group.group_id)
            try:
                return await self._run_group(control, group, deadline)
            except AllreduceFailed as exc:
                if not allow_retries or (deadline is not None and core.now() >= deadline):
                    raise
                logger.info("all-reduce failed (%s); retrying", exc)

    async def _run_group(
        self, control: StepControl, group: GroupInfo, deadline: float | None
    ) -> dict[str, UserMetadata]:
        core = self.core
        members, gathered = parse_members(group)
        members = [certified(member, core.certified_role(member.peer_id)) for member in members]
        if control.require_trigger and not control._trigger.is_set():
            control._set_stage(AveragingStage.AWAITING_TRIGGER)
            waiters = [
                asyncio.ensure_future(control._trigger.wait()),
                asyncio.ensure_future(control._cancel.wait()),
            ]
            timeout = None if deadline is None else max(0.0, deadline - core.now())
            try:
                await asyncio.wait(waiters, timeout=timeout, return_when="FIRST_COMPLETED")
            finally:
                for waiter in waiters:
                    waiter.cancel()
                await asyncio.gather(*waiters, return_exceptions=True)
            if not control._trigger.is_set():
                await self._leave_group(group, "cancelled before all-reduce")
                if control._cancel.is_set():
                    raise StepCancelled("step cancelled while awaiting the trigger")
                raise AllreduceFailed("the step's deadline passed while awaiting the trigger")
        with control._lock:
            if control._cancel_requested:
                cancelled = True
            else:
                cancelled = False
                control._stage = AveragingStage.RUNNING_ALLREDUCE
                control._ran_allreduce = True
        if cancelled:
            await self._leave_group(group, "cancelled before all-reduce")
            raise StepCancelled("step cancelled before all-reduce")
        began = asyncio.get_running_loop().time()
        if self.config.concurrent_updates:
            async with self._tensors.locked():
                flat = self._tensors.snapshot()  # [total], in a buffer reused across rounds
            await self._run_allreduce(group, members, control.weight, flat)
        else:
            async with self._tensors.held_for_round():
                await self._run_allreduce(group, members, control.weight, None)
        self._advance_group_bits(group)
        self.last_allreduce_seconds = asyncio.get_running_loop().time() - began
        return gathered

    def _round_config(self, group: GroupInfo) -> AllreduceConfig:
        """The round's settings. A pair under a robust aggregator holds every average to the
        pair rule (:func:`~peer.averaging.allreduce.robust.pair_average`): in a swarm of three or
        more a pair is where a hostile leader cuts one honest peer off to steer it. In a swarm of
        two (the live members this node knows, itself included) the pair is the whole swarm: there
        is no majority to protect and no larger group to wait for, so it averages plainly; the pair
        rule would leave two honest volunteers' gradients or pseudo-gradients, which seldom lie
        within its radius, each its own: two models."""
        config = self.allreduce_config
        if config.aggregator != "mean" and group.size == 2:
            live = [m for m in self.core.members().values() if not m.leaving]
            if len(live) <= 2:
                return replace(config, aggregator="mean")
        return config

    async def _run_allreduce(
        self,
        group: GroupInfo,
        members: list[MemberInfo],
        weight: float,
        snapshot: torch.Tensor | None,
    ) -> None:
        """The all-reduce of a round: on ``snapshot`` (then add ``average - snapshot`` to the
        tensors) or, when it is None, in place with the tensors' lock held."""
        in_place = snapshot is None
        copy_back = False
        self.last_group = frozenset(group.peer_ids)
        if snapshot is not None:
            flat = snapshot
        else:
            flat, copy_back = self._tensors.in_place(auxiliary=self.config.auxiliary)
        try:
            runner = type(self).runner_class(
                self.core,
                self.config.prefix,
                group,
                members,
                self.layout,
                flat,
                weight=weight,
                compression=self.compression,
                roles=self.roles,
                config=self._round_config(group),
                scratch=self._tensors.accumulator,
                in_place=in_place,
                alpha=self.config.averaging_alpha,
            )
        except ValueError as exc:
            await self._leave_group(group, str(exc))
            raise AllreduceFailed(f"cannot average with this group: {exc}") from exc
        try:
            self._inbox.open(group.group_id, runner)
            timeout = self.config.allreduce_timeout
            try:
                async with asyncio.timeout(timeout):
                    await runner.run()
            except BadContribution as exc:  # raised by run() only for this peer's own values
                await runner.abort("its own values are not finite")
                raise NonFiniteTensors(
                    "the averaged tensors hold NaN or Inf values; this peer left the round"
                ) from exc
            except TimeoutError:
                await runner.abort("all-reduce timeout")
                raise AllreduceTimeout(
                    f"all-reduce did not finish within allreduce_timeout={timeout} s"
                ) from None
            finally:
                if copy_back:  # parts that finished are kept, as with an alias
                    self._tensors.copy_back(flat)
        finally:
            self._inbox.close(group.group_id)
        if not in_place and not self.config.auxiliary:
            async with self._tensors.locked():
                self._tensors.apply(flat, self.config.averaging_alpha)
        self.last_round_left = frozenset(runner.round.left)
        self.last_round_included = MappingProxyType(dict(runner.included))
        if runner.failed:
            logger.info(
                "averaged with %d of %d peers (%d left the round)",
                len(runner.contributors),
                group.size,
                len(runner.failed),
            )

    async def _leave_group(self, group: GroupInfo, reason: str) -> None:
        frame = Frame(ABORT, {"p": self.config.prefix, "g": group.group_id, "why": reason[:200]})
        self._inbox.close(group.group_id)

        async def tell(peer_id: str) -> None:
            with contextlib.suppress(SwarmgradError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.core.send(peer_id, frame)

        await asyncio.gather(*(tell(p) for p in group.peer_ids if p != self.peer_id))

    def _advance_group_bits(self, group: GroupInfo) -> None:
        target = self.matchmaking_config.target_group_size
        if target is None or not self._group_bits or bits_per_coordinate(target) == 0:
            return
        slot = slot_in_group(group.group_id, group.index_of(self.peer_id), group.size, target)
        if slot < 2 ** bits_per_coordinate(target):
            self._group_bits = next_group_bits(self._group_bits, slot, target)

    # ------------------------------------------------------------------- reports

    #: wall time of the last successful all-reduce (snapshot to write-back), for benchmarks
    last_allreduce_seconds: float | None = None
    #: members that left the last all-reduce this peer finished (excluded in both roles, or
    #: reducers silent until the timeout before all their averages came: ButterflyRound.left):
    #: the parts a departed reducer left open were finished by the survivors whose view of
    #: the round agreed with this peer's (see last_round_included), or kept this peer's own
    #: values, so results may differ from those of members whose view differed
    last_round_left: frozenset[str] = frozenset()
    #: ``(start, stop) → members`` of the flat vector's slots the survivors of the last
    #: all-reduce finished after a reducer left: whose contributions this peer's result
    #: holds there (AllreduceRunner.included); empty when no reducer left
    last_round_included: Mapping[tuple[int, int], frozenset[str]] = MappingProxyType({})
    #: the members of the last group whose all-reduce this peer began (itself included),
    #: whether or not it finished: the peers that may hold that round's result
    last_group: frozenset[str] = frozenset()
