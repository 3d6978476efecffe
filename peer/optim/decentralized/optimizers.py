"""Local steps with background averaging: ``DecentralizedOptimizer``, ``DecentralizedSGD``,
``DecentralizedAdam``.

Signatures and meanings follow hivemind's decentralized optimizers (pass a :class:`peer.Node` where
hivemind took a ``DHT``). Each peer steps its own optimizer on its own batches; a background thread
(:mod:`peer.optim.decentralized.averaging_thread`) averages copies of the parameters (and/or
gradients, and named optimizer statistics) with other peers, which reach the model between two
passes (:mod:`peer.optim.decentralized.averaged_copies`); epochs are counted across the swarm
through progress reports (:mod:`peer.optim.shared.progress`), and newcomers download the state laid
out by :mod:`peer.optim.decentralized.state_layout`. See :class:`DecentralizedOptimizer`.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Unpack

import torch
from torch.optim.optimizer import ParamsT

from peer.formats.open_types import StateDict
from peer.optim.averager_options import PeerAveragerOptions
from peer.optim.decentralized.averaged_copies import AveragedCopies
from peer.optim.decentralized.averaging_thread import AveragingThread
from peer.optim.decentralized.state_layout import check_state, load_state, pack_state
from peer.optim.scheduler import SchedulerFactory
from peer.optim.seam import SwarmNode
from peer.optim.shared.catchup import CatchUp, CatchUpHost, CatchUpPolicy
from peer.optim.shared.claims import DISCOUNT_S
from peer.optim.shared.optimizer_state import StateSharingAverager, initialize_optimizer_state
from peer.optim.shared.progress import (
    PerformanceEMA,
    ProgressReport,
    ProgressTracker,
    SwarmProgress,
)

logger = logging.getLogger("peer.optim")

__all__ = [
    "DecentralizedAdam",
    "DecentralizedConfig",
    "DecentralizedOptimizer",
    "DecentralizedSGD",
]


@dataclass(frozen=True)
class DecentralizedConfig:
    """The options of :class:`DecentralizedOptimizer` that are not the averager's."""

    prefix: str
    average_parameters: bool
    average_gradients: bool
    average_opt_statistics: tuple[str, ...]
    max_allowed_epoch_difference: int
    total_steps_in_epoch: int
    averaging_steps_period: int = 1
    averaging_time_period: float = 0.0
    report_progress_expiration: float = 30.0
    timeout: float | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        if not self.prefix or not isinstance(self.prefix, str):
            raise ValueError("prefix must be a non-empty string")
        if not (self.average_parameters or self.average_gradients or self.average_opt_statistics):
            raise ValueError(
                "nothing to average: set average_parameters, average_gradients "
                "or average_opt_statistics"
            )
        if self.max_allowed_epoch_difference < 0:
            raise ValueError("max_allowed_epoch_difference must be non-negative")
        if self.total_steps_in_epoch < 1:
            raise ValueError("total_steps_in_epoch must be at least 1")
        if self.averaging_steps_period < 1:
            raise ValueError("averaging_steps_period must be at least 1")
        if self.averaging_time_period < 0:
            raise ValueError("averaging_time_period must be non-negative")
        if self.report_progress_expiration <= 0:
            raise ValueError("report_progress_expiration must be positive")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError("timeout must be positive")


class WrapperOptions(PeerAveragerOptions, total=False):
    """The keyword arguments :class:`DecentralizedAdam` passes on to
    :class:`DecentralizedOptimizer` (the averager's among them)."""

    max_allowed_epoch_difference: int
    total_steps_in_epoch: int
    scheduler_cls: SchedulerFactory | None
    averaging_time_period: float
    report_progress_expiration: float
    timeout: float | None
    verbose: bool


class SGDWrapperOptions(WrapperOptions, total=False):
    """The keyword arguments :class:`DecentralizedSGD` passes on to
    :class:`DecentralizedOptimizer`."""

    average_opt_statistics: Sequence[str]
    averaging_steps_period: int


