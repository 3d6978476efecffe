"""State sharing for :class:`~peer.averaging.averager.DecentralizedAverager`: declaring this
peer as a donor, and downloading the newest state from the others.

A donor declares its ``state_sharing_priority`` under the averager's state key (refreshed
every ``declare_state_period``, retracted when sharing stops); newcomers download from the
donor with the highest priority (:func:`~peer.averaging.state.download_state`), bounded in
size by what their own state takes. The protocol itself lives in
:mod:`peer.averaging.state`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from peer.averaging.seam import NodeCore, NodeHandle
from peer.averaging.state import download_state, state_key
from peer.exceptions import SwarmgradError

logger = logging.getLogger("peer.averaging.averager")

__all__ = ["STATE_SIZE_FACTOR", "STATE_SIZE_SLACK", "StateSharing"]

#: a donor's state may take at most STATE_SIZE_FACTOR times this peer's own state + SLACK bytes
STATE_SIZE_FACTOR = 8
STATE_SIZE_SLACK = 16 << 20


class StateSharing:
    """Mixed into :class:`~peer.averaging.averager.DecentralizedAverager`, whose attributes
    these are."""

    node: NodeHandle
    config: Any  # AveragerConfig
    matchmaking_config: Any  # MatchmakingConfig
    _averaged_tensors: Sequence[torch.Tensor]
    _allow_state_sharing: bool
    _state_sharing_priority: float
    _running: bool
    _shut: bool
    _declare_wake: asyncio.Event | None
    _declared_until: float

    #: the donor of the last state downloaded
    last_state_donor: str | None = None

    if TYPE_CHECKING:  # provided by DecentralizedAverager

        @property
        def core(self) -> NodeCore: ...

        def get_group_bits(self) -> str: ...

        def get_tensors(self) -> AbstractContextManager[Sequence[torch.Tensor]]: ...

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        """What this peer shares with newcomers: ``(metadata, tensors)``. Override to share
        more (e.g. optimizer state). Metadata must be msgpack-serialisable. Called on the
        node's event loop with the tensors locked."""
        return {"group_bits": self.get_group_bits()}, self._averaged_tensors

    def load_state_from_peers(
        self,
        wait: bool = True,
        timeout: float | None = None,
        *,
        max_priority: float = math.inf,
        check: Callable[[Any], str | None] | None = None,
    ) -> tuple[Any, list[torch.Tensor]] | concurrent.futures.Future[Any] | None:
        """Download ``(metadata, tensors)`` from the donor with the highest
        ``state_sharing_priority`` (random among ties), falling back to the next one if a
        donor fails. Returns None if no donor could provide it within ``timeout``. Donors
        declaring a priority over ``max_priority`` are not asked; a state whose metadata
        ``check`` refuses (it returns why; called on the node's loop) is dropped and the
        next donor asked."""

        max_bytes = self._state_size_bound()

        async def download() -> tuple[Any, list[torch.Tensor]] | None:
            try:
                async with asyncio.timeout(timeout):
                    found = await download_state(
                        self.core,
                        self.config.prefix,
                        request_timeout=self.matchmaking_config.request_timeout,
                        chunk_timeout=self.config.next_chunk_timeout,
                        max_bytes=max_bytes,
                        max_priority=max_priority,
                        check=check,
                    )
            except TimeoutError:
                logger.warning("state download did not finish within %s s", timeout)
                return None
            if found is None:
                return None
            metadata, tensors, donor = found
            self.last_state_donor = donor
            return metadata, tensors

        future = self.node.run_coroutine(download(), wait=False)
        return future.result() if wait else future

    def _state_size_bound(self) -> int:
        """The most bytes a donor's state may take: a few times this peer's own state (same
        model; an optimizer's state may not exist here yet) plus room for headers, so a
        hostile donor cannot make this peer allocate what it claims."""
        with self.get_tensors():
            _, tensors = self.get_current_state()
            own = sum(t.numel() * t.element_size() for t in tensors)
        return STATE_SIZE_FACTOR * own + STATE_SIZE_SLACK

    @property
    def allow_state_sharing(self) -> bool:
        return self._allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if value and self.config.client_mode:
            raise ValueError("a client-mode averager cannot share state")
        self._allow_state_sharing = bool(value)
        self._wake_declare()

    @property
    def state_sharing_priority(self) -> float:
        return self._state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._state_sharing_priority = float(value)
        self._wake_declare()

    def _wake_declare(self) -> None:
        if self._running and self._declare_wake is not None and not self._shut:
            self.node.loop.call_soon_threadsafe(self._declare_wake.set)

    async def _declare_state_loop(self) -> None:
        core = self.core
        period = self.config.declare_state_period
        assert self._declare_wake is not None
        while True:
            self._declare_wake.clear()
            expiration = max(core.now() + period, self._declared_until + 1e-3)
            value = self._state_sharing_priority if self._allow_state_sharing else None
            if value is not None or self._declared_until:
                with contextlib.suppress(SwarmgradError):
                    await core.store(
                        state_key(self.config.prefix), value, expiration, subkey=core.peer_id
                    )
                    self._declared_until = expiration
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period / 2):
                    await self._declare_wake.wait()
