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
  state, epoch) from a peer instead of stepping; a newcomer does so on start;
* a peer that has nothing accumulated when the swarm is ready joins the round with weight 0
  (it receives the average and steps in sync) rather than stalling the others;
* the gradient round's group key carries the epoch, so peers at different epochs never
  average together;
* if the gradient round fails (a peer died mid-round, a timeout), the peer logs it and steps
  with the gradients it has — the round's partial average or its own — and periodic state
  averaging (``average_state_every`` epochs) pulls diverged parameters back together.

Locking: the training thread owns parameters and optimizer state; averaging runs on the
node's event loop only inside :meth:`Optimizer.step`, which waits for it, so nothing reads
parameters half-updated. (The ``delay_*`` options, which would overlap averaging with
compute, are not implemented yet and are refused with a ``ValueError``.)
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.exceptions import StepFailed
from peer.compression import Compression, NoCompression

logger = logging.getLogger("peer.optim.collaborative")

__all__ = [
    "CollaborativeReport",
    "GlobalProgress",
    "Optimizer",
    "ProgressTracker",
    "compute_global_progress",
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
    """Publishes this peer's progress and reads the swarm's from the node's gossip store."""

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
        if not force and state == self._last_published:
            return
        if self._pending is not None and not self._pending.done():
            return
        own = self._own()
        self._last_published = state
        self._pending = self.node.run_coroutine(
            self.node.core.store(
                self.key, own.to_wire(), own.time + self.expiration, subkey=self.node.peer_id
            ),
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
        record = self.node.get(self.key)
        reports = []
        if record is not None and isinstance(record.value, dict):
            for peer_id, entry in record.value.items():
                parsed = CollaborativeReport.from_wire(str(peer_id), entry.value)
                if parsed is not None:
                    reports.append(parsed)
        return compute_global_progress(
            reports, self._own(), target_batch_size=self.target_batch_size, now=self.node.get_time()
        )

    def wait_published(self, timeout: float = 5.0) -> None:
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.result(timeout)


# --------------------------------------------------------------------------- state averager


class _StateAverager(DecentralizedAverager):
    """Parameters and optimizer state; shares them (with the epoch) with newcomers."""

    def __init__(
        self, owner: Optimizer, tensors: list[torch.Tensor], node: Any, **kwargs: Any
    ) -> None:
        self._owner = owner
        super().__init__(tensors, node, **kwargs)

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        with torch.no_grad():
            tensors = [t.detach().clone() for t in self._owner._state_tensors()]
        return {"epoch": self._owner.local_epoch}, tensors


# --------------------------------------------------------------------------- the optimizer

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
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

    ``step(batch_size=0)`` with no new gradients takes part in the swarm's progress without
    contributing samples (e.g. while waiting for the epoch to advance).
    """

    def __init__(
        self,
        *,
        node: Any,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: Iterable[torch.nn.Parameter] | None = None,
        scheduler: Any | SchedulerFactory | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        load_state_timeout: float = 600.0,
        average_state_every: int = 1,
        delay_state_averaging: bool = False,
        delay_optimizer_step: bool = False,
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
        for name, value in (
            ("delay_state_averaging", delay_state_averaging),
            ("delay_optimizer_step", delay_optimizer_step),
            ("delay_grad_averaging", delay_grad_averaging),
        ):
            if value:
                raise ValueError(
                    f"{name}=True is not implemented yet: averaging runs inside step()"
                )
        if use_local_updates and reuse_grad_buffers:
            raise ValueError(
                "use_local_updates steps on every call, so there is no gradient accumulation to reuse"
            )
        if reuse_grad_buffers and batch_size_per_step is None:
            raise ValueError(
                "reuse_grad_buffers sums per-step mean gradients in .grad; it needs a fixed batch_size_per_step to weight them"
            )
        if client_mode is None:
            client_mode = bool(node.client_mode)
        if auxiliary and client_mode:
            raise ValueError("an auxiliary peer reduces for others, so it cannot be in client mode")
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            if params is None:
                raise ValueError("pass params= when optimizer is a factory")
            optimizer = optimizer(list(params))
        elif params is not None:
            raise ValueError(
                "params= is only for an optimizer factory; this optimizer already has its params"
            )
        assert isinstance(optimizer, torch.optim.Optimizer)
        self.opt = optimizer
        self.params: list[torch.nn.Parameter] = [
            p for g in optimizer.param_groups for p in g["params"]
        ]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        if any(p.device.type != "cpu" for p in self.params) and not offload_optimizer:
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
        self._samples = 0
        self._initialize_optimizer_state()

        opts = dict(averager_opts or {})
        opts.setdefault("min_matchmaking_time", matchmaking_time)
        opts.setdefault("allreduce_timeout", averaging_timeout)
        self._epoch_in_group_bits = opts.get("target_group_size") is None
        # Gradient buffers: the averaged tensors of the gradient averager (host memory).
        self._grads = [torch.zeros_like(p, device="cpu") for p in self.params]
        self.grad_averager = DecentralizedAverager(
            self._grads,
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
            **opts,
        )
        self.tracker = ProgressTracker(node, run_id, target_batch_size, client_mode=client_mode)
        self.tracker.report_local_progress(self.local_epoch, 0)
        if not auxiliary:
            self.load_state_from_peers()

    # ---------------------------------------------------------------- optimizer state

    def _initialize_optimizer_state(self) -> None:
        """Create the optimizer's state tensors now (one step on zero gradients, undone), so
        their set is fixed for averaging and state download. For SGD (momentum buffer 0) and
        Adam-style optimizers (moments 0, step count reset to 0) the first real step then
        behaves exactly as on a fresh optimizer."""
        saved = [p.detach().clone() for p in self.params]
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt.step()
        with torch.no_grad():
            for p, s, g in zip(self.params, saved, grads, strict=True):
                p.copy_(s)
                p.grad = g
        for state in self.opt.state.values():
            for key, value in state.items():
                if key == "step":
                    state[key] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0
                elif isinstance(value, torch.Tensor) and key != "step":
                    value.zero_()

    def _state_tensors(self) -> list[torch.Tensor]:
        """Parameters, then every optimizer state tensor in a fixed order (float scalars like
        Adam's step are included as 0-d tensors)."""
        tensors: list[torch.Tensor] = [p.data for p in self.params]
        for p in self.params:
            state = self.opt.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    tensors.append(value if value.is_floating_point() else value.float())
        return tensors

    def _load_state_tensors(self, tensors: list[torch.Tensor]) -> None:
        own = self._state_tensors()
        if len(own) != len(tensors) or any(
            a.shape != b.shape for a, b in zip(own, tensors, strict=True)
        ):
            raise ValueError("the downloaded state does not match this model and optimizer")
        with torch.no_grad():
            for p, t in zip(self.params, tensors, strict=False):
                p.copy_(t)
            i = len(self.params)
            for p in self.params:
                state = self.opt.state.get(p, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor):
                        value.copy_(tensors[i].to(value.dtype))
                        i += 1

    # ----------------------------------------------------------------------- API

    @property
    def global_progress(self) -> GlobalProgress:
        return self.tracker.global_progress

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.reuse_grad_buffers:
            raise ValueError(
                "with reuse_grad_buffers=True gradients accumulate in .grad: do not zero them"
            )
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> Any:
        """Account for this call's gradients; when the swarm has processed
        ``target_batch_size`` samples, average and take one optimizer step.

        ``batch_size`` (default ``batch_size_per_step``) is the number of samples behind the
        current ``.grad``. With mixed precision, pass the ``torch.amp.GradScaler`` that scaled
        the loss: gradients are unscaled before they are accumulated, a batch whose gradients
        overflowed is dropped (its samples do not count), and the scaler is updated — call
        neither ``scaler.step`` nor ``scaler.update`` yourself. Returns the closure's loss,
        if a closure was given."""
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
            self.opt.step()
        self.tracker.report_local_progress(self.local_epoch, self._samples, batch_size)
        progress = self.tracker.global_progress
        if progress.ready and progress.epoch == self.local_epoch:
            self._finish_epoch()
        return loss

    def _unscale(self, grad_scaler: torch.amp.GradScaler) -> bool:
        """Unscale ``.grad`` in place and update the scaler; False if any gradient overflowed."""
        grad_scaler.unscale_(self.opt)
        finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in self.params)
        grad_scaler.update()  # lowers the scale after an overflow, raises it after a clean run
        return finite

    def _accumulate(self, batch_size: int) -> None:
        # Σ batch_size · grad over local steps: divided by Σ batch_size before averaging, it is
        # this peer's mean gradient per sample; averaging with weight Σ batch_size then gives
        # the mean over every sample the swarm processed.
        with torch.no_grad():
            for p, acc in zip(self.params, self._grads, strict=True):
                if p.grad is None:
                    continue
                if self.reuse_grad_buffers:
                    continue  # .grad itself accumulates (backward adds to it)
                acc.add_(p.grad.to(acc.device), alpha=float(batch_size))
        self._samples += batch_size

    def _finish_epoch(self) -> None:
        epoch = self.local_epoch
        weight = float(self._samples)
        if not self.use_local_updates:
            with self.grad_averager.get_tensors() as grads, torch.no_grad():
                for g, p in zip(grads, self.params, strict=True):
                    if self.reuse_grad_buffers:
                        # .grad holds the sum of per-step mean gradients, each over batch_size_per_step
                        g.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
                        per_step = float(self.batch_size_per_step or 0)
                        g.mul_(per_step / weight if weight else 0.0)
                    elif weight:
                        g.div_(weight)
            if self._epoch_in_group_bits:
                self.grad_averager.set_group_bits(format(epoch % (1 << 16), "016b"))
            try:
                group = self.grad_averager.step(
                    weight=0.0 if self.auxiliary else weight,
                    timeout=self.averaging_timeout,
                    gather={"epoch": epoch, "samples": int(weight)},
                )
                if self.verbose and isinstance(group, dict):
                    logger.info("epoch %d: averaged gradients with %d peers", epoch, len(group))
            except StepFailed as exc:
                logger.warning(
                    "epoch %d: gradient averaging failed (%s); stepping with local gradients",
                    epoch,
                    exc,
                )
            if not self.auxiliary:
                with self.grad_averager.get_tensors() as grads, torch.no_grad():
                    for p, g in zip(self.params, grads, strict=True):
                        p.grad = g.to(p.device).clone()
                self.opt.step()
            with torch.no_grad():
                for g in self._grads:
                    g.zero_()
                for p in self.params:
                    # The gradients are consumed: they were accumulated before this round. Left
                    # in .grad, the next backward would add to them (the epoch may end in a
                    # later step() call, after the user's zero_grad()).
                    if self.reuse_grad_buffers and p.grad is not None:
                        p.grad.zero_()
                    else:
                        p.grad = None
        self.local_epoch = epoch + 1
        self._samples = 0
        if self.scheduler is not None:
            self.scheduler.step()
        if self.use_local_updates or self.local_epoch % self.average_state_every == 0:
            self._average_state()
        # Announced only now: a peer that sees the new epoch before joining this epoch's rounds
        # would load state instead of averaging, and leave the others waiting for it.
        self.tracker.report_local_progress(self.local_epoch, 0)

    def _average_state(self) -> None:
        if self.auxiliary and not self.use_local_updates:
            return
        with self.state_averager.get_tensors() as tensors, torch.no_grad():
            for mine, shared in zip(self._state_tensors(), tensors, strict=True):
                shared.copy_(mine)
        if self._epoch_in_group_bits:
            self.state_averager.set_group_bits(format(self.local_epoch % (1 << 16), "016b"))
        try:
            self.state_averager.step(
                timeout=self.averaging_timeout, weight=0.0 if self.auxiliary else 1.0
            )
        except StepFailed as exc:
            logger.debug("state averaging skipped this epoch: %s", exc)
            return
        with self.state_averager.get_tensors() as tensors:
            self._load_state_tensors([t.clone() for t in tensors])

    def load_state_from_peers(self) -> bool:
        """Download parameters, optimizer state and epoch from the best peer; True if done."""
        found = self.state_averager.load_state_from_peers(timeout=self.load_state_timeout)
        if not isinstance(found, tuple):
            return False
        metadata, tensors = found
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        if not isinstance(epoch, int) or epoch < self.local_epoch:
            return False
        try:
            self._load_state_tensors(tensors)
        except ValueError as exc:
            logger.warning("could not load state from peers: %s", exc)
            return False
        with torch.no_grad():
            for g in self._grads:
                g.zero_()
        self._samples = 0
        if self.scheduler is not None:
            for _ in range(epoch - self.local_epoch):
                self.scheduler.step()
        self.local_epoch = epoch
        self.tracker.report_local_progress(self.local_epoch, 0)
        logger.info("loaded state from %s at epoch %d", self.state_averager.last_state_donor, epoch)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.opt.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "local_epoch": self.local_epoch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.opt.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.local_epoch = int(state["local_epoch"])
        self.tracker.report_local_progress(self.local_epoch, self._samples)

    def shutdown(self) -> None:
        """Stop both averagers (the node is not shut down)."""
        self.tracker.wait_published()
        self.grad_averager.shutdown()
        self.state_averager.shutdown()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
