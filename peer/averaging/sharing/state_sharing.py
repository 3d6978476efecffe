"""State sharing, as one averager takes part in it: declaring this peer as a donor, serving
its state, and downloading the newest state from the others.

A donor declares its ``priority`` under the averager's state key (refreshed every
``declare_period``, retracted when sharing stops); newcomers download from the donor with
the highest priority (:func:`~peer.averaging.sharing.download.download_state`), bounded in size by
what their own state takes. The protocol itself lives in :mod:`peer.averaging.sharing.download`.

:class:`StateSharing` is a collaborator that
:class:`~peer.averaging.averager.DecentralizedAverager` owns and delegates its public
state-sharing API to; everything it needs of the averager is passed in explicitly (what
state to serve, and the two ways of locking the tensors).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

import torch

from peer.averaging.protocol import STATE_BEGIN, STATE_CHUNK, STATE_DIGEST
from peer.averaging.seam import Link, NodeCore, NodeHandle
from peer.averaging.sharing.download import StateServer, download_state, state_key
from peer.averaging.sharing.witnesses import Refusals
from peer.compression import Compression
from peer.exceptions import SwarmgradError
from peer.wire import Frame

logger = logging.getLogger("peer.averaging.averager")

__all__ = ["STATE_SIZE_FACTOR", "STATE_SIZE_SLACK", "StateServerFactory", "StateSharing"]

#: a donor's state may take at most STATE_SIZE_FACTOR times this peer's own state + SLACK bytes
STATE_SIZE_FACTOR = 8
STATE_SIZE_SLACK = 16 << 20

#: builds the donor side; takes :class:`~peer.averaging.sharing.download.StateServer`'s arguments
StateServerFactory = Callable[..., StateServer]

#: ``(metadata, tensors)`` this peer serves
State = tuple[Any, Sequence[torch.Tensor]]


class StateSharing:
    """One averager's declaring, serving and downloading of state.

    ``get_state`` gives what this peer serves (called with the tensors locked: on the node's
    loop under ``locked()``, an async context manager, and in a caller's thread under
    ``hold()``, a plain one). ``client_mode`` peers cannot share (nobody can dial them).
    ``server_factory`` builds the donor side: the averager's ``state_server_class``.

    Lifetime: :meth:`start` on the node's loop (registers nothing: the averager routes
    ``avg.state_*`` requests to :meth:`serve`), :meth:`stop` there to retract.
    """

    def __init__(
        self,
        node: NodeHandle,
        prefix: str,
        *,
        get_state: Callable[[], State],
        locked: Callable[[], AbstractAsyncContextManager[Any]],
        hold: Callable[[], AbstractContextManager[Any]],
        compression: Compression,
        chunk_bytes: int,
        request_timeout: float,
        chunk_timeout: float,
        declare_period: float,
        allow: bool,
        client_mode: bool,
        server_factory: StateServerFactory = StateServer,
    ) -> None:
        if allow and client_mode:
            raise ValueError("a client-mode averager cannot share state (nobody can dial it)")
        if declare_period <= 0:
            raise ValueError("declare_state_period must be positive")
        self.node = node
        self.prefix = prefix
        self.get_state = get_state
        self._locked = locked
        self._hold = hold
        self.compression = compression
        self.chunk_bytes = chunk_bytes
        self.request_timeout = request_timeout
        self.chunk_timeout = chunk_timeout
        self.declare_period = declare_period
        self.client_mode = client_mode
        self._server_factory = server_factory
        self._allow = allow
        self._priority = 0.0
        #: the donor of the last state downloaded
        self.last_donor: str | None = None
        #: donors this peer no longer downloads from (:mod:`peer.averaging.sharing.witnesses`)
        self.refusals = Refusals()
        # loop-side, from start() to stop()
        self._core: NodeCore | None = None
        self._server: StateServer | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._declared_until = 0.0

    # ------------------------------------------------------------------ settings

    @property
    def allow(self) -> bool:
        return self._allow

    @allow.setter
    def allow(self, value: bool) -> None:
        if value and self.client_mode:
            raise ValueError("a client-mode averager cannot share state")
        self._allow = bool(value)
        self._wake_declare()

    @property
    def priority(self) -> float:
        return self._priority

    @priority.setter
    def priority(self, value: float) -> None:
        self._priority = float(value)
        self._wake_declare()

    def _wake_declare(self) -> None:
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(RuntimeError):  # the node's loop is closed: nothing to do
                self.node.loop.call_soon_threadsafe(wake.set)

    # ------------------------------------------------------------------ lifetime

    def start(self, core: NodeCore) -> None:
        """Begin serving and declaring (on the node's loop)."""
        self._core = core
        self._server = self._server_factory(
            self.get_state, self.compression, self.chunk_bytes, self._locked
        )
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._declare_state_loop())

    async def stop(self) -> None:
        """Stop declaring and retract the declaration, if any (on the node's loop)."""
        self._wake = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        core = self._core
        if core is not None and self._declared_until:
            with contextlib.suppress(SwarmgradError):
                await core.store(
                    state_key(self.prefix), None, self._declared_until + 1.0, subkey=core.peer_id
                )

    async def _declare_state_loop(self) -> None:
        core, wake = self._core, self._wake
        assert core is not None and wake is not None
        period = self.declare_period
        while True:
            wake.clear()
            expiration = max(core.now() + period, self._declared_until + 1e-3)
            value = self._priority if self._allow else None
            if value is not None or self._declared_until:
                with contextlib.suppress(SwarmgradError):
                    await core.store(state_key(self.prefix), value, expiration, subkey=core.peer_id)
                    self._declared_until = expiration
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period / 2):
                    await wake.wait()

    # ------------------------------------------------------------------- serving

    async def serve(self, link: Link, frame: Frame) -> Frame:
        """Answer a newcomer's ``avg.state_begin`` / ``avg.state_chunk`` /
        ``avg.state_digest``; ``ValueError`` if this peer does not share its state (a
        transfer already begun is finished all the same)."""
        server = self._server
        if server is None or (frame.type != STATE_CHUNK and not self._allow):
            raise ValueError("this peer does not share its state")
        if frame.type == STATE_BEGIN:
            return await server.on_begin(link, frame)
        if frame.type == STATE_CHUNK:
            return await server.on_chunk(link, frame)
        if frame.type == STATE_DIGEST:
            return await server.on_digest(link, frame, self._priority)
        raise ValueError(f"not a state request: {frame.type}")

    # ---------------------------------------------------------------- downloading

    def load(
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
        """See :meth:`DecentralizedAverager.load_state_from_peers
        <peer.averaging.averager.DecentralizedAverager.load_state_from_peers>`."""
        max_bytes = self._state_size_bound()

        async def download() -> tuple[Any, list[torch.Tensor]] | None:
            core, server = self._core, self._server
            if core is None or server is None:
                raise RuntimeError("the averager has not started: call run() first")
            try:
                async with asyncio.timeout(timeout):
                    found = await download_state(
                        core,
                        self.prefix,
                        request_timeout=self.request_timeout,
                        chunk_timeout=self.chunk_timeout,
                        max_bytes=max_bytes,
                        max_priority=max_priority,
                        min_priority=min_priority,
                        check=check,
                        own=await server.digest() if holding else None,
                        partners=frozenset(partners),
                        refusals=self.refusals,
                        prefer=frozenset(prefer),
                    )
            except TimeoutError:
                logger.warning("state download did not finish within %s s", timeout)
                return None
            if found is None:
                return None
            metadata, tensors, donor = found
            self.last_donor = donor
            return metadata, tensors

        future = self.node.run_coroutine(download(), wait=False)
        return future.result() if wait else future

    def refused_donors(self) -> frozenset[str]:
        """The donors (peer ids) whose states this peer dropped (any thread)."""
        return frozenset(self.refusals.peers)

    def _state_size_bound(self) -> int:
        """The most bytes a donor's state may take: a few times this peer's own state (same
        model; an optimizer's state may not exist here yet) plus room for headers, so a
        hostile donor cannot make this peer allocate what it claims."""
        with self._hold():
            _, tensors = self.get_state()
            own = sum(t.numel() * t.element_size() for t in tensors)
        return STATE_SIZE_FACTOR * own + STATE_SIZE_SLACK
