"""Drive the :class:`~peer.averaging.matchmaking.machine.Matchmaker` over the network.

The state machine decides; this module carries its events and commands:

* declarations go to gossip under the group key (subkey = peer id) and are read back on
  change and every ``poll_interval`` (``on_declaration``; a retracted one: ``forget``);
* ``SendRequest`` becomes an ``avg.join`` request (reply or failure: ``on_join_response`` /
  ``on_request_failed``); join requests to this peer are answered at once with ``Reply``;
* ``Notify`` becomes a one-way ``avg.notice``; received notices go to ``on_notice``;
* timers: the loop sleeps until ``next_wakeup()`` (or the next poll) and calls ``tick``.

Time is the node's wall clock (``core.now()``): declarations carry absolute times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Coroutine
from typing import Any

from peer.averaging.exceptions import MatchmakingFailed, StepCancelled
from peer.averaging.matchmaking.machine import (
    BeginAllreduce,
    Command,
    Declaration,
    Failed,
    FailureReason,
    GroupInfo,
    JoinRequest,
    Matchmaker,
    MatchmakingConfig,
    Notify,
    Publish,
    Reply,
    Retract,
    SendRequest,
)
from peer.averaging.protocol import (
    JOIN,
    decode_declaration,
    decode_notice,
    decode_response,
    encode_declaration,
    encode_notice,
    encode_response,
)
from peer.averaging.seam import Link, NodeCore
from peer.exceptions import SwarmgradError
from peer.wire import Frame

logger = logging.getLogger("peer.averaging.matchmaking")

#: lifetime of a declaration without a deadline; it is re-published before it lapses
_UNBOUNDED_TTL = 60.0


class MatchmakingDriver:
    """One per averager; runs one matchmaking attempt at a time (``find_group``)."""

    def __init__(
        self, core: NodeCore, prefix: str, config: MatchmakingConfig, poll_interval: float
    ) -> None:
        self.core = core
        self.prefix = prefix
        self.config = config
        self.poll_interval = poll_interval
        self.machine = Matchmaker(core.peer_id, config)
        self._result: asyncio.Future[GroupInfo] | None = None
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._published: tuple[Declaration, float] | None = None
        self._group_key: str | None = None
        self._slot_expirations: dict[str, float] = {}
        #: peers that declared under the key of the attempt under way and withdrew: their group
        #: began without this peer, or they gave up; either way they will not join its group
        self.withdrawn: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ attempt

    async def find_group(
        self,
        *,
        group_key: str,
        schema_hash: bytes,
        metadata: bytes,
        scheduled_time: float | None,
        deadline: float | None,
        client_mode: bool,
        cancel: asyncio.Event,
    ) -> GroupInfo:
        """One matchmaking attempt. Returns the group, or raises
        :class:`MatchmakingFailed` (deadline) / :class:`StepCancelled` (``cancel`` set)."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[GroupInfo] = loop.create_future()
        self._result = result
        self._group_key = group_key
        self.withdrawn = frozenset()
        self.machine.known.clear()  # re-learnt from gossip below; drops stale peers
        await self._execute(
            self.machine.start(
                self.core.now(),
                group_key=group_key,
                schema_hash=schema_hash,
                metadata=metadata,
                scheduled_time=scheduled_time,
                deadline=deadline,
                client_mode=client_mode,
            )
        )
        # a declaration arriving under the key wakes the loop now, not at the next poll
        unwatch = self.core.watch(group_key, self._wake.set)
        try:
            while not result.done():
                if cancel.is_set():
                    await self._execute(self.machine.cancel(self.core.now()))
                    self._settle(None, StepCancelled("step cancelled"))
                    break
                await self._poll_declarations()
                if result.done():
                    break
                await self._execute(self.machine.tick(self.core.now()))
                await self._refresh_declaration()
                if result.done():
                    break
                delay = self.poll_interval
                wakeup = self.machine.next_wakeup()
                if wakeup is not None:
                    delay = min(delay, max(0.0, wakeup - self.core.now()))
                self._wake.clear()
                waiters = [asyncio.ensure_future(self._wake.wait())]
                waiters.append(asyncio.ensure_future(cancel.wait()))
                try:
                    await asyncio.wait(waiters, timeout=delay, return_when="FIRST_COMPLETED")
                finally:
                    for waiter in waiters:
                        waiter.cancel()
                    await asyncio.gather(*waiters, return_exceptions=True)
            return await result
        except asyncio.CancelledError:
            # shutdown: release followers and leader before leaving; nobody will read the
            # result now, so it is cancelled rather than given the machine's failure
            result.cancel()
            with contextlib.suppress(Exception):
                await self._execute(self.machine.cancel(self.core.now(), "shutting down"))
            raise
        finally:
            unwatch()
            self._result = None

    # ----------------------------------------------------------------- gossip

    async def _poll_declarations(self) -> None:
        key = self._group_key
        if key is None:
            return
        entry = await self.core.get(key)
        seen: set[str] = set()
        withdrawn: set[str] = set()
        declarations: list[Declaration] = []
        if entry is not None and isinstance(entry.value, dict):
            for subkey, item in entry.value.items():
                value = getattr(item, "value", None)
                if subkey == self.core.peer_id:
                    continue
                if value is None:  # a retracted declaration (see _retract)
                    withdrawn.add(subkey)
                    continue
                try:
                    declaration = decode_declaration(value)
                except ValueError:
                    continue
                if declaration.peer_id != subkey or declaration.group_key != key:
                    continue
                seen.add(declaration.peer_id)
                if declaration.peer_id not in self.machine.known:
                    logger.debug(
                        "%s sees %s (%s)", self.core.peer_id[:6], subkey[:6], self.machine.state
                    )
                declarations.append(declaration)
        # all of them at once: the machine asks the earliest, not the first one listed
        await self._execute(self.machine.on_declarations(self.core.now(), declarations))
        for peer_id in list(self.machine.known):
            if peer_id not in seen:
                self.machine.forget(peer_id)
        if key == self._group_key:
            self.withdrawn = frozenset(withdrawn)

    async def _refresh_declaration(self) -> None:
        if self._published is None:
            return
        declaration, expiration = self._published
        if math.isinf(declaration.deadline) and expiration - self.core.now() < _UNBOUNDED_TTL / 3:
            await self._publish(declaration, None)

    def _slot_expiration(self, key: str, wanted: float) -> float:
        # our gossip slot keeps the record with the latest expiration: a new record (a
        # declaration after a retraction, or the other way round) must expire later
        expiration = max(wanted, self._slot_expirations.get(key, -math.inf) + 1e-3)
        self._slot_expirations[key] = expiration
        if len(self._slot_expirations) > 256:
            now = self.core.now()
            self._slot_expirations = {
                k: v for k, v in self._slot_expirations.items() if v > now or k == key
            }
        return expiration

    async def _publish(self, declaration: Declaration, expires_at: float | None) -> None:
        wanted = expires_at if expires_at is not None else self.core.now() + _UNBOUNDED_TTL
        expiration = self._slot_expiration(declaration.group_key, wanted)
        self._published = (declaration, expiration)
        with contextlib.suppress(SwarmgradError):
            await self.core.store(
                declaration.group_key,
                encode_declaration(declaration),
                expiration,
                subkey=self.core.peer_id,
            )

    async def _retract(self, declaration: Declaration) -> None:
        if self._published is None:
            return
        published, expiration = self._published
        self._published = None
        # a newer record in our slot with a later expiration replaces the declaration
        with contextlib.suppress(SwarmgradError):
            await self.core.store(
                published.group_key,
                None,
                self._slot_expiration(published.group_key, expiration),
                subkey=self.core.peer_id,
            )

    # --------------------------------------------------------------- commands

    async def _execute(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Publish):
                await self._publish(command.declaration, command.expires_at)
            elif isinstance(command, Retract):
                await self._retract(command.declaration)
            elif isinstance(command, SendRequest):
                self._spawn(self._send_request(command))
            elif isinstance(command, Notify):
                self._spawn(self._notify(command))
            elif isinstance(command, BeginAllreduce):
                self._settle(command.group, None)
            elif isinstance(command, Failed):
                if command.reason is FailureReason.CANCELLED:
                    error: Exception = StepCancelled(command.detail or "step cancelled")
                else:
                    error = MatchmakingFailed(
                        f"no group of at least {self.config.min_group_size} peers: {command.detail}"
                    )
                self._settle(None, error)
            elif isinstance(command, Reply):  # pragma: no cover - only from on_join_request
                logger.debug("dropping a reply outside a request handler: %s", command)

    def _settle(self, group: GroupInfo | None, error: Exception | None) -> None:
        result = self._result
        if result is None or result.done():
            return
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(group)  # type: ignore[arg-type]
        self._wake.set()

    async def _send_request(self, command: SendRequest) -> None:
        request = command.request
        frame = Frame(
            JOIN,
            {
                "p": self.prefix,
                "d": encode_declaration(request.requester),
                "l": request.leader_id,
                "m": request.metadata,
                **({"b": list(request.bringing)} if request.bringing else {}),
            },
        )
        try:
            reply = await self.core.request(command.to, frame, self.config.request_timeout)
            response = decode_response(command.to, reply)
        except (SwarmgradError, TimeoutError, ValueError, KeyError) as exc:
            logger.debug("join request to %s failed: %s", command.to, exc)
            commands = self.machine.on_request_failed(self.core.now(), command.to)
        else:
            commands = self.machine.on_join_response(self.core.now(), command.to, response)
            logger.debug(
                "%s asked %s: %s %s",
                self.core.peer_id[:6],
                command.to[:6],
                response.status.value,
                response.reason,
            )
        await self._execute(commands)
        self._wake.set()

    async def _notify(self, command: Notify) -> None:
        try:
            await self.core.send(command.to, encode_notice(self.prefix, command.message))
        except (SwarmgradError, TimeoutError) as exc:
            logger.debug("notice to %s failed: %s", command.to, exc)

    def _spawn(self, coro: Coroutine[object, None, object]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --------------------------------------------------------------- handlers

    async def on_join(self, link: Link, frame: Frame) -> Frame:
        fields = frame.fields
        requester = decode_declaration(fields["d"])  # ValueError → error reply
        if requester.peer_id != link.peer_id:
            raise ValueError("a join request must come from the peer it declares")
        if fields["l"] != self.core.peer_id:
            raise ValueError("this join request is meant for another leader")
        commands = self.machine.on_join_request(
            self.core.now(),
            JoinRequest(
                requester, self.core.peer_id, bytes(fields["m"]), tuple(fields.get("b", ()))
            ),
        )
        replies = [c for c in commands if isinstance(c, Reply)]
        await self._execute([c for c in commands if not isinstance(c, Reply)])
        self._wake.set()
        return encode_response(replies[0].response)

    async def on_notice(self, link: Link, frame: Frame) -> None:
        try:
            notice = decode_notice(link.peer_id, frame)
        except ValueError as exc:
            logger.warning("ignoring a malformed notice from %s: %s", link.peer_id, exc)
            return
        commands = self.machine.on_notice(self.core.now(), link.peer_id, notice)
        if commands:
            self._spawn(self._execute(commands))
        self._wake.set()

    def waiting_on(self) -> str | None:
        return self.machine.waiting_on()

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["MatchmakingDriver"]
