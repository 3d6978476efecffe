"""Matchmaking into averaging groups: a state machine without I/O.

One :class:`Matchmaker` per peer. The networked averager feeds it events — its own step
beginning (:meth:`~Matchmaker.start`), declarations seen in gossip, join requests and
responses, notices from leaders and followers, timer ticks, cancellation — and executes the
commands each call returns, *in order*: publish or retract a :class:`Declaration`, send a
:class:`JoinRequest`, :class:`Reply` to a request, :class:`Notify` a peer, and finally
:class:`BeginAllreduce` with a :class:`GroupInfo` or :class:`Failed` with a reason. Time is
only ever an argument (``now``); :meth:`~Matchmaker.next_wakeup` says when to call
:meth:`~Matchmaker.tick`.

:class:`Matchmaker`'s docstring has the rules that keep matchmaking free of deadlock and the
guarantees they give (``docs/averaging.md`` tells the same story with the I/O layer).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

from peer.averaging.matchmaking.attempt import Attempt, Follower, acceptable
from peer.averaging.matchmaking.messages import (
    BeginAllreduce,
    Command,
    Declaration,
    Failed,
    FailureReason,
    GroupAssembled,
    GroupDisbanded,
    GroupInfo,
    JoinRequest,
    JoinResponse,
    LeaveGroup,
    MatchmakingConfig,
    MatchState,
    Notice,
    Notify,
    PeerID,
    Publish,
    Redirected,
    RefuseReason,
    Reply,
    ResponseStatus,
    Retract,
    SendRequest,
)

# the vocabulary lives in matchmaking_types; its names stay importable from here
__all__ = [
    "BeginAllreduce",
    "Command",
    "Declaration",
    "Failed",
    "FailureReason",
    "GroupAssembled",
    "GroupDisbanded",
    "GroupInfo",
    "JoinRequest",
    "JoinResponse",
    "LeaveGroup",
    "MatchState",
    "Matchmaker",
    "MatchmakingConfig",
    "Notice",
    "Notify",
    "Publish",
    "Redirected",
    "RefuseReason",
    "Reply",
    "ResponseStatus",
    "Retract",
    "SendRequest",
]

_ACTIVE = (MatchState.LOOKING, MatchState.REQUESTING, MatchState.FOLLOWING)


# --------------------------------------------------------------------- machine


class Matchmaker:
    """The matchmaking state machine of one peer: the rules below, without I/O.

    Every event method takes ``now`` (seconds, the caller's clock; non-decreasing) and
    returns the list of commands to execute in order. Events that do not apply in the
    current state (a stale response, a notice from a peer left behind) are ignored, never
    errors: remote peers are not trusted to be in sync.

    Why it cannot deadlock
    ----------------------
    Every declaration of intent to average has a place in one total order,
    ``Declaration.order_key(order)``: by default ``(rank, peer_id)`` with ``rank =
    sha256(group_key ‖ peer_id)``, or ``(start_time, peer_id)`` with ``order="start_time"`` —
    the same on every peer, because it is computed from fields carried verbatim (clock skew
    changes when a group assembles, never whether peers agree on the order). By default no
    declaration can win the order: the earliest start time would go to whoever declares no
    matchmaking wait (or starts early), and that peer would lead, and pick, every group it
    reaches. Under the rank the group waits for its leader's start time instead of the
    earliest; a peer does not ask a leader that assembles after its own deadline. The rules:

    1. A peer sends a join request only to a leader whose declaration *precedes* its own
       (:meth:`~peer.averaging.matchmaking.attempt.Attempt.viable`); a leader refuses a
       request from a peer that does not come after it (``RefuseReason.WRONG_ORDER``), so a
       buggy peer cannot break the rule either.
    2. A peer waits on at most one other peer: the leader it is REQUESTING or FOLLOWING
       (:meth:`Matchmaker.waiting_on`). While it does, it answers every join request to itself
       at once with a redirect to that leader (which precedes the requester too, by
       transitivity), and tells that leader whom it sent (:class:`Redirected`) — it never
       holds followers and never lets a requester wait on it: a
       leader with followers that asks an earlier leader sends them there first
       (:class:`GroupDisbanded` with a redirect), so they ask it alongside, not after, their
       leader (each hop of a chain costs a request, and the group forms at the earliest one).
    3. Every request is answered immediately by the handler (:meth:`Matchmaker.on_join_request`
       returns its :class:`Reply`); no answer waits for another peer's action.
    4. A leader never waits on its followers: it assembles on its own (full group, or its start
       time reached with at least ``min_group_size``) and tells them; nothing is acknowledged.
       One bounded exception is a timer, not a wait on a peer: the peers sent to a leader are
       announced to it — a requester that hands its followers over names them in its request
       (``JoinRequest.bringing``), a peer that redirects a requester names it in a
       :class:`Redirected` notice (passed on, hop by hop, to the leader at the end of the
       chain) — and a leader past its start time holds the group open for those still under
       way, until they arrive, the group is full, or ``assembly_grace`` after its start time
       (never past its deadline). Without it a peer that learns of the group's leader late
       and reaches it through a chain of redirects (a request per hop) arrives after the group
       assembled, is refused as busy and finds no other.

    So every edge of the waits-for graph goes from a declaration to a strictly earlier one:
    the graph is acyclic and no deadlock can form. Timeouts remain only for peers that die or
    stall (a request unanswered after ``request_timeout``; a leader silent ``assembly_grace``
    after its declared deadline, or whose connection the I/O layer reports lost), and for the
    caller's overall ``deadline``.

    Client-mode peers (they cannot accept connections) never lead and are never requested;
    nothing can wait on them, so they may ask any leader regardless of order, and leaders accept
    them regardless of order.

    Other guarantees read off the code
    ----------------------------------
    * A peer is in at most one group per attempt: it emits at most one :class:`BeginAllreduce`,
      after which it refuses every request; it leads or follows, never both (asking a leader,
      it first redirects its own followers there with :class:`GroupDisbanded`).
    * Group size stays within ``[min_group_size, target_group_size]``: the leader counts, and
      each follower checks the group it is told of against its own settings (a leader that
      assembles before its start time must be full by the follower's target).
    * Different ``group_key`` or ``schema_hash`` (shapes, dtypes, compression) never share a
      group: leaders refuse such requests and peers never ask such leaders.
    * A follower whose leader refuses, disbands, times out or dies moves on to the next
      viable leader in order, or leads itself. A peer that abandons a leader sends it
      :class:`LeaveGroup`, so a late acceptance does not leave it listed. One race remains:
      if the leader assembles before the notice arrives, its :class:`GroupInfo` names a member
      that will not come; the all-reduce layer must exclude it (it refuses traffic for a group
      id it never began), exactly as it excludes a member that crashes.

    Clock skew: decisions by *order* (who leads) need no synchronised clocks. Two decisions
    compare another peer's declared time with the local clock, each tolerating skew up to
    ``assembly_grace`` (default: ``request_timeout``): a follower gives up on a silent leader
    that long after the leader's declared ``deadline`` (a live leader assembles or disbands
    before it), and takes a group assembled before the leader's start time, less that grace,
    only if it is full. A leader that is alive but short of ``min_group_size`` keeps its
    followers until then, so a late peer can still complete the group. Old
    declarations are not filtered by time (a lone leader past its start time still takes late
    followers until its deadline); gossip expiry (``Publish.expires_at``), :meth:`Matchmaker.forget`
    and request timeouts remove dead ones.
    """

    def __init__(self, peer_id: PeerID, config: MatchmakingConfig | None = None) -> None:
        self.peer_id = peer_id
        self.config = config or MatchmakingConfig()
        self.state = MatchState.IDLE
        self.known: dict[PeerID, Declaration] = {}  # latest declaration seen per peer
        self.group: GroupInfo | None = None  # set when GROUPED
        self._attempt: Attempt | None = None
        self._now = -math.inf
        self._assembled = 0  # attempts counter, salts group ids

    # ------------------------------------------------------------ queries

    @property
    def declaration(self) -> Declaration | None:
        return self._attempt.declaration if self._attempt else None

    @property
    def followers(self) -> tuple[PeerID, ...]:
        return tuple(self._attempt.followers) if self._attempt else ()

    def waiting_on(self) -> PeerID | None:
        """The one peer this machine waits on (its edge in the waits-for graph), if any."""
        if self.state in (MatchState.REQUESTING, MatchState.FOLLOWING):
            assert self._attempt is not None and self._attempt.leader is not None
            return self._attempt.leader.peer_id
        return None

    def next_wakeup(self) -> float | None:
        """When to call :meth:`tick` next (absolute, caller's clock), or ``None``."""
        a = self._attempt
        if a is None or self.state not in _ACTIVE:
            return None
        times = [a.deadline]
        if self.state is MatchState.LOOKING and a.declaration.start_time > self._now:
            times.append(a.declaration.start_time)  # may assemble then
        elif self.state is MatchState.LOOKING and a.holding(self._now):
            times.append(a.hold_end())  # assembles then without the peers still missing
        elif self.state is MatchState.REQUESTING:
            times.append(a.since + self.config.request_timeout)
        elif self.state is MatchState.FOLLOWING:
            times.append(a.follow_deadline())
        finite = [t for t in times if math.isfinite(t)]
        return min(finite) if finite else None

    # ------------------------------------------------------------- events

    def start(
        self,
        now: float,
        *,
        group_key: str,
        schema_hash: bytes,
        metadata: bytes = b"",
        scheduled_time: float | None = None,
        deadline: float | None = None,
        client_mode: bool = False,
    ) -> list[Command]:
        """Begin an attempt: declare, then lead or seek an earlier leader.

        The declared start time is ``max(now + min_matchmaking_time, scheduled_time)``; a
        leader assembles then (or earlier when full). ``deadline`` (absolute; None = none)
        bounds the whole attempt. Raises ``ValueError`` if an attempt is already running.
        """
        if self.state in _ACTIVE:
            raise ValueError("a matchmaking attempt is already running; cancel it first")
        self._tick_clock(now)
        start_time = now + self.config.min_matchmaking_time
        if scheduled_time is not None:
            start_time = max(start_time, scheduled_time)
        deadline = math.inf if deadline is None else deadline
        if deadline < start_time:
            # the caller allows less time than matchmaking needs: assemble by the deadline
            start_time = max(now, deadline)
        declaration = Declaration(
            group_key, self.peer_id, start_time, schema_hash, client_mode, deadline=deadline
        )
        self._attempt = Attempt(declaration, metadata, deadline, self.config)
        self.group = None
        self.state = MatchState.LOOKING
        out: list[Command] = []
        if not client_mode:  # nobody may ask a client to lead
            out.append(Publish(declaration, None if math.isinf(deadline) else deadline))
        return out + self._progress(now)

    def on_declaration(self, now: float, declaration: Declaration) -> list[Command]:
        """A declaration seen in gossip (new, or a newer revision)."""
        return self.on_declarations(now, [declaration])

    def on_declarations(self, now: float, declarations: list[Declaration]) -> list[Command]:
        """Declarations seen in gossip at once (one poll of the key): learnt together, then
        one decision, so the first request goes to the earliest of them (where the group
        forms), not to whichever came first.

        A peer already REQUESTING keeps waiting for its answer even if an earlier leader
        appears: leaving a request in flight could make it a member of two groups' lists
        (a leader that is full, or past its start time, assembles as it accepts). The
        earlier leader is asked as soon as the answer is anything but an acceptance
        (see :meth:`_redirected`)."""
        self._tick_clock(now)
        learnt = False
        for declaration in declarations:
            learnt |= self._learn(declaration)
        if learnt and self.state is MatchState.LOOKING:
            return self._progress(now)
        return []

    def forget(self, peer_id: PeerID) -> None:
        """Drop a peer's declaration (retracted from gossip, or the peer left)."""
        self.known.pop(peer_id, None)

    def on_join_request(self, now: float, request: JoinRequest) -> list[Command]:
        """A join request from ``request.requester``; the result always holds one :class:`Reply`."""
        self._tick_clock(now)
        requester = request.requester
        to = requester.peer_id
        a = self._attempt

        def refuse(reason: RefuseReason) -> list[Command]:
            return [Reply(to, JoinResponse(self.peer_id, ResponseStatus.REFUSED, reason))]

        if a is None or self.state in (MatchState.IDLE, MatchState.FAILED):
            return refuse(RefuseReason.NOT_LOOKING)
        if self.state is MatchState.GROUPED:
            return refuse(RefuseReason.BUSY)
        me = a.declaration
        if requester.group_key != me.group_key:
            return refuse(RefuseReason.WRONG_KEY)
        if requester.schema_hash != me.schema_hash:
            return refuse(RefuseReason.WRONG_SCHEMA)
        if me.client_mode:
            return refuse(RefuseReason.CLIENT_MODE)
        if not requester.client_mode and not me.precedes(requester, self.config.order):
            return refuse(RefuseReason.WRONG_ORDER)
        if self.state in (MatchState.REQUESTING, MatchState.FOLLOWING):
            # rule 2: never let anyone wait on a peer that waits; point it further down
            assert a.leader is not None
            reply = JoinResponse(self.peer_id, ResponseStatus.REDIRECT, redirect_to=a.leader)
            return [Reply(to, reply), *a.pass_on((to, *request.bringing))]
        # LOOKING: lead
        if to not in a.followers and a.is_full():
            return refuse(RefuseReason.FULL)
        a.followers[to] = Follower(requester, request.metadata)
        a.expected.discard(to)
        a.expect(request.bringing)
        out: list[Command] = [Reply(to, JoinResponse(self.peer_id, ResponseStatus.ACCEPTED))]
        return out + self._progress(now)

    def on_join_response(self, now: float, sender: PeerID, response: JoinResponse) -> list[Command]:
        """The answer to a :class:`SendRequest` we issued to ``sender``."""
        self._tick_clock(now)
        a = self._attempt
        current = self.state is MatchState.REQUESTING and a is not None and a.leader is not None
        if not current or a.leader.peer_id != sender:  # type: ignore[union-attr]
            # a late answer from a leader we gave up on: if it took us, tell it we left
            in_its_group = self.group is not None and self.group.leader == sender
            if response.status is ResponseStatus.ACCEPTED and not in_its_group:
                return [Notify(sender, LeaveGroup(self.peer_id, sender))]
            return []
        assert a is not None and a.leader is not None
        leader = a.leader
        if response.status is ResponseStatus.ACCEPTED:
            a.since = now
            self.state = MatchState.FOLLOWING
            return []
        a.give_up_on(leader)
        self.state = MatchState.LOOKING
        if response.status is ResponseStatus.REDIRECT and response.redirect_to is not None:
            return self._redirected(now, response.redirect_to)
        return self._progress(now)

    def on_request_failed(self, now: float, peer_id: PeerID) -> list[Command]:
        """A :class:`SendRequest` to ``peer_id`` could not be delivered or answered."""
        self._tick_clock(now)
        if self.waiting_on() != peer_id or self.state is not MatchState.REQUESTING:
            return []
        assert self._attempt is not None and self._attempt.leader is not None
        self._attempt.give_up_on(self._attempt.leader)
        self.state = MatchState.LOOKING
        return self._progress(now)

    def on_peer_lost(self, now: float, peer_id: PeerID) -> list[Command]:
        """The connection to ``peer_id`` broke: stop waiting on it / drop it as a follower."""
        self._tick_clock(now)
        a = self._attempt
        if a is None or self.state not in _ACTIVE:
            return []
        a.followers.pop(peer_id, None)
        a.expected.discard(peer_id)
        if self.waiting_on() != peer_id:
            return []
        assert a.leader is not None
        a.give_up_on(a.leader)
        self.state = MatchState.LOOKING
        return self._progress(now)

    def on_notice(self, now: float, sender: PeerID, message: Notice) -> list[Command]:
        """A one-way notice from another peer's matchmaker."""
        self._tick_clock(now)
        a = self._attempt
        if a is None or self.state not in _ACTIVE:
            return []
        if isinstance(message, LeaveGroup):
            if message.follower_id == sender:
                a.followers.pop(sender, None)
                a.expected.discard(sender)
                if self.state is MatchState.LOOKING:
                    return self._progress(now)  # it may have been the last one held for
            return []
        if isinstance(message, Redirected):
            if message.follower_id != sender:
                return []
            if self.state is MatchState.LOOKING:
                if not a.declaration.client_mode:
                    a.expect(message.peer_ids)
                return []
            return a.pass_on(message.peer_ids)  # waiting: to the leader it waits on
        # from the leader we follow -- or the one we asked: its notice may overtake its reply
        waiting = self.state in (MatchState.REQUESTING, MatchState.FOLLOWING)
        if not waiting or a.leader is None or a.leader.peer_id != sender:
            return []  # stale
        if isinstance(message, GroupAssembled):
            group = message.group
            if (
                group.leader == sender
                and self.peer_id in group.peer_ids
                and group.group_key == a.declaration.group_key
                and acceptable(self.config, now, group, a.leader)
            ):
                # (the notice may overtake the acceptance)
                self.group = group
                self.state = MatchState.GROUPED
                return [Retract(a.declaration), BeginAllreduce(group)]
            a.give_up_on(a.leader)  # assembled without us, or as we do not accept
            self.state = MatchState.LOOKING
            return self._progress(now)
        if isinstance(message, GroupDisbanded):
            a.give_up_on(a.leader)
            self.state = MatchState.LOOKING
            if message.redirect_to is not None:
                return self._redirected(now, message.redirect_to)
            return self._progress(now)
        raise TypeError(f"unknown notice {type(message).__name__}")

    def tick(self, now: float) -> list[Command]:
        """Timers: the deadline, an unanswered request, a silent leader, the start time."""
        self._tick_clock(now)
        a = self._attempt
        if a is None or self.state not in _ACTIVE:
            return []
        if now >= a.deadline and self.state is not MatchState.LOOKING:
            return self._stop(FailureReason.DEADLINE, "no group before the deadline")
        if self.state is MatchState.REQUESTING and now >= a.since + self.config.request_timeout:
            assert a.leader is not None
            leader = a.leader
            a.give_up_on(leader)
            self.state = MatchState.LOOKING
            return [
                Notify(leader.peer_id, LeaveGroup(self.peer_id, leader.peer_id)),
                *self._progress(now),
            ]
        if self.state is MatchState.FOLLOWING and now >= a.follow_deadline():
            assert a.leader is not None
            leader = a.leader
            a.give_up_on(leader)
            self.state = MatchState.LOOKING
            return [
                Notify(leader.peer_id, LeaveGroup(self.peer_id, leader.peer_id)),
                *self._progress(now),
            ]
        if self.state is MatchState.LOOKING:
            return self._progress(now)
        return []

    def cancel(self, now: float, detail: str = "cancelled by the caller") -> list[Command]:
        """The local step was cancelled: release followers and leader, then fail."""
        self._tick_clock(now)
        if self.state not in _ACTIVE:
            return []
        return self._stop(FailureReason.CANCELLED, detail)

    # ---------------------------------------------------------- internals

    def _tick_clock(self, now: float) -> None:
        self._now = max(self._now, now)

    def _learn(self, declaration: Declaration) -> bool:
        """Remember ``declaration`` unless it is ours or nothing new (gossip may deliver old
        revisions late); whether it was new."""
        if declaration.peer_id == self.peer_id:
            return False
        previous = self.known.get(declaration.peer_id)
        if (
            previous is not None
            and previous.identity == declaration.identity
            and previous.revision >= declaration.revision
        ):
            return False
        self.known[declaration.peer_id] = declaration
        return True

    def _earliest_viable(self) -> Declaration | None:
        a = self._attempt
        assert a is not None
        candidates = [d for d in self.known.values() if a.viable(d)]
        order = self.config.order
        return min(candidates, key=lambda d: d.order_key(order)) if candidates else None

    def _redirected(self, now: float, target: Declaration) -> list[Command]:
        """Pointed at ``target`` (the leader of the peer we asked): ask the earliest viable
        leader we know, the target included — the target may itself be waiting on one we
        already know of, and every hop of a redirect chain costs a request."""
        assert self._attempt is not None
        if self._attempt.viable(target):
            self._learn(target)
        best = self._earliest_viable()
        if best is not None:
            return self._request(now, best)
        return self._progress(now)

    def _request(self, now: float, leader: Declaration) -> list[Command]:
        a = self._attempt
        assert a is not None
        # rule 2: a peer that waits holds no followers; they go to that leader at once, and
        # so do the peers announced to this one (it redirects them when they arrive)
        out: list[Command] = [
            Notify(f, GroupDisbanded(self.peer_id, redirect_to=leader)) for f in a.followers
        ]
        a.sent_ahead.update(a.followers, a.expected)
        a.followers.clear()
        a.expected.clear()
        a.leader = leader
        a.since = now
        self.state = MatchState.REQUESTING
        bringing = a.bringing(leader)
        request = JoinRequest(a.declaration, leader.peer_id, a.metadata, bringing)
        return [*out, SendRequest(leader.peer_id, request)]

    def _progress(self, now: float) -> list[Command]:
        """In LOOKING: assemble if ready, fail at the deadline, else ask the earliest leader."""
        a = self._attempt
        assert a is not None and self.state is MatchState.LOOKING
        size = 1 + len(a.followers)
        ready = now >= a.declaration.start_time and size >= self.config.min_group_size
        assemble = not a.declaration.client_mode and (a.is_full() or (ready and not a.holding(now)))
        if not assemble and now >= a.deadline:
            return self._stop(FailureReason.DEADLINE, "no group before the deadline")
        out: list[Command] = []
        if a.leader is not None:
            # back to leading after an attempt to follow failed: let peers that gave up on
            # us try again (rule 1 still holds: only later peers may ask us)
            a.leader = None
            if not a.declaration.client_mode:
                a.declaration = replace(a.declaration, revision=a.declaration.revision + 1)
                out.append(Publish(a.declaration, None if math.isinf(a.deadline) else a.deadline))
        if assemble:
            return out + self._assemble(now)
        best = self._earliest_viable()
        if best is not None:
            return out + self._request(now, best)
        return out

    def _assemble(self, now: float) -> list[Command]:
        a = self._attempt
        assert a is not None
        me = a.declaration
        order = self.config.order
        followers = sorted(a.followers.values(), key=lambda f: f.declaration.order_key(order))
        peer_ids = (self.peer_id, *(f.declaration.peer_id for f in followers))
        self._assembled += 1
        digest = hashlib.sha256(
            f"{self.peer_id}|{me.start_time!r}|{self._assembled}|{','.join(peer_ids)}".encode()
        ).digest()
        group = GroupInfo(
            group_id=digest[:16],
            group_key=me.group_key,
            leader=self.peer_id,
            peer_ids=peer_ids,
            gathered=(a.metadata, *(f.metadata for f in followers)),
            client_mode=(me.client_mode, *(f.declaration.client_mode for f in followers)),
        )
        self.group = group
        self.state = MatchState.GROUPED
        out: list[Command] = [
            Notify(f.declaration.peer_id, GroupAssembled(group)) for f in followers
        ]
        return [*out, Retract(me), BeginAllreduce(group)]

    def _stop(self, reason: FailureReason, detail: str) -> list[Command]:
        a = self._attempt
        assert a is not None
        out: list[Command] = [Notify(f, GroupDisbanded(self.peer_id)) for f in a.followers]
        a.followers.clear()
        if self.state in (MatchState.REQUESTING, MatchState.FOLLOWING) and a.leader is not None:
            out.append(Notify(a.leader.peer_id, LeaveGroup(self.peer_id, a.leader.peer_id)))
        if not a.declaration.client_mode:
            out.append(Retract(a.declaration))
        self.state = MatchState.FAILED
        return [*out, Failed(reason, detail)]
