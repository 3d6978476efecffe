"""``peer.Optimizer``: collaborative training with a global batch size.

Peers accumulate gradients, weighted by the samples they processed, until the swarm together
has processed ``target_batch_size`` samples; then they average the accumulated gradients in
groups (weight = samples, so the result is the gradient of the mean loss over every sample
the swarm saw) and each takes the same optimizer step. That is one epoch. With exact
(uncompressed) averaging in one group, every peer ends each epoch with the parameters that
one process would have after a step on the concatenated batches.

Progress is shared through gossip: each peer publishes ``[epoch, samples accumulated at
that epoch, samples/s, time, client mode]`` under ``f"{run_id}.collab_progress"`` (subkey:
its peer id). :func:`compute_global_progress` turns the reports into the swarm's state; it
is pure and tested without I/O.

Rules that keep the swarm moving:

* a peer whose ``local_epoch`` is behind the swarm's loads state (parameters, optimizer
  state, epoch) from a peer instead of stepping; a newcomer does so on start. Donors declare
  the epoch of the state they serve as their ``state_sharing_priority`` (as hivemind does),
  so the newest state is downloaded, not a straggler's; while no donor has given a state as
  new as the swarm's epoch, the download is retried (bounded by ``load_state_timeout``);
* a peer that has nothing accumulated when the swarm is ready joins the round with weight 0
  (it receives the average and steps in sync) rather than stalling the others;
* the gradient round's group key carries the epoch, so peers at different epochs never
  average together;
* a new epoch is announced only once the epoch's rounds have ended (in the background too),
  so a peer slow to notice the target still finds the others in the round;
* if the gradient round fails (a peer died mid-round, a timeout), the peer logs it and steps
  with the gradients it has — the round's partial average or its own — and periodic state
  averaging (``average_state_every`` epochs) pulls diverged parameters back together;
* a peer alone in the run (no other live progress report) skips the rounds instead of
  waiting out ``averaging_timeout`` for a group that cannot form.

Each epoch runs three phases: the gradient round, the optimizer step (with the scheduler
step), the state round (every ``average_state_every`` epochs). ``delay_grad_averaging``,
``delay_optimizer_step`` and ``delay_state_averaging`` move a phase — and so every phase
after it — to one background thread, and ``step()`` returns at once; the next epoch's
gradients accumulate meanwhile (in a second host-memory buffer when the gradient round is
delayed). A finished background epoch is applied to the model at the start of the next
``step()`` call; :meth:`Optimizer.wait_for_pending` waits for it and applies it (e.g. after
the last step, before evaluating or saving).

Delayed results are **one step stale** by design (delayed parameter updates,
arXiv:2101.06840): the gradients of epoch ``k`` are computed on parameters that do not yet
include the update of epoch ``k - 1``. In a loop that computes one batch per epoch, that is
exactly ``θ[k+1] = step(θ[k], ∇L_k(θ[k-1]))`` with ``θ[-1] = θ[0]``.

Locking: the model's parameters are read by forward and backward passes in the training
thread, so only the training thread writes them (copying the optimizer's parameters in at a
``step()`` call). A delayed optimizer step therefore needs ``offload_optimizer``: the wrapped
optimizer steps host-memory copies of the parameters, each with its own ``.grad``. Those
copies and the optimizer state — the *live state* — are written and read under one lock,
the state averager's (``state_averager.get_tensors()``), which also guards the snapshot
served to newcomers, so nobody reads them half-updated.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.control import StepControl
from peer.averaging.exceptions import StepFailed
from peer.averaging.partition import zeros_back_to_back
from peer.compression import Compression, NoCompression

logger = logging.getLogger("peer.optim.collaborative")

__all__ = [
    "CollaborativeOptions",
    "CollaborativeReport",
    "GlobalProgress",
    "Optimizer",
    "ProgressTracker",
    "compute_global_progress",
    "resolve_options",
]


# --------------------------------------------------------------------------- progress (pure)


@dataclass(frozen=True)
class CollaborativeReport:
    peer_id: str
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    time: float
    client_mode: bool = False

    def to_wire(self) -> list[Any]:
        return [
            self.epoch,
            self.samples_accumulated,
            self.samples_per_second,
            self.time,
            self.client_mode,
        ]

    @classmethod
    def from_wire(cls, peer_id: str, value: Any) -> CollaborativeReport | None:
        """Parse a gossiped report; None (and nothing raised) for a malformed one."""
        if not isinstance(value, list | tuple) or len(value) != 5:
            return None
        epoch, samples, speed, when, client = value
        if not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0):
            return None
        if not (isinstance(samples, int) and not isinstance(samples, bool) and samples >= 0):
            return None
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in (speed, when)
        ):
            return None
        if not isinstance(client, bool):
            return None
        return cls(peer_id, epoch, samples, float(max(speed, 0.0)), float(when), client)


@dataclass(frozen=True)
class GlobalProgress:
    """The swarm as this peer sees it."""

    epoch: int  # the newest epoch any live peer reports
    samples_accumulated: int  # samples reported at that epoch, summed over peers
    target_batch_size: int
    num_peers: int  # peers reporting at that epoch
    num_clients: int
    samples_per_second: float  # the swarm's throughput, summed over peers at that epoch
    eta_next_epoch: float  # wall-clock estimate of when the target is reached

    @property
    def ready(self) -> bool:
        return self.samples_accumulated >= self.target_batch_size


def compute_global_progress(
    reports: Iterable[CollaborativeReport],
    own: CollaborativeReport,
    *,
    target_batch_size: int,
    now: float,
) -> GlobalProgress:
    """Merge gossip reports with this peer's fresh one (which replaces gossip's copy)."""
    latest = {r.peer_id: r for r in reports}
    latest[own.peer_id] = own
    epoch = max(r.epoch for r in latest.values())
    current = [r for r in latest.values() if r.epoch == epoch]
    samples = sum(r.samples_accumulated for r in current)
    speed = sum(r.samples_per_second for r in current)
    missing = max(target_batch_size - samples, 0)
    eta = now + (missing / speed if speed > 0 else (0.0 if missing == 0 else math.inf))
    return GlobalProgress(
        epoch=epoch,
        samples_accumulated=samples,
        target_batch_size=target_batch_size,
        num_peers=len(current),
        num_clients=sum(r.client_mode for r in current),
        samples_per_second=speed,
        eta_next_epoch=eta,
    )


class ProgressTracker:
    """Publishes this peer's progress and reads the swarm's from the node's gossip store.
    :meth:`shutdown` retracts this peer's report, so the swarm stops counting it."""

    def __init__(
        self,
        node: Any,
        run_id: str,
        target_batch_size: int,
        *,
        client_mode: bool,
        expiration: float = 60.0,
    ):
        self.node = node
        self.key = f"{run_id}.collab_progress"
        self.target_batch_size = target_batch_size
        self.client_mode = client_mode
        self.expiration = expiration
        self.local_epoch = 0
        self.samples_accumulated = 0
        self._speed_samples = 0
        self._speed_started = time.monotonic()
        self.samples_per_second = 0.0
        self._last_published: tuple[int, int] | None = None
        self._pending: Any = None
        self._stored_until = 0.0  # expiration of this peer's last report
        self._shut = False

    def report_local_progress(
        self, epoch: int, samples_accumulated: int, new_samples: int = 0
    ) -> None:
        self.local_epoch = epoch
        self.samples_accumulated = samples_accumulated
        if new_samples:
            self._speed_samples += new_samples
            elapsed = time.monotonic() - self._speed_started
            if elapsed > 0:
                self.samples_per_second = self._speed_samples / elapsed
        self.publish()

    def publish(self, *, force: bool = False) -> None:
        """Store this peer's report (without waiting; a store still in flight is not doubled)."""
        state = (self.local_epoch, self.samples_accumulated)
        if self._shut or (not force and state == self._last_published):
            return
        if self._pending is not None and not self._pending.done():
            return
        own = self._own()
        self._last_published = state
        # a store needs a strictly later expiration than this peer's previous record
        until = max(own.time + self.expiration, self._stored_until + 1e-6)
        self._stored_until = until
        self._pending = self.node.run_coroutine(
            self.node.core.store(self.key, own.to_wire(), until, subkey=self.node.peer_id),
            wait=False,
        )

    def _own(self) -> CollaborativeReport:
        return CollaborativeReport(
            self.node.peer_id,
            self.local_epoch,
            self.samples_accumulated,
            self.samples_per_second,
            self.node.get_time(),
            self.client_mode,
        )

    @property
    def global_progress(self) -> GlobalProgress:
        return compute_global_progress(
            self._reports(),
            self._own(),
            target_batch_size=self.target_batch_size,
            now=self.node.get_time(),
        )

    def others_reporting(self) -> int:
        """How many other peers have a live report, at any epoch."""
        return sum(r.peer_id != self.node.peer_id for r in self._reports())

    def reports(self) -> list[CollaborativeReport]:
        """Every live report this peer knows, its own as last gossiped included."""
        return self._reports()

    def _reports(self) -> list[CollaborativeReport]:
        record = self.node.get(self.key)
        reports = []
        if record is not None and isinstance(record.value, dict):
            for peer_id, entry in record.value.items():
                parsed = CollaborativeReport.from_wire(str(peer_id), entry.value)
                if parsed is not None:
                    reports.append(parsed)
        return reports

    def wait_published(self, timeout: float = 5.0) -> None:
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.result(timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop publishing and retract this peer's report: peers (and a newcomer deciding
        whether the swarm is ahead of it) stop counting it at once rather than when it
        expires. Idempotent; the node may already be gone."""
        if self._shut:
            return
        self._shut = True
        self.wait_published(timeout)
        if not self._stored_until:
            return
        with contextlib.suppress(Exception):
            self.node.run_coroutine(
                self.node.core.store(
                    self.key, None, self._stored_until + 1e-3, subkey=self.node.peer_id
                ),
                wait=False,
            ).result(timeout)


# --------------------------------------------------------------------------- options (pure)


@dataclass(frozen=True)
class CollaborativeOptions:
    """How an :class:`Optimizer` runs its epochs, once defaults are resolved and checked."""

    offload_optimizer: bool
    delay_grad_averaging: bool
    delay_optimizer_step: bool
    delay_state_averaging: bool
    reuse_grad_buffers: bool
    use_local_updates: bool

    @property
    def delays_anything(self) -> bool:
        return self.delay_grad_averaging or self.delay_optimizer_step or self.delay_state_averaging


def resolve_options(
    *,
    offload_optimizer: bool | None,
    delay_grad_averaging: bool,
    delay_optimizer_step: bool | None,
    delay_state_averaging: bool | None,
    reuse_grad_buffers: bool,
    use_local_updates: bool,
    optimizer_is_factory: bool,
) -> CollaborativeOptions:
    """Fill in the defaults (as hivemind: ``delay_optimizer_step`` follows
    ``delay_grad_averaging``; ``offload_optimizer`` and ``delay_state_averaging`` follow
    ``delay_optimizer_step``) and refuse combinations that cannot work, naming the reason."""
    if use_local_updates and reuse_grad_buffers:
        raise ValueError(
            "use_local_updates steps on every call, so there is no gradient accumulation to reuse"
        )
    if use_local_updates and delay_grad_averaging:
        raise ValueError(
            "use_local_updates averages parameters, not gradients: there is no gradient round "
            "to delay (delay_grad_averaging)"
        )
    if use_local_updates and delay_optimizer_step:
        raise ValueError(
            "use_local_updates steps on every call with that call's gradients; "
            "delay_optimizer_step is not supported with it (delay_state_averaging overlaps "
            "the epoch's parameter averaging instead)"
        )
    if delay_optimizer_step is None:
        delay_optimizer_step = delay_grad_averaging
    if delay_grad_averaging and not delay_optimizer_step:
        raise ValueError(
            "delay_grad_averaging needs delay_optimizer_step: the optimizer step waits for the "
            "background round's gradients, so it must run in the background too"
        )
    if reuse_grad_buffers and delay_grad_averaging:
        raise ValueError(
            "reuse_grad_buffers cannot be combined with delay_grad_averaging (hivemind refuses "
            "it too): a delayed round needs its own copy of the gradients, the very buffer "
            "reuse_grad_buffers exists to save"
        )
    if offload_optimizer is None:
        offload_optimizer = delay_optimizer_step
    if delay_optimizer_step and not offload_optimizer:
        raise ValueError(
            "delay_optimizer_step needs offload_optimizer: the background step must update "
            "host-memory copies of the parameters, not the ones forward and backward passes read"
        )
    if delay_state_averaging is None:
        delay_state_averaging = delay_optimizer_step
    if delay_optimizer_step and not delay_state_averaging:
        raise ValueError(
            "state averaging follows the optimizer step, so with delay_optimizer_step it runs "
            "in the background too: leave delay_state_averaging unset or True"
        )
    if offload_optimizer and not optimizer_is_factory:
        raise ValueError(
            "offload_optimizer builds the optimizer on host-memory copies of the parameters: "
            "pass optimizer= as a factory (e.g. functools.partial(torch.optim.Adam, lr=1e-3)) "
            "and params="
        )
    return CollaborativeOptions(
        offload_optimizer=bool(offload_optimizer),
        delay_grad_averaging=bool(delay_grad_averaging),
        delay_optimizer_step=bool(delay_optimizer_step),
        delay_state_averaging=bool(delay_state_averaging),
        reuse_grad_buffers=bool(reuse_grad_buffers),
        use_local_updates=bool(use_local_updates),
    )


# --------------------------------------------------------------------------- state averager


class _StateAverager(DecentralizedAverager):
    """Parameters and optimizer state; shares them (with the epoch) with newcomers."""

    def __init__(
        self, owner: Optimizer, tensors: list[torch.Tensor], node: Any, **kwargs: Any
    ) -> None:
        self._owner = owner
        super().__init__(tensors, node, **kwargs)

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        # called with this averager's lock held, which guards the live state
        with torch.no_grad():
            tensors = [t.detach().clone() for t in self._owner._state_tensors()]
        return {"epoch": self._owner._state_epoch}, tensors


class _ModelGradients:
    """The model's parameters as ``GradScaler.unscale_`` sees an optimizer: with
    ``offload_optimizer`` the wrapped optimizer holds the host-memory copies instead."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.param_groups = [{"params": params}]