class DecentralizedOptimizer(torch.optim.Optimizer):
    """Wrap ``opt``: local steps, averaging with peers in the background, swarm epochs.

    * ``average_parameters`` / ``average_gradients`` / ``average_opt_statistics`` (names of
      per-parameter entries of ``opt.state``, e.g. ``("exp_avg_sq",)``): what the background
      rounds average, in groups of up to ``target_group_size``.
    * A round starts every ``averaging_steps_period`` local steps and, if
      ``averaging_time_period > 0``, at least that often in seconds; a request made while a
      round runs is served by the next round. ``timeout`` bounds one round.
    * Epochs: the swarm's epoch advances when the steps reported at its latest epoch reach
      ``total_steps_in_epoch`` (summed over peers); ``scheduler_cls(opt)``, if given, steps
      once per epoch. A peer more than ``max_allowed_epoch_difference`` epochs behind loads
      the state from peers instead of stepping; one less far behind just moves its epoch on.
    * Other keyword arguments go to :class:`~peer.averaging.DecentralizedAverager`
      (``min_matchmaking_time``, ``request_timeout``, ``compression``, ``client_mode``, ...).

    A ``torch.optim.Optimizer`` as far as code written for one sees it (as hivemind's
    optimizers are): torch's learning-rate schedulers take it, :meth:`state_dict` and
    :meth:`load_state_dict` save and restore the wrapped optimizer's state with the epoch
    (averaged statistics are restored in place), :meth:`add_param_group` is refused (the
    averaged tensors are fixed at construction). Optimizer state that is averaged is
    referenced in place: do not replace those tensors through ``opt`` itself (e.g.
    ``opt.load_state_dict``) after construction. Call :meth:`shutdown` when done (or use as a
    context manager); the node is not shut down.

    Locking: one lock, the averager's (``averager.get_tensors()``). The averager
    (``concurrent_updates=True``) holds it while it copies the averaged tensors into its
    buffer at a round's start and adds ``average - copy`` back at its end, and a state donor
    while it snapshots; ``step()`` holds it while the wrapped optimizer updates parameters
    and statistics in place and while a downloaded state is copied in, ``zero_grad()``
    while it applies a round's result to the parameters. So a round never reads
    half-updated tensors, and ``step()`` waits at most for one copy or one in-place add.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        node: SwarmNode,
        *,
        prefix: str,
        target_group_size: int | None,
        average_parameters: bool,
        average_gradients: bool,
        max_allowed_epoch_difference: int = 1,
        total_steps_in_epoch: int = 1000,
        average_opt_statistics: Sequence[str] = (),
        scheduler_cls: SchedulerFactory | None = None,
        averaging_steps_period: int = 1,
        averaging_time_period: float = 0,
        report_progress_expiration: float = 30,
        timeout: float | None = None,
        verbose: bool = False,
        **averager_kwargs: Unpack[PeerAveragerOptions],
    ) -> None:
        if isinstance(average_opt_statistics, str):
            raise TypeError('average_opt_statistics is a sequence of names, e.g. ("exp_avg_sq",)')
        self.config = DecentralizedConfig(
            prefix=prefix,
            average_parameters=bool(average_parameters),
            average_gradients=bool(average_gradients),
            average_opt_statistics=tuple(average_opt_statistics),
            max_allowed_epoch_difference=int(max_allowed_epoch_difference),
            total_steps_in_epoch=int(total_steps_in_epoch),
            averaging_steps_period=int(averaging_steps_period),
            averaging_time_period=float(averaging_time_period),
            report_progress_expiration=float(report_progress_expiration),
            timeout=timeout,
            verbose=bool(verbose),
        )
        self.opt = opt
        self.node = node
        self.params: list[torch.Tensor] = [p for g in opt.param_groups for p in g["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        if self.config.average_opt_statistics:
            initialize_optimizer_state(self.opt)
        # copies, not the parameters themselves (peer.optim.decentralized.averaged_copies)
        self.copies = AveragedCopies(
            self.params,
            self.opt,
            parameters=self.config.average_parameters,
            gradients=self.config.average_gradients,
            statistics=self.config.average_opt_statistics,
        )
        self.averager = StateSharingAverager(
            self.copies.tensors,
            node,
            self._current_state,
            start=True,
            prefix=prefix,
            target_group_size=target_group_size,
            # rounds run in the background while step() updates the tensors
            concurrent_updates=True,
            **averager_kwargs,
        )
        self.scheduler = scheduler_cls(opt) if scheduler_cls is not None else None
        self.tracker = ProgressTracker(
            node, prefix, total_steps_in_epoch, expiration=report_progress_expiration
        )
        self._stop = threading.Event()
        self.catch_up = CatchUp(
            CatchUpHost(
                local_epoch=lambda: self.local_epoch,
                settle=lambda: None,  # background rounds keep running: they add their change
                report=self._local_report,
                adopt=self._adopt_state,
                move_to=self._move_to_epoch,
            ),
            node=node,
            tracker=self.tracker,
            averager=self.averager,
            # one attempt per call (step() calls again while behind); averaging pulls a peer
            # that went on with its own parameters towards the others
            policy=CatchUpPolicy(
                timeout=self.config.timeout,
                retry=False,
                on_timeout="move_on",
                discount_s=DISCOUNT_S,
            ),
            closing=self._stop,
        )
        self.performance = PerformanceEMA()
        self.local_epoch = 0
        self.local_step = 0  # steps taken by this peer, all epochs
        self.steps_at_epoch = 0  # steps taken by this peer at local_epoch
        self.last_progress: SwarmProgress | None = None
        self._shut = False
        self._report()
        self.rounds = AveragingThread(
            self.averager,
            name=f"swarmgrad-avg-{prefix}",
            period=self.config.averaging_time_period,
            timeout=self.config.timeout,
            gather=lambda: {"epoch": self.local_epoch},
            verbose=self.config.verbose,
        )
        self.rounds.start()

    # ------------------------------------------------------------------------ step

    def step(  # type: ignore[override]  # None when behind, even with a closure
        self, closure: Callable[[], float] | None = None, *, batch_size: int | None = None
    ) -> float | None:
        """One local step, unless this peer is too far behind the swarm (then it loads the
        state from peers and returns None without stepping).

        ``closure`` is passed to the wrapped optimizer and runs with the parameter lock held.
        ``batch_size`` (samples in this step) feeds the samples/s figure in progress reports.
        """
        if self._shut:
            raise RuntimeError("this optimizer was shut down")
        reports = self.tracker.fetch()
        progress = self._swarm_progress(reports)
        if progress.epochs_behind > self.config.max_allowed_epoch_difference:
            logger.info(
                "epoch %d is %d behind the swarm's %d: loading state from peers",
                self.local_epoch,
                progress.epochs_behind,
                progress.epoch,
            )
            self.performance.pause()
            self.load_state_from_peers(fallback_epoch=progress.epoch)
            return None
        self._advance_to(progress.target_epoch)
        with self.averager.get_tensors():
            self.copies.apply_gradient_correction()
            loss = self.opt.step(closure) if closure is not None else self.opt.step()
            self.copies.exchange_parameters()
        self.local_step += 1
        self.steps_at_epoch += 1
        if batch_size is not None:
            self.performance.update(batch_size)
        progress = self._swarm_progress(reports)
        self._advance_to(progress.target_epoch)
        self.last_progress = self._swarm_progress(reports)
        self._report()
        if self.local_step % self.config.averaging_steps_period == 0:
            self.rounds.request()
        if self.config.verbose:
            logger.info("step %d, epoch %d: %s", self.local_step, self.local_epoch, progress)
        return loss

    def is_synchronized(self) -> bool:
        """True while this peer is at most ``max_allowed_epoch_difference`` epochs behind the
        swarm (hivemind's name): otherwise the next :meth:`step` loads the state instead."""
        progress = self._swarm_progress(self.tracker.fetch())
        return progress.epochs_behind <= self.config.max_allowed_epoch_difference

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients and apply a finished round's result to the parameters (a safe
        point: call it between a ``step()`` and the next forward pass, as usual)."""
        with self.averager.get_tensors():
            self.copies.exchange_parameters()
        self.opt.zero_grad(set_to_none=set_to_none)

    # torch's Optimizer has these three as attributes; here they are the wrapped optimizer's
    @property
    def param_groups(self) -> list[StateDict]:  # type: ignore[override]
        return self.opt.param_groups

    @property
    def state(self) -> defaultdict[torch.Tensor, StateDict]:  # type: ignore[override]
        return self.opt.state

    @property
    def defaults(self) -> StateDict:  # type: ignore[override]
        return self.opt.defaults

    def add_param_group(self, param_group: StateDict) -> None:
        """Refused, as by hivemind's optimizers: the averaged tensors are fixed when the
        optimizer is built; give every parameter group then."""
        raise ValueError(
            f"{type(self).__name__} does not take parameter groups after construction "
            "(it averages the tensors it was built with): give every group to the wrapped "
            "optimizer before wrapping it"
        )

    def state_dict(self) -> StateDict:
        """The wrapped optimizer's ``state_dict()``, the scheduler's and this peer's epoch and
        steps (for :meth:`load_state_dict`, e.g. from a checkpoint)."""
        with self.averager.get_tensors():
            return {
                "optimizer": self.opt.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "local_epoch": self.local_epoch,
                "local_step": self.local_step,
                "steps_at_epoch": self.steps_at_epoch,
            }

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore what :meth:`state_dict` returned; the statistics the rounds average are
        copied into the tensors the averager holds (torch's own ``load_state_dict`` would
        replace them). ``ValueError`` for a state of another optimizer or shape."""
        if not isinstance(state_dict, Mapping) or "optimizer" not in state_dict:
            raise ValueError(
                f"not a state_dict() of {type(self).__name__}: no 'optimizer' entry (a torch "
                "optimizer's own state_dict goes to .opt.load_state_dict before wrapping)"
            )
        names = self.config.average_opt_statistics
        with self.averager.get_tensors(), torch.no_grad():
            held = {(i, n): self.opt.state[p][n] for i, p in enumerate(self.params) for n in names}
            self.opt.load_state_dict(state_dict["optimizer"])
            for (i, name), tensor in held.items():
                state = self.opt.state[self.params[i]]
                loaded = state.get(name)
                if not isinstance(loaded, torch.Tensor) or loaded.shape != tensor.shape:
                    state[name] = tensor  # keep the averaged tensor the averager holds
                    raise ValueError(
                        f"the loaded state has no {name!r} of shape {tuple(tensor.shape)} "
                        f"for parameter {i}"
                    )
                tensor.copy_(loaded.to(tensor.dtype))
                state[name] = tensor
            if self.scheduler is not None and state_dict.get("scheduler") is not None:
                self.scheduler.load_state_dict(state_dict["scheduler"])
            self.local_epoch = int(state_dict.get("local_epoch", self.local_epoch))
            self.local_step = int(state_dict.get("local_step", self.local_step))
            self.steps_at_epoch = int(state_dict.get("steps_at_epoch", 0))
        if self.averager.allow_state_sharing:
            self.averager.state_sharing_priority = float(self.local_epoch)
        self._report()

    def _local_report(self) -> ProgressReport:
        return ProgressReport(
            peer_id=self.tracker.peer_id,
            epoch=self.local_epoch,
            done_at_epoch=self.steps_at_epoch,
            done_in_total=self.local_step,
            time=float(self.node.get_time()),
            samples_per_second=self.performance.samples_per_second,
            client_mode=self.averager.config.client_mode,
        )

    def _swarm_progress(self, reports: Iterable[ProgressReport]) -> SwarmProgress:
        return self.tracker.progress(self._local_report(), reports)

    def _report(self) -> None:
        self.tracker.report(self._local_report())

    def _advance_to(self, epoch: int) -> None:
        """Move to ``epoch`` (no-op if not ahead): step the scheduler once per epoch passed
        and tell state downloaders that this peer now holds fresher state."""
        if epoch <= self.local_epoch:
            return
        passed = epoch - self.local_epoch
        self.local_epoch, self.steps_at_epoch = epoch, 0
        self._step_scheduler(passed)
        if self.averager.allow_state_sharing:
            self.averager.state_sharing_priority = float(epoch)
        if self.config.verbose:
            logger.info("swarm epoch %d", epoch)

    def _step_scheduler(self, times: int) -> None:
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            # epochs can pass before this peer's first optimizer step (a newcomer catching
            # up): that is the intended order here, not the mistake torch warns about
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            for _ in range(times):
                self.scheduler.step()

    # ----------------------------------------------------------- background rounds

    @property
    def averaging_rounds(self) -> int:
        """Background rounds that finished (tensors averaged)."""
        return self.rounds.rounds_done

    @property
    def failed_rounds(self) -> int:
        return self.rounds.rounds_failed

    @property
    def last_group(self) -> tuple[str, ...]:
        """The peer ids of the last successful round."""
        return self.rounds.last_group

    def average_now(self) -> None:
        """Ask the background thread for a round now (e.g. after the last step)."""
        self.rounds.request()

    def wait_for_rounds(self, count: int, timeout: float | None = None) -> bool:
        """Wait until ``averaging_rounds >= count``; False on timeout."""
        return self.rounds.wait_for(count, timeout)

    # ------------------------------------------------------------------ state

    def _current_state(self) -> tuple[StateDict, list[torch.Tensor]]:
        """Parameters and the whole optimizer state, for a newcomer. Called by the averager
        on the node's loop with the lock held (so nothing here changes meanwhile)."""
        return pack_state(self.params, self.opt, epoch=self.local_epoch, step=self.local_step)

    def load_state_from_peers(
        self, timeout: float | None = None, *, fallback_epoch: int | None = None
    ) -> bool:
        """Download parameters, optimizer state and epoch from the peer with the freshest
        state; True if one was loaded. With ``fallback_epoch`` (this peer is behind the
        swarm), a peer that got no state goes on from its own parameters at the swarm's
        epoch (training goes on and averaging pulls it towards the swarm) — unless no donor
        even offers a state newer than this peer's: then the epochs claimed ahead are backed
        by nothing, and the claimers are discounted instead. The policy is
        :mod:`peer.optim.shared.catchup`'s; ``timeout`` (default: the optimizer's) bounds the
        download."""
        loaded = self.catch_up.run(chase=fallback_epoch is not None, timeout=timeout)
        if not loaded:
            logger.warning("could not load state from peers; continuing with local state")
        return loaded

    #: hivemind's older name (its DecentralizedOptimizer's), for scripts ported from it
    load_states_from_peers = load_state_from_peers

    def _adopt_state(self, epoch: int, metadata: object, tensors: Sequence[torch.Tensor]) -> None:
        """A downloaded state replaces this peer's parameters and optimizer state, and it
        moves to the state's ``epoch``; ``ValueError`` if it does not fit (nothing changed)."""
        layout = check_state(self.params, epoch, metadata, tensors)
        with self.averager.get_tensors(), torch.no_grad():
            load_state(self.params, self.opt, layout, tensors)
            self.copies.restart_from_parameters()
        self._move_to_epoch(epoch)

    def _move_to_epoch(self, epoch: int) -> None:
        self._advance_to(epoch)
        self._report()

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop the background thread (cancelling a round in progress), the averager and
        progress reports. Idempotent; does not shut the node down."""
        if self._shut:
            return
        self._shut = True
        self._stop.set()
        self.rounds.stop()
        self.averager.shutdown()  # cancels a round already streaming
        self.rounds.join(self.averager.config.shutdown_timeout + 1.0)
        self.tracker.shutdown()

    def __enter__(self) -> DecentralizedOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(prefix={self.config.prefix!r}, "
            f"epoch={self.local_epoch}, step={self.local_step})"
        )


class DecentralizedSGD(DecentralizedOptimizer):
    """``torch.optim.SGD`` with parameters averaged in the background after every step
    (``averaging_steps_period=1`` unless given). Other keyword arguments: see
    :class:`DecentralizedOptimizer`."""

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        *,
        node: SwarmNode,
        prefix: str,
        target_group_size: int | None,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        average_parameters: bool = True,
        average_gradients: bool = False,
        **kwargs: Unpack[SGDWrapperOptions],
    ) -> None:
        opt = torch.optim.SGD(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(
            opt,
            node,
            prefix=prefix,
            target_group_size=target_group_size,
            average_parameters=average_parameters,
            average_gradients=average_gradients,
            **kwargs,
        )


class DecentralizedAdam(DecentralizedOptimizer):
    """``torch.optim.Adam`` with parameters and the second moment (``exp_avg_sq``, or
    ``max_exp_avg_sq`` with ``amsgrad``) averaged in the background every
    ``averaging_steps_period`` steps. Other keyword arguments: see
    :class:`DecentralizedOptimizer`."""

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        *,
        node: SwarmNode,
        prefix: str,
        target_group_size: int | None,
        averaging_steps_period: int,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        average_parameters: bool = True,
        average_gradients: bool = False,
        **kwargs: Unpack[WrapperOptions],
    ) -> None:
        opt = torch.optim.Adam(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad
        )
        stat = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"
        super().__init__(
            opt,
            node,
            prefix=prefix,
            target_group_size=target_group_size,
            average_parameters=average_parameters,
            average_gradients=average_gradients,
            averaging_steps_period=averaging_steps_period,
            average_opt_statistics=(stat,),
            **kwargs,
        )
