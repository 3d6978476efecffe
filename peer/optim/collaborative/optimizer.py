"""``peer.Optimizer``: collaborative training with a global batch size.

Peers accumulate gradients, weighted by the samples they processed, until the swarm together
has processed ``target_batch_size`` samples (counted through :mod:`peer.optim.shared.progress`);
then they average the accumulated gradients in groups (weight = samples: the result is the
gradient of the mean loss over every sample the swarm saw) and each takes the same optimizer
step. That is one epoch. With exact averaging in one group, every peer ends each epoch with
the parameters one process would have after a step on the concatenated batches.

This module runs the pieces, one idea each: the options (:mod:`~peer.optim.collaborative.options`),
the phases that end an epoch (:mod:`~peer.optim.collaborative.epochs`,
:mod:`~peer.optim.collaborative.phases`, :mod:`~peer.optim.collaborative.rounds`), the gradients
between rounds (:mod:`~peer.optim.collaborative.accumulation`), the live state averaged and served
to newcomers (:mod:`~peer.optim.shared.live_state`, :mod:`~peer.optim.shared.optimizer_state`),
catching up (:mod:`~peer.optim.shared.live_catchup`) and the background epoch
(:mod:`~peer.optim.shared.pending`). See :class:`Optimizer` for the loop and the options.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TypeVar, cast

import torch
from torch.optim.optimizer import ParamsT

from peer.averaging.allreduce.robust import check_aggregator
from peer.averaging.averager import DecentralizedAverager
from peer.compression import Compression, NoCompression
from peer.formats.open_types import StateDict
from peer.optim.averager_options import SharedAveragerOptions
from peer.optim.buffers import ModelBuffers
from peer.optim.collaborative.accumulation import GradientAccumulator
from peer.optim.collaborative.epochs import EpochRun, plan_epoch
from peer.optim.collaborative.options import resolve_options
from peer.optim.collaborative.phases import EpochPhases
from peer.optim.collaborative.rounds import RoundRunner
from peer.optim.scheduler import Scheduler, SchedulerFactory
from peer.optim.seam import SwarmNode
from peer.optim.shared.live_catchup import LiveCatchUp
from peer.optim.shared.live_state import LiveState, OptimizerFactory
from peer.optim.shared.optimizer_state import SharedLiveState
from peer.optim.shared.pending import Pending
from peer.optim.shared.progress import PerformanceEMA, ProgressTracker

logger = logging.getLogger("peer.optim.collaborative")

__all__ = ["Optimizer"]

#: what a closure given to :meth:`Optimizer.step` returns (the loss)
LossT = TypeVar("LossT")


class Optimizer(LiveCatchUp[EpochRun]):
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

    ``buffers`` — the model's buffers to share (``peer.optim.model_buffers(model)``; none by
    default): each state round averages their values with the parameters (integer ones
    rounded back, see :mod:`peer.optim.buffers`), and newcomers download them with the state.

    Against bad peers in open runs (not in hivemind; see ``docs/averaging.md``):

    * ``aggregator`` — ``"mean"`` (default), ``"trimmed_mean"`` or ``"centered_clip"``: how
      both rounds combine the peers' contributions; every peer of a run must use the same.
    * ``relative_weight_bound`` — a peer whose gradient round weight (its samples) is over
      this factor times the group's median is left out of the round. Default: no bound.

    Combinations that cannot work raise ``ValueError`` naming the reason (see
    :func:`resolve_options`). Call :meth:`shutdown` when done (the node is not shut down).

    How the swarm keeps moving: a peer whose ``local_epoch`` is behind the swarm's loads the state
    (parameters, optimizer state, epoch) instead of stepping, and a newcomer does so on start
    (:mod:`peer.optim.shared.catchup`); a peer with nothing accumulated when the swarm is ready
    joins the round with weight 0; the gradient round's group key carries the epoch, and a new epoch
    is announced only once the epoch's rounds ended, so a slow peer still finds the others there; a
    failed round leaves each peer stepping with what it has (the partial average or its own), and
    state rounds (every ``average_state_every`` epochs) pull diverged parameters back together; a
    lone peer skips the rounds, and one left behind in a round nobody can join loads the others'
    state (:mod:`peer.optim.collaborative.rounds`).

    An epoch runs three phases: the gradient round, the optimizer step (with the scheduler
    step), the state round. A ``delay_*`` option moves a phase, and every phase after it, to
    a background thread; ``step()`` returns at once and the next epoch accumulates
    meanwhile. The finished epoch is applied at the start of a later ``step()``, or by
    :meth:`wait_for_pending`. Delayed results are one step stale by design (delayed
    parameter updates, arXiv:2101.06840): ``θ[k+1] = step(θ[k], ∇L_k(θ[k-1]))``.

    Locking: only the training thread writes the model's parameters (forward and backward
    passes read them), so a delayed optimizer step needs ``offload_optimizer``. The
    offloaded parameters and the optimizer state (the *live state*) are read and written
    under the state averager's lock, which also guards the snapshot served to newcomers.
    """

    def __init__(
        self,
        *,
        node: SwarmNode,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: ParamsT | None = None,
        buffers: Iterable[torch.Tensor] | None = None,
        scheduler: Scheduler | SchedulerFactory | None = None,
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
        aggregator: str = "mean",
        relative_weight_bound: float | None = None,
        averager_opts: SharedAveragerOptions | None = None,
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
        self.live = LiveState(
            optimizer,
            params,
            offload=self.options.offload_optimizer,
            buffers=ModelBuffers(buffers),
        )
        self.opt, self.params = self.live.opt, self.live.model_params
        if any(p.device.type != "cpu" for p in self.params) and not self.options.offload_optimizer:
            raise ValueError(
                "parameters off the CPU need offload_optimizer=True (averaging runs on host memory)"
            )
        # A scheduler instance has step(); anything else callable is a factory of one.
        self.scheduler: Scheduler | None
        if callable(scheduler) and not hasattr(scheduler, "step"):
            self.scheduler = scheduler(self.opt)
        else:
            self.scheduler = cast(Scheduler | None, scheduler)  # (it has step(), or is None)
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
        self._pending: Pending[EpochRun] = Pending()  # the background epoch, its round
        self._closed = False
        self._closing = threading.Event()  # set by shutdown(): ends a state-download retry
        # the gradient averager's tensors (host memory) and the accumulators
        self.grads = GradientAccumulator(self.params, self.options, batch_size_per_step)

        opts: SharedAveragerOptions = {**(averager_opts or {})}
        opts.setdefault("aggregator", check_aggregator(aggregator))
        opts.setdefault("relative_weight_bound", relative_weight_bound)
        opts.setdefault("min_matchmaking_time", matchmaking_time)
        opts.setdefault("allreduce_timeout", averaging_timeout)
        epoch_in_group_bits = opts.get("target_group_size") is None
        self.grad_averager = DecentralizedAverager(
            self.grads.averaged,
            node,
            start=True,
            prefix=f"{run_id}_grad_averager",
            compression=grad_compression,
            client_mode=client_mode,
            auxiliary=auxiliary,
            allow_state_sharing=False,
            **opts,
        )
        # the live state, served to newcomers and averaged by the state rounds
        self.shared = SharedLiveState(
            self.live,
            node,
            start=True,
            prefix=f"{run_id}_state_averager",
            compression=state_averaging_compression,
            state_compression=state_averaging_compression,
            client_mode=client_mode,
            auxiliary=auxiliary,
            **opts,
        )
        self.state_averager = self.shared.averager
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"swarmgrad-collab-{run_id}"
            )
            if self.options.delays_anything
            else None
        )
        self.performance = PerformanceEMA()
        self.tracker = ProgressTracker(node, run_id, target_batch_size, expiration=60.0)
        self.rounds = RoundRunner(
            tracker=self.tracker,
            peer_id=node.peer_id,
            timeout=averaging_timeout,
            pending=self._pending,
            closing=self._closing,
        )
        self.phases = EpochPhases(
            shared=self.shared,
            grad_averager=self.grad_averager,
            rounds=self.rounds,
            step_scheduler=self._step_scheduler,
            auxiliary=auxiliary,
            use_local_updates=use_local_updates,
            epoch_in_group_bits=epoch_in_group_bits,
            average_state_every=average_state_every,
            verbose=verbose,
        )
        self._wire_catch_up(load_state_timeout)
        self._report()
        if not auxiliary:
            self.load_state_from_peers()

    # ------------------------------------------------------------- catching up

    def _step_scheduler(self) -> None:
        """One swarm epoch passed: the scheduler (if any) steps once."""
        if self.scheduler is not None:
            self.scheduler.step()

    def _start_epoch_at(self, epoch: int) -> None:
        """What was accumulated for an older epoch is dropped."""
        self.grads.reset()
        self.local_epoch = epoch
        self._report()

    # ----------------------------------------------------------------------- API

    # outcomes of the gradient and state rounds, for progress reports
    @property
    def rounds_done(self) -> int:
        return self.rounds.rounds_done

    @property
    def rounds_failed(self) -> int:
        return self.rounds.rounds_failed

    @property
    def last_group_size(self) -> int | None:
        return self.rounds.last_group_size

    @property
    def last_failure(self) -> str | None:
        """The class name of the last failed round's error."""
        return self.rounds.last_failure

    @property
    def param_groups(self) -> list[StateDict]:
        """The wrapped optimizer's parameter groups (learning rates and the like; with
        ``offload_optimizer`` their tensors are the host-memory copies)."""
        return self.opt.param_groups

    @property
    def state(self) -> defaultdict[torch.Tensor, StateDict]:
        """The wrapped optimizer's per-parameter state."""
        return self.opt.state

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
        closure: Callable[[], LossT] | None = None,
        batch_size: int | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> LossT | None:
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
        if self._pending.landed:
            self._settle_pending()

        progress = self.global_progress
        if progress.epoch > self.local_epoch or self.rounds.behind:
            logger.info(
                "epoch %d is behind the swarm's %d: loading state from peers",
                self.local_epoch,
                progress.epoch,
            )
            self.rounds.behind = False
            self.load_state_from_peers()
            return loss

        if batch_size and grad_scaler is not None and not self.grads.unscale(grad_scaler):
            logger.debug(
                "gradients overflowed at scale %s: dropping this batch", grad_scaler.get_scale()
            )
            for p in self.params:
                p.grad = None
            batch_size = 0
        if batch_size:
            self.grads.add(batch_size)
        if self.use_local_updates and batch_size:
            self._local_step()
        self._wait_when_a_full_epoch_ahead()
        self._report(batch_size)
        progress = self.global_progress
        if progress.ready and progress.epoch == self.local_epoch:
            self._finish_epoch()
        return loss

    def _wait_when_a_full_epoch_ahead(self) -> None:
        """While a background epoch runs, this peer accumulates the next one. Once it has
        done its share of the next epoch's target (its part of the running one's), the next
        epoch is about due: wait for the running one here. Parameters stay at most one epoch
        stale and an epoch does not grow without bound when averaging is slower than
        compute; the overlap is one epoch's averaging behind the next epoch's compute."""
        pending = self._pending.run
        if (
            pending is not None
            and pending.plan.share > 0
            and self.grads.samples >= pending.plan.share
        ):
            self._settle_pending()

    def _progress(self) -> tuple[int, int, int]:
        pending = self._pending.run
        if pending is not None and pending.plan.holds_announcement:
            # the epoch's rounds still run: keep inviting slower peers into them
            return pending.plan.epoch, pending.plan.samples, self.grads.samples_total
        return self.local_epoch, self.grads.samples, self.grads.samples_total

    def _local_step(self) -> None:
        """use_local_updates: step with this call's gradients."""
        with self.shared.lock(), torch.no_grad():
            if self.options.offload_optimizer:
                self.live.set_grads([p.grad for p in self.params])
            self.opt.step()
            self.live.version += 1
            self.live.copy_to_model()

    # ------------------------------------------------------------------ epochs

    def _finish_epoch(self) -> None:
        """Average, step, advance the epoch: the phases before the first delayed one run
        here, the rest in the background thread (see :mod:`peer.optim.collaborative.epochs`)."""
        self._settle_pending()  # one background epoch at a time; it also frees the buffers
        self._pending.interrupted = False  # an interrupt() calls off the epoch under way only
        plan = plan_epoch(
            self.options,
            epoch=self.local_epoch,
            samples=self.grads.samples,
            swarm_samples=self.global_progress.done_at_epoch,
            target_batch_size=self.target_batch_size,
            average_state_every=self.average_state_every,
            auxiliary=self.auxiliary,
        )
        run = EpochRun(plan)
        with self.shared.lock():
            self.live.buffers.read()  # the state round averages the buffers' values now
        if not self.use_local_updates:
            with self.grad_averager.get_tensors() as grads:
                self.grads.load_round(grads, float(self.grads.samples))
        self.phases.run(run, plan.inline)
        self.grads.consume_model_gradients()
        if not run.cancelled:  # (called off as behind: the epoch comes with the others' state)
            self.local_epoch = plan.epoch + 1
        self.grads.samples = 0
        if plan.background:
            assert self._executor is not None
            self._pending.run = run
            run.future = self._executor.submit(self.phases.run, run, plan.background)
        else:
            self.phases.apply(run)
        # Announced only now (or, while a background round runs, once it ended): a peer that
        # sees the new epoch before joining this epoch's rounds would load state instead of
        # averaging, and leave the others waiting for it.
        self._report()

    def _land(self, run: EpochRun) -> None:
        self.phases.apply(run)  # even a cancelled one: its optimizer step may have run
        if run.plan.holds_announcement:
            self._report()

    def state_dict(self) -> StateDict:
        """Optimizer, scheduler and epoch; waits for pending background work first, so the
        state is the newest."""
        self.wait_for_pending()
        return {
            "optimizer": self.opt.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "local_epoch": self.local_epoch,
            # the shared values of the model's buffers, as the last state round left them
            "buffers": [b.clone() for b in self.live.buffers.shared],
        }

    def synchronised_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` on the CPU with the buffers given to this optimizer at
        their shared values (those of the last state round, integer ones rounded): the
        model the swarm agrees on, to checkpoint or evaluate, as ``peer.DiLoCo``'s method
        of the same name. Parameters are the model's own, the swarm's between epochs
        (unless ``use_local_updates``). Training thread."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self._with_shared_buffers(model, state)
        return state

    def load_state_dict(self, state: StateDict) -> None:
        """Restore what :meth:`state_dict` returned (a state saved without buffers keeps
        this peer's); ``ValueError`` if its buffers do not fit."""
        shared = self.live.buffers.shared
        buffers = list(state.get("buffers", shared))
        if len(buffers) != len(shared) or any(
            a.shape != b.shape for a, b in zip(buffers, shared, strict=True)
        ):
            raise ValueError("the state's buffers do not match this model")
        self._settle_pending(cancel=True)
        with self.shared.lock():
            self.opt.load_state_dict(state["optimizer"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            with torch.no_grad():
                for b, value in zip(shared, buffers, strict=True):
                    b.copy_(value)
            self.live.buffers.write()
            self.live.version += 1
            self.local_epoch = int(state["local_epoch"])
            self.shared.set_epoch(self.local_epoch)
        self._report()

    def _round_averagers(self) -> list[DecentralizedAverager]:
        return [self.grad_averager]