@dataclass(eq=False)
class _Epoch:
    """The end of one epoch: what to run, and what the background part produced."""

    epoch: int
    samples: int
    grad_round: bool
    optimizer_step: bool
    state_round: bool
    cancelled: bool = False
    stepped: bool = False  # the optimizer's parameters changed (copy them to the model)
    state_version: int = -1  # live-state version when the state round took its snapshot
    state_snapshot: list[torch.Tensor] | None = None
    state_averaged: list[torch.Tensor] | None = None
    future: concurrent.futures.Future[None] | None = None
    holds_announcement: bool = False  # the next epoch is announced once this is applied
    phases: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the optimizer

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Optimizer:
    """Collaborative optimizer with a global batch size (see the module docstring).

    Typical loop::

        opt = Optimizer(node=node, run_id="my-run", target_batch_size=4096,
                        batch_size_per_step=32, optimizer=partial(torch.optim.Adam, lr=1e-3),
                        params=model.parameters())
        for batch in data:
            loss(model, batch).backward()
            opt.step()        # accumulates; every target_batch_size swarm samples: averages + steps
            opt.zero_grad()
        opt.wait_for_pending()  # with delay_* options: apply the last background epoch
        opt.shutdown()

    ``step(batch_size=0)`` with no new gradients takes part in the swarm's progress without
    contributing samples (e.g. while waiting for the epoch to advance).

    Options (hivemind's names and meanings):

    * ``offload_optimizer`` — the wrapped optimizer is built (``optimizer`` must be a factory)
      on host-memory copies of the parameters, with their own ``.grad``; after each step the
      new values are copied into the model. Default: on when ``delay_optimizer_step`` is.
    * ``delay_optimizer_step`` — the optimizer step (and the scheduler step, and the state
      round after it) runs in a background thread; the model gets the new parameters at the
      start of a later ``step()`` call. Needs ``offload_optimizer``. Default: follows
      ``delay_grad_averaging``.
    * ``delay_grad_averaging`` — the gradient round runs in the background as well, while the
      next epoch accumulates into a second buffer. Needs ``delay_optimizer_step``.
    * ``delay_state_averaging`` — state rounds run in the background; a result is applied
      at a later ``step()`` (local steps taken meanwhile are kept: the round's change is
      added). Default: follows ``delay_optimizer_step``.
    * ``reuse_grad_buffers`` — accumulate in ``.grad`` itself (needs ``batch_size_per_step``;
      never call ``zero_grad``). ``use_local_updates`` — step on every call with local
      gradients; average parameters and optimizer state every epoch.

    Combinations that cannot work raise ``ValueError`` naming the reason (see
    :func:`resolve_options`). Call :meth:`shutdown` when done (the node is not shut down).
    """

    def __init__(
        self,
        *,
        node: Any,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: Iterable[Any] | None = None,
        scheduler: Any | SchedulerFactory | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        load_state_timeout: float = 600.0,
        average_state_every: int = 1,
        delay_state_averaging: bool | None = None,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        offload_optimizer: bool | None = None,
        reuse_grad_buffers: bool = False,
        use_local_updates: bool = False,
        grad_compression: Compression = NoCompression(),
        state_averaging_compression: Compression = NoCompression(),
        client_mode: bool | None = None,
        auxiliary: bool = False,
        averager_opts: Mapping[str, Any] | None = None,
        verbose: bool = False,
    ) -> None:
        if not run_id or not isinstance(run_id, str):
            raise ValueError("run_id must be a non-empty string shared by every peer of the run")
        if not isinstance(target_batch_size, int) or target_batch_size <= 0:
            raise ValueError("target_batch_size must be a positive integer")
        if batch_size_per_step is not None and batch_size_per_step <= 0:
            raise ValueError("batch_size_per_step must be positive")
        if average_state_every < 1:
            raise ValueError("average_state_every must be at least 1")
        is_factory = callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)
        self.options = resolve_options(
            offload_optimizer=offload_optimizer,
            delay_grad_averaging=delay_grad_averaging,
            delay_optimizer_step=delay_optimizer_step,
            delay_state_averaging=delay_state_averaging,
            reuse_grad_buffers=reuse_grad_buffers,
            use_local_updates=use_local_updates,
            optimizer_is_factory=is_factory,
        )
        if reuse_grad_buffers and batch_size_per_step is None:
            raise ValueError(
                "reuse_grad_buffers sums per-step mean gradients in .grad; it needs a fixed batch_size_per_step to weight them"
            )
        if client_mode is None:
            client_mode = bool(node.client_mode)
        if auxiliary and client_mode:
            raise ValueError("an auxiliary peer reduces for others, so it cannot be in client mode")
        self.opt, self.params = self._build_optimizer(optimizer, params)
        # the tensors the wrapped optimizer steps: host-memory copies with offload_optimizer
        self._opt_params: list[torch.Tensor] = [
            p for g in self.opt.param_groups for p in g["params"]
        ]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        if any(p.device.type != "cpu" for p in self.params) and not self.options.offload_optimizer:
            raise ValueError(
                "parameters off the CPU need offload_optimizer=True (averaging runs on host memory)"
            )
        # A scheduler instance has step(); anything else callable is a factory of one.
        self.scheduler: Any = (
            scheduler(self.opt)
            if callable(scheduler) and not hasattr(scheduler, "step")
            else scheduler
        )
        self.node = node
        self.run_id = run_id
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.averaging_timeout = averaging_timeout
        self.load_state_timeout = load_state_timeout
        self.average_state_every = average_state_every
        self.reuse_grad_buffers = reuse_grad_buffers
        self.use_local_updates = use_local_updates
        self.auxiliary = auxiliary
        self.client_mode = client_mode
        self.verbose = verbose
        self.local_epoch = 0
        self._state_epoch = (
            0  # the epoch the live state belongs to (behind while a step is pending)
        )
        self._state_version = 0  # bumped by every write to the live state outside a state round
        self._samples = 0
        self._pending: _Epoch | None = None
        self._round: StepControl | None = None  # the round in flight, for cancellation
        # Outcomes of the gradient and state rounds, for progress reports: rounds that found
        # nobody to average with (a lone peer) count as neither.
        self.rounds_done = 0
        self.rounds_failed = 0
        self.last_group_size: int | None = None
        self.last_failure: str | None = None  # class name of the last failed round's error
        self._closed = False
        self._closing = threading.Event()  # set by shutdown(): ends a state-download retry
        self._model_grads = _ModelGradients(self.params)
        self._initialize_optimizer_state()

        opts = dict(averager_opts or {})
        opts.setdefault("min_matchmaking_time", matchmaking_time)
        opts.setdefault("allreduce_timeout", averaging_timeout)
        self._epoch_in_group_bits = opts.get("target_group_size") is None
        # The gradient averager's tensors (host memory). They also accumulate gradients, except
        # with delay_grad_averaging: then the next epoch accumulates in a second buffer while
        # a background round averages these.
        # one flat buffer: in-place rounds average it without a copy
        self._averaged_grads = zeros_back_to_back(self.params)
        self._acc = (
            [torch.zeros_like(g) for g in self._averaged_grads]
            if self.options.delay_grad_averaging
            else self._averaged_grads
        )
        self.grad_averager = DecentralizedAverager(
            self._averaged_grads,
            node,
            start=True,
            prefix=f"{run_id}_grad_averager",
            compression=grad_compression,
            client_mode=client_mode,
            auxiliary=auxiliary,
            allow_state_sharing=False,
            **opts,
        )
        self.state_averager = _StateAverager(
            self,
            [t.detach().clone() for t in self._state_tensors()],
            node,
            start=True,
            prefix=f"{run_id}_state_averager",
            compression=state_averaging_compression,
            state_compression=state_averaging_compression,
            client_mode=client_mode,
            auxiliary=auxiliary,
            # its lock is also the live state's: a round must not hold it while it runs
            concurrent_updates=True,
            **opts,
        )
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"swarmgrad-collab-{run_id}"
            )
            if self.options.delays_anything
            else None
        )
        self.tracker = ProgressTracker(node, run_id, target_batch_size, client_mode=client_mode)
        self.tracker.report_local_progress(self.local_epoch, 0)
        if not auxiliary:
            self.load_state_from_peers()

    # ---------------------------------------------------------------- optimizer state

    def _build_optimizer(
        self, optimizer: torch.optim.Optimizer | OptimizerFactory, params: Iterable[Any] | None
    ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
        """The wrapped optimizer and the model's parameters, in the optimizer's order."""
        if isinstance(optimizer, torch.optim.Optimizer):
            if params is not None:
                raise ValueError(
                    "params= is only for an optimizer factory; this optimizer already has its params"
                )
            model = [p for g in optimizer.param_groups for p in g["params"]]
            return optimizer, model
        if params is None:
            raise ValueError("pass params= when optimizer is a factory")
        given = list(params)
        if not self.options.offload_optimizer:
            opt = optimizer(given)
            return opt, [p for g in opt.param_groups for p in g["params"]]
        if all(isinstance(g, dict) for g in given):
            groups = [dict(g, params=list(g["params"])) for g in given]
        else:
            groups = [{"params": given}]
        model = [p for g in groups for p in g["params"]]
        copies = {
            id(p): torch.nn.Parameter(p.detach().to("cpu", copy=True), p.requires_grad)
            for p in model
        }
        opt = optimizer([dict(g, params=[copies[id(p)] for p in g["params"]]) for g in groups])
        offloaded = [p for g in opt.param_groups for p in g["params"]]
        if [id(p) for p in offloaded] != [id(copies[id(p)]) for p in model]:
            raise ValueError("the optimizer factory must keep the parameters it is given, in order")
        return opt, model

    def _initialize_optimizer_state(self) -> None:
        """Create the optimizer's state tensors now (one step on zero gradients, undone), so
        their set is fixed for averaging and state download. For SGD (momentum buffer 0) and
        Adam-style optimizers (moments 0, step count reset to 0) the first real step then
        behaves exactly as on a fresh optimizer."""
        saved = [p.detach().clone() for p in self._opt_params]
        grads = [p.grad for p in self._opt_params]
        for p in self._opt_params:
            p.grad = torch.zeros_like(p)
        self.opt.step()
        with torch.no_grad():
            for p, s, g in zip(self._opt_params, saved, grads, strict=True):
                p.copy_(s)
                p.grad = g
        for state in self.opt.state.values():
            for key, value in state.items():
                if key == "step":
                    state[key] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0
                elif isinstance(value, torch.Tensor) and key != "step":
                    value.zero_()

    def _state_tensors(self) -> list[torch.Tensor]:
        """The live state: the optimizer's parameters, then every optimizer state tensor in a
        fixed order (integer ones, e.g. a step count, as float copies)."""
        tensors: list[torch.Tensor] = [p.data for p in self._opt_params]
        for p in self._opt_params:
            state = self.opt.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    tensors.append(value if value.is_floating_point() else value.float())
        return tensors

    def _load_state_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Write the live state (live-state lock held), then the model's parameters."""
        own = self._state_tensors()
        if len(own) != len(tensors) or any(
            a.shape != b.shape for a, b in zip(own, tensors, strict=True)
        ):
            raise ValueError("the downloaded state does not match this model and optimizer")
        with torch.no_grad():
            for p, t in zip(self._opt_params, tensors, strict=False):
                p.copy_(t)
            i = len(self._opt_params)
            for p in self._opt_params:
                state = self.opt.state.get(p, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor):
                        value.copy_(tensors[i].to(value.dtype))
                        i += 1
        self._state_version += 1
        self._copy_to_model()

    def _live_state(self) -> contextlib.AbstractContextManager[Any]:
        """The lock on the live state (the state averager's, which its snapshots also take)."""
        return self.state_averager.get_tensors()

    def _copy_to_model(self) -> None:
        """Offloaded parameters → model parameters. Training thread, live-state lock held."""
        if not self.options.offload_optimizer:
            return
        with torch.no_grad():
            for p, op in zip(self.params, self._opt_params, strict=True):
                p.copy_(op.to(p.device))

    # ----------------------------------------------------------------------- API

    @property
    def global_progress(self) -> GlobalProgress:
        return self.tracker.global_progress

    @property
    def pending_update(self) -> bool:
        """True while a background epoch (round, optimizer step) has not been applied yet."""
        return self._pending is not None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradients."""
        if self.reuse_grad_buffers:
            raise ValueError(
                "with reuse_grad_buffers=True gradients accumulate in .grad: do not zero them"
            )
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                with torch.no_grad():
                    p.grad.zero_()

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> Any:
        """Account for this call's gradients; when the swarm has processed
        ``target_batch_size`` samples, average and take one optimizer step.

        First applies a background epoch that has finished (with ``delay_*`` options).
        ``batch_size`` (default ``batch_size_per_step``) is the number of samples behind the
        current ``.grad``. With mixed precision, pass the ``torch.amp.GradScaler`` that scaled
        the loss: gradients are unscaled before they are accumulated, a batch whose gradients
        overflowed is dropped (its samples do not count), and the scaler is updated — call
        neither ``scaler.step`` nor ``scaler.update`` yourself. Returns the closure's loss,
        if a closure was given."""
        if self._closed:
            raise RuntimeError("this optimizer was shut down")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if batch_size is None:
            batch_size = self.batch_size_per_step
        if batch_size is None:
            raise ValueError("pass batch_size= or set batch_size_per_step")
        if batch_size < 0:
            raise ValueError("batch_size must be non-negative")
        if self.auxiliary and batch_size:
            raise ValueError("an auxiliary peer contributes no samples: use batch_size=0")
        if grad_scaler is not None and self.reuse_grad_buffers:
            raise ValueError(
                "grad_scaler with reuse_grad_buffers would unscale gradients accumulated earlier again"
            )
        if self.reuse_grad_buffers and batch_size not in (0, self.batch_size_per_step):
            raise ValueError(
                "with reuse_grad_buffers every step must have batch_size_per_step samples"
            )
        pending = self._pending
        if pending is not None and pending.future is not None and pending.future.done():
            self._settle_pending()

        progress = self.tracker.global_progress
        if progress.epoch > self.local_epoch:
            logger.info(
                "epoch %d is behind the swarm's %d: loading state from peers",
                self.local_epoch,
                progress.epoch,
            )
            self.load_state_from_peers()
            return loss

        if batch_size and grad_scaler is not None and not self._unscale(grad_scaler):
            logger.debug(
                "gradients overflowed at scale %s: dropping this batch", grad_scaler.get_scale()
            )
            for p in self.params:
                p.grad = None
            batch_size = 0
        if batch_size:
            self._accumulate(batch_size)
        if self.use_local_updates and batch_size:
            self._local_step()
        self._report(batch_size)
        progress = self.tracker.global_progress
        if progress.ready and progress.epoch == self.local_epoch:
            self._finish_epoch()
        return loss

    def _report(self, new_samples: int = 0) -> None:
        pending = self._pending
        if pending is not None and pending.holds_announcement:
            # the epoch's rounds still run: keep inviting slower peers into them
            self.tracker.report_local_progress(pending.epoch, pending.samples, new_samples)
        else:
            self.tracker.report_local_progress(self.local_epoch, self._samples, new_samples)

    def _unscale(self, grad_scaler: torch.amp.GradScaler) -> bool:
        """Unscale the model's ``.grad`` in place and update the scaler; False if any gradient
        overflowed."""
        grad_scaler.unscale_(cast(torch.optim.Optimizer, self._model_grads))
        finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in self.params)
        grad_scaler.update()  # lowers the scale after an overflow, raises it after a clean run
        return finite

    def _accumulate(self, batch_size: int) -> None:
        # Σ batch_size · grad over local steps: divided by Σ batch_size before averaging, it is
        # this peer's mean gradient per sample; averaging with weight Σ batch_size then gives
        # the mean over every sample the swarm processed.
        if not (self.reuse_grad_buffers or self.use_local_updates):
            # (with reuse_grad_buffers .grad itself accumulates: backward adds to it)
            with torch.no_grad():
                for p, acc in zip(self.params, self._acc, strict=True):
                    if p.grad is not None:
                        acc.add_(p.grad.to(acc.device), alpha=float(batch_size))
        self._samples += batch_size

    def _local_step(self) -> None:
        """use_local_updates: step with this call's gradients."""
        with self._live_state(), torch.no_grad():
            if self.options.offload_optimizer:
                self._set_optimizer_grads([p.grad for p in self.params])
            self.opt.step()
            self._state_version += 1
            self._copy_to_model()

    def _set_optimizer_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Put ``grads`` in the optimizer's parameters' ``.grad`` (its own buffers with
        offload_optimizer; fresh tensors otherwise, as the user's backward would add to
        anything left there)."""
        with torch.no_grad():
            for op, g in zip(self._opt_params, grads, strict=True):
                if g is None:
                    op.grad = None
                elif self.options.offload_optimizer and op.grad is not None:
                    op.grad.copy_(g)
                else:
                    op.grad = g.to(op.device, copy=True)

    # ------------------------------------------------------------------ epochs

    def _finish_epoch(self) -> None:
        """Average, step, advance the epoch: the phases before the first delayed one run
        here, the rest in the background thread."""
        self._settle_pending()  # one background epoch at a time; it also frees the buffers
        epoch = self.local_epoch
        averaging = not self.use_local_updates
        job = _Epoch(
            epoch=epoch,
            samples=self._samples,
            grad_round=averaging,
            optimizer_step=averaging and not self.auxiliary,
            state_round=(self.use_local_updates or (epoch + 1) % self.average_state_every == 0)
            and not (self.auxiliary and not self.use_local_updates),
        )
        if averaging:
            self._load_round_gradients(float(self._samples))
        phases = [
            ("grad", job.grad_round, self.options.delay_grad_averaging),
            ("step", True, self.options.delay_optimizer_step),
            ("state", job.state_round, self.options.delay_state_averaging),
        ]
        inline = []
        for name, wanted, delayed in phases:
            if delayed:
                break
            if wanted:
                inline.append(name)
        job.phases = [n for n, wanted, _ in phases if wanted and n not in inline]
        self._run_phases(job, inline)
        self._consume_model_gradients()
        self.local_epoch = epoch + 1
        self._samples = 0
        if job.phases:
            assert self._executor is not None
            job.holds_announcement = any(n in ("grad", "state") for n in job.phases)
            self._pending = job
            job.future = self._executor.submit(self._run_phases, job, job.phases)
        else:
            self._apply(job)
        # Announced only now (or, while a background round runs, once it ended): a peer that
        # sees the new epoch before joining this epoch's rounds would load state instead of
        # averaging, and leave the others waiting for it.
        self._report()

    def _load_round_gradients(self, weight: float) -> None:
        """This peer's mean gradient into the gradient averager's tensors; the accumulators
        are emptied for the next epoch. Training thread; no round is in flight."""
        with self.grad_averager.get_tensors() as grads, torch.no_grad():
            for g, acc, p in zip(grads, self._acc, self.params, strict=True):
                if self.reuse_grad_buffers:
                    # .grad holds the sum of per-step mean gradients, each over batch_size_per_step
                    g.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
                    per_step = float(self.batch_size_per_step or 0)
                    g.mul_(per_step / weight if weight else 0.0)
                elif acc is not g:
                    g.copy_(acc).div_(weight) if weight else g.zero_()
                    acc.zero_()
                elif weight:
                    g.div_(weight)

    def _consume_model_gradients(self) -> None:
        # The gradients are consumed: they were accumulated before this round. Left in .grad,
        # the next backward would add to them (the epoch may end in a later step() call, after
        # the user's zero_grad()).
        if self.use_local_updates:
            return
        for p in self.params:
            if self.reuse_grad_buffers and p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = None

    def _run_phases(self, job: _Epoch, phases: Sequence[str]) -> None:
        """Run some of an epoch's phases, in order: here or in the background thread."""
        for name in phases:
            if job.cancelled:
                return
            if name == "grad":
                self._average_gradients(job)
            elif name == "step":
                self._optimizer_step(job)
            else:
                self._average_state(job)

    def _average_gradients(self, job: _Epoch) -> None:
        if self._epoch_in_group_bits:
            self.grad_averager.set_group_bits(format(job.epoch % (1 << 16), "016b"))
        group = self._run_round(
            self.grad_averager,
            weight=0.0 if self.auxiliary else float(job.samples),
            gather={"epoch": job.epoch, "samples": job.samples},
            what=f"epoch {job.epoch}: gradient averaging",
            fallback="stepping with local gradients",
        )
        if self.verbose and group is not None:
            logger.info("epoch %d: averaged gradients with %d peers", job.epoch, len(group))
        with self.grad_averager.get_tensors() as grads, torch.no_grad():
            if job.optimizer_step:
                with self._live_state():
                    self._set_optimizer_grads(list(grads))
            for g in grads:
                g.zero_()  # without delay_grad_averaging they accumulate the next epoch

    def _optimizer_step(self, job: _Epoch) -> None:
        with self._live_state():
            if job.optimizer_step:
                self.opt.step()
                job.stepped = True
            if self.scheduler is not None:
                self.scheduler.step()
            self._set_state_epoch(job.epoch + 1)

    def _average_state(self, job: _Epoch) -> None:
        with self._live_state(), self.state_averager.get_tensors() as shared, torch.no_grad():
            for mine, s in zip(self._state_tensors(), shared, strict=True):
                s.copy_(mine)
            job.state_version = self._state_version
            if self.use_local_updates:  # local steps may change the live state meanwhile
                job.state_snapshot = [s.clone() for s in shared]
        if self._epoch_in_group_bits:
            self.state_averager.set_group_bits(format((job.epoch + 1) % (1 << 16), "016b"))
        group = self._run_round(
            self.state_averager,
            weight=0.0 if self.auxiliary else 1.0,
            gather=None,
            what=f"epoch {job.epoch}: state averaging",
            fallback="skipped",
            level=logging.DEBUG,
        )
        if group is not None:
            with self.state_averager.get_tensors() as shared:
                job.state_averaged = [s.clone() for s in shared]

    def _run_round(
        self,
        averager: DecentralizedAverager,
        *,
        weight: float,
        gather: Any,
        what: str,
        fallback: str,
        level: int = logging.WARNING,
    ) -> dict[str, Any] | None:
        """One averaging round; None (logged) if it failed or was cancelled, or if no other
        peer of the run has a live progress report (nobody to average with: a lone peer does
        not wait out ``averaging_timeout`` every epoch). A peer that is there but behind
        still gets the chance to join: the round looks for a group as usual."""
        if not self.tracker.others_reporting():
            logger.debug("%s skipped: no other peer in the run; %s", what, fallback)
            return None
        try:
            control = averager.step(
                weight=weight, timeout=self.averaging_timeout, gather=gather, wait=False
            )
            assert isinstance(control, StepControl)  # wait=False always returns one
            self._round = control
            result = control.result()
        except StepFailed as exc:
            if not self._closed:
                self.rounds_failed += 1
                self.last_failure = type(exc).__name__
                logger.log(level, "%s failed (%s); %s", what, exc, fallback)
            return None
        except RuntimeError:
            if self._closed:  # the averager shut down under us
                return None
            raise
        finally:
            self._round = None
        self.rounds_done += 1
        group = cast(dict[str, Any], result)
        self.last_group_size = len(group)
        return group

    def _apply(self, job: _Epoch) -> None:
        """Bring a finished epoch's results to the model. Training thread."""
        with self._live_state():
            if job.state_averaged is not None:
                if self._state_version == job.state_version or job.state_snapshot is None:
                    self._load_state_tensors(job.state_averaged)
                else:
                    # local steps were taken during the round: keep them, add the round's change
                    live = self._state_tensors()
                    self._load_state_tensors(
                        [
                            t + (a - s)
                            for t, a, s in zip(
                                live, job.state_averaged, job.state_snapshot, strict=True
                            )
                        ]
                    )
            elif job.stepped:
                self._copy_to_model()

    def _settle_pending(self, *, cancel: bool = False, timeout: float | None = None) -> bool:
        """Wait for the background epoch and apply what it finished (with ``cancel``, it
        stops at the next phase and a round in matchmaking is called off). False if it is
        still running after ``timeout``."""
        job = self._pending
        if job is None:
            return True
        if cancel:
            job.cancelled = True
            control = self._round
            if control is not None:
                control.cancel()
        assert job.future is not None
        try:
            job.future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        finally:
            if job.future.done():
                self._pending = None
        self._apply(job)  # even a cancelled one: its optimizer step may have run
        if job.holds_announcement:
            self._report()
        return True

    def interrupt(self) -> None:
        """Call off the averaging round in flight, if any; safe from any thread (e.g. a
        signal handler's). The step running it goes on as after a failed round."""
        control = self._round
        if control is not None:
            control.cancel()

    def wait_for_pending(self, timeout: float | None = None) -> bool:
        """Wait until background work (a delayed round or optimizer step) has finished, and
        apply its result to the model's parameters — e.g. after the last ``step()``, before
        evaluating or saving. Returns False if it still runs after ``timeout`` seconds.
        Without ``delay_*`` options there is never anything pending."""
        return self._settle_pending(timeout=timeout)

    def load_state_from_peers(self) -> bool:
        """Download parameters, optimizer state and epoch from the peer with the newest state;
        True if a state was loaded. A background epoch still in progress is abandoned first
        (the state replaces it).

        Donors are tried newest state first (their priority is their state's epoch). While
        this peer is still behind the swarm's epoch as it stood when the download began —
        no donor answered (none visible yet, all busy or timing out) or only a straggler
        did — the download is retried with backoff, for ``load_state_timeout`` seconds in
        all: a newcomer joining a running swarm starts from the swarm's state, not from
        scratch. A peer that finds no one ahead of it (the first peer) does not wait."""
        self._settle_pending(cancel=True)
        deadline = time.monotonic() + self.load_state_timeout
        # The swarm's epoch now, from a fresh pull (a newcomer's replica may still be empty);
        # a donor at that epoch snapshots later, so its state is at least that new.
        self.node.get(self.tracker.key, latest=True)
        target = self.tracker.global_progress.epoch
        loaded = False
        backoff = 0.1
        while True:
            found = self.state_averager.load_state_from_peers(
                timeout=max(0.0, deadline - time.monotonic())
            )
            if isinstance(found, tuple) and self._load_downloaded_state(*found):
                loaded = True
            # never chase a swarm that moves on meanwhile; but stop waiting for an epoch
            # whose reports went away (peers that left retract theirs; a dead one's expire)
            target = min(target, self.tracker.global_progress.epoch)
            if self.local_epoch >= target or self._closed:
                return loaded
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning(
                    "no peer provided the swarm's state at epoch %d within %s s; "
                    "continuing at epoch %d",
                    target,
                    self.load_state_timeout,
                    self.local_epoch,
                )
                return loaded
            logger.info(
                "no donor provided the swarm's state at epoch %d yet (this peer is at %d); "
                "retrying in %.1f s",
                target,
                self.local_epoch,
                min(backoff, remaining),
            )
            if self._closing.wait(min(backoff, remaining)):
                return loaded
            backoff = min(2 * backoff, 2.0)

    def _load_downloaded_state(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """Adopt a downloaded ``(metadata, tensors)`` unless it is older than this peer's."""
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        if not isinstance(epoch, int) or epoch < self.local_epoch:
            return False
        try:
            with self._live_state():
                self._load_state_tensors(tensors)
                if self.scheduler is not None:
                    for _ in range(epoch - self._state_epoch):
                        self.scheduler.step()
                self._set_state_epoch(epoch)
        except ValueError as exc:
            logger.warning("could not load state from peers: %s", exc)
            return False
        with torch.no_grad():
            for buffer in (self._acc, self._averaged_grads):
                for g in buffer:
                    g.zero_()
        self._samples = 0
        self.local_epoch = epoch
        self._report()
        logger.info("loaded state from %s at epoch %d", self.state_averager.last_state_donor, epoch)
        return True

    def _set_state_epoch(self, epoch: int) -> None:
        """The live state now belongs to ``epoch``. It is also the state's sharing priority, so
        newcomers download the newest state rather than a straggler's (hivemind does the
        same). Live-state lock held; any thread."""
        self._state_epoch = epoch
        self.state_averager.state_sharing_priority = float(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler and epoch; waits for pending background work first, so the
        state is the newest."""
        self.wait_for_pending()
        return {
            "optimizer": self.opt.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "local_epoch": self.local_epoch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._settle_pending(cancel=True)
        with self._live_state():
            self.opt.load_state_dict(state["optimizer"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            self._state_version += 1
            self.local_epoch = int(state["local_epoch"])
            self._set_state_epoch(self.local_epoch)
        self._report()

    def shutdown(self) -> None:
        """Stop background work at once (a round in flight is cancelled, a pending update is
        dropped: call :meth:`wait_for_pending` first to keep it), then both averagers; the
        progress report is retracted. The node is not shut down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        if self._pending is not None:
            self._pending.cancelled = True
        control = self._round
        if control is not None:
            control.cancel()
        self.tracker.shutdown()
        self.grad_averager.shutdown()  # cancels its steps: a background round ends now
        self.state_averager.shutdown()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._pending = None

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
