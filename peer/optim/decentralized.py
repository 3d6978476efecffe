"""Local steps with background averaging: ``DecentralizedOptimizer``, ``DecentralizedSGD``,
``DecentralizedAdam``.

Signatures and meanings follow hivemind's decentralized optimizers (pass a
:class:`peer.Node` where hivemind took a ``DHT``). Each peer steps its own optimizer on its
own batches; a background thread averages parameters (and/or gradients, and named optimizer
statistics) with other peers through a :class:`~peer.averaging.DecentralizedAverager`; epochs
are counted across the swarm through progress reports (:mod:`peer.optim.progress`).

Locking — one lock, the averager's (``averager.get_tensors()``):

* the averager (``concurrent_updates=True``) holds it while it copies the averaged tensors
  into its flat buffer at the start of a round and while it adds ``average - copy`` back at
  the end (see :mod:`peer.averaging.averager`); a state donor holds it while it snapshots;
* ``step()`` holds it while the wrapped optimizer updates parameters and statistics in place,
  and while a downloaded state is copied in; ``zero_grad()`` while it applies a round's
  result to the parameters (below).

So a round never reads half-updated tensors and ``step()`` waits at most for one copy or one
in-place add of the averaged tensors.

Parameters are read by the forward and backward passes, which run *outside* the lock: a
round that wrote into them mid-pass would corrupt the gradient (autograd rejects it). So
rounds average a buffer, not the parameters: after every local step (lock held) the buffer
receives a copy of the parameters, and the round's result ``average - (buffer when the round
began)`` is added to the parameters at the next safe point — the next ``step()`` or
``zero_grad()``, between two passes. Local steps taken while a round runs are kept, as in
hivemind. Optimizer statistics (``average_opt_statistics``) are only touched by the
optimizer's own step, under the lock, so rounds average them in place.

Gradient averaging (``average_gradients=True``) works the same way: the buffer receives the
latest local gradients at each ``step()``, and the round's correction (``average - local``
at the round's start) is added to ``.grad`` once, at the next ``step()`` after the round
finished (a delayed correction; exact only if gradients change slowly).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from peer.averaging.control import StepControl
from peer.averaging.exceptions import StepFailed
from peer.optim.catchup import CatchUp, CatchUpHost, CatchUpPolicy
from peer.optim.claims import DISCOUNT_S
from peer.optim.progress import (
    PerformanceEMA,
    ProgressReport,
    ProgressTracker,
    SwarmProgress,
)
from peer.optim.seam import SwarmNode
from peer.optim.state import StateSharingAverager, initialize_optimizer_state

logger = logging.getLogger("peer.optim")

__all__ = [
    "DecentralizedAdam",
    "DecentralizedConfig",
    "DecentralizedOptimizer",
    "DecentralizedSGD",
]

_SCALAR_TYPES = (int, float, bool, type(None))


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
        scheduler_cls: Callable[[torch.optim.Optimizer], Any] | None = None,
        averaging_steps_period: int = 1,
        averaging_time_period: float = 0,
        report_progress_expiration: float = 30,
        timeout: float | None = None,
        verbose: bool = False,
        **averager_kwargs: Any,
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
        tensors = self._averaged_tensors()
        self.averager = StateSharingAverager(
            tensors,
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
        self.averaging_rounds = 0  # rounds that finished (tensors averaged)
        self.failed_rounds = 0
        self.last_group: tuple[str, ...] = ()  # peer ids of the last successful round
        self.last_progress: SwarmProgress | None = None
        self._rounds_changed = threading.Condition()
        self._want_round = threading.Event()
        self._current_round: Any = None
        self._shut = False
        self._report()
        self._thread = threading.Thread(
            target=self._averaging_loop, name=f"swarmgrad-avg-{prefix}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ construction

    def _averaged_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        # buffers, not the parameters themselves: see "Locking" in the module docstring
        self._param_buffers: list[torch.Tensor] = []
        self._param_written: list[torch.Tensor] = []
        if self.config.average_parameters:
            self._param_buffers = [p.detach().clone() for p in self.params]
            self._param_written = [b.clone() for b in self._param_buffers]
            tensors += self._param_buffers
        self._grad_buffers: list[torch.Tensor] = []
        self._grad_written: list[torch.Tensor] = []
        if self.config.average_gradients:
            self._grad_buffers = [
                torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self.params
            ]
            self._grad_written = [torch.zeros_like(b) for b in self._grad_buffers]
            tensors += self._grad_buffers
        for name in self.config.average_opt_statistics:
            for p in self.params:
                value = self.opt.state[p].get(name)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"optimizer statistic {name!r} is not a tensor in the state of "
                        f"{type(self.opt).__name__} (found {type(value).__name__})"
                    )
                tensors.append(value)
        return tensors

    # ------------------------------------------------------------------------ step

    def step(
        self, closure: Callable[[], Any] | None = None, *, batch_size: int | None = None
    ) -> Any:
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
            self._apply_gradient_correction()
            loss = self.opt.step(closure) if closure is not None else self.opt.step()
            self._exchange_parameters()
        self.local_step += 1
        self.steps_at_epoch += 1
        if batch_size is not None:
            self.performance.update(batch_size)
        progress = self._swarm_progress(reports)
        self._advance_to(progress.target_epoch)
        self.last_progress = self._swarm_progress(reports)
        self._report()
        if self.local_step % self.config.averaging_steps_period == 0:
            self._want_round.set()
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
            self._exchange_parameters()
        self.opt.zero_grad(set_to_none=set_to_none)

    def _exchange_parameters(self) -> None:
        """Add what finished rounds did to the buffer since the last exchange (``buffer -
        written``: zero if no round finished) to the parameters, then put the parameters in
        the buffer for the next round. Lock held."""
        if not self._param_buffers:
            return
        params = [p.detach() for p in self.params]
        with torch.no_grad():
            # foreach: one call per operation instead of a Python loop over tensors
            torch._foreach_add_(params, self._param_buffers)
            torch._foreach_sub_(params, self._param_written)
            torch._foreach_copy_(self._param_buffers, params)
            torch._foreach_copy_(self._param_written, params)

    # torch's Optimizer has these three as attributes; here they are the wrapped optimizer's
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.opt.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.opt.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.opt.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused, as by hivemind's optimizers: the averaged tensors are fixed when the
        optimizer is built; give every parameter group then."""
        raise ValueError(
            f"{type(self).__name__} does not take parameter groups after construction "
            "(it averages the tensors it was built with): give every group to the wrapped "
            "optimizer before wrapping it"
        )

    def state_dict(self) -> dict[str, Any]:
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

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
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

    def _apply_gradient_correction(self) -> None:
        """With ``average_gradients``: add the last round's correction to ``.grad`` and put
        the latest local gradients where the next round will average them. Lock held."""
        if not self._grad_buffers:
            return
        with torch.no_grad():
            for p, buffer, written in zip(
                self.params, self._grad_buffers, self._grad_written, strict=True
            ):
                if p.grad is None:
                    continue
                correction = buffer - written  # zero unless a round finished since
                written.copy_(p.grad)
                buffer.copy_(p.grad)
                p.grad.add_(correction)

    # ----------------------------------------------------------- background rounds

    def _averaging_loop(self) -> None:
        period = self.config.averaging_time_period
        last_start = time.monotonic()
        while not self._stop.is_set():
            wait = None if period <= 0 else max(0.0, last_start + period - time.monotonic())
            self._want_round.wait(wait)
            if self._stop.is_set():
                return
            self._want_round.clear()
            last_start = time.monotonic()
            self._average_once()

    def _average_once(self) -> None:
        try:
            control = self.averager.step(
                wait=False, timeout=self.config.timeout, gather={"epoch": self.local_epoch}
            )
            assert isinstance(control, StepControl)  # wait=False always returns one
            self._current_round = control
            gathered = control.result()
        except StepFailed as exc:
            with self._rounds_changed:
                self.failed_rounds += 1
                self._rounds_changed.notify_all()
            if not self._stop.is_set():
                logger.log(
                    logging.INFO if self.config.verbose else logging.DEBUG,
                    "averaging round failed: %s",
                    exc,
                )
            return
        finally:
            self._current_round = None
        with self._rounds_changed:
            self.averaging_rounds += 1
            self.last_group = tuple(sorted(gathered))
            self._rounds_changed.notify_all()
        if self.config.verbose:
            logger.info("averaged with %d peers", len(gathered))

    def average_now(self) -> None:
        """Ask the background thread for a round now (e.g. after the last step)."""
        self._want_round.set()

    def wait_for_rounds(self, count: int, timeout: float | None = None) -> bool:
        """Wait until ``averaging_rounds >= count``; False on timeout."""
        with self._rounds_changed:
            return self._rounds_changed.wait_for(
                lambda: self.averaging_rounds >= count or self._shut, timeout
            ) and (self.averaging_rounds >= count)

    # ------------------------------------------------------------------ state

    def _current_state(self) -> tuple[Any, list[torch.Tensor]]:
        """Parameters and the whole optimizer state, for a newcomer. Called by the averager
        on the node's loop with the lock held (so nothing here changes meanwhile)."""
        tensors = [p.detach() for p in self.params]
        layout = []
        for p in self.params:
            entries = []
            for key, value in sorted(self.opt.state[p].items()):
                if isinstance(value, torch.Tensor):
                    entries.append([key, True, None])
                    tensors.append(value.detach())
                elif isinstance(value, _SCALAR_TYPES):
                    entries.append([key, False, value])
            layout.append(entries)
        metadata = {"epoch": self.local_epoch, "step": self.local_step, "state": layout}
        return metadata, tensors

    def load_state_from_peers(
        self, timeout: float | None = None, *, fallback_epoch: int | None = None
    ) -> bool:
        """Download parameters, optimizer state and epoch from the peer with the freshest
        state; True if one was loaded. With ``fallback_epoch`` (this peer is behind the
        swarm), a peer that got no state goes on from its own parameters at the swarm's
        epoch (training goes on and averaging pulls it towards the swarm) — unless no donor
        even offers a state newer than this peer's: then the epochs claimed ahead are backed
        by nothing, and the claimers are discounted instead. The policy is
        :mod:`peer.optim.catchup`'s; ``timeout`` (default: the optimizer's) bounds the
        download."""
        loaded = self.catch_up.run(chase=fallback_epoch is not None, timeout=timeout)
        if not loaded:
            logger.warning("could not load state from peers; continuing with local state")
        return loaded

    #: hivemind's older name (its DecentralizedOptimizer's), for scripts ported from it
    load_states_from_peers = load_state_from_peers

    def _adopt_state(self, epoch: int, metadata: Any, tensors: Sequence[torch.Tensor]) -> None:
        """A downloaded state replaces this peer's parameters and optimizer state, and it
        moves to the state's ``epoch``; ``ValueError`` if it does not fit (nothing changed)."""
        try:
            layout = metadata["state"]
            if len(layout) != len(self.params) or epoch < 0:
                raise ValueError("a different number of parameters")
            n_tensors = len(self.params) + sum(1 for e in layout for entry in e if entry[1])
            if len(tensors) != n_tensors:
                raise ValueError("tensor count does not match the layout")
            for p, t in zip(self.params, tensors, strict=False):
                if t.shape != p.shape:
                    raise ValueError(f"shape {tuple(t.shape)} where {tuple(p.shape)} expected")
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed state ({type(exc).__name__}: {exc})") from exc
        incoming = iter(tensors[len(self.params) :])
        with self.averager.get_tensors(), torch.no_grad():
            for p, t in zip(self.params, tensors, strict=False):
                p.copy_(t.to(p.dtype))
            for p, buffer, written in zip(
                self.params, self._param_buffers, self._param_written, strict=True
            ):
                buffer.copy_(p)  # the next round starts from the downloaded parameters
                written.copy_(p)
            for p, entries in zip(self.params, layout, strict=True):
                state = self.opt.state[p]
                for key, is_tensor, value in entries:
                    if not is_tensor:
                        state[key] = value
                        continue
                    t = next(incoming)
                    current = state.get(key)
                    if isinstance(current, torch.Tensor) and current.shape == t.shape:
                        current.copy_(t.to(current.dtype))  # in place: the averager holds it
                    else:
                        state[key] = t.clone()
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
        self._want_round.set()
        control = self._current_round
        if control is not None:
            control.cancel()
        self.averager.shutdown()  # cancels a round already streaming
        self._thread.join(timeout=self.averager.config.shutdown_timeout + 1.0)
        self.tracker.shutdown()
        with self._rounds_changed:
            self._rounds_changed.notify_all()

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
        params: Iterable[Any],
        lr: float,
        *,
        node: SwarmNode,
        prefix: str,
        target_group_size: int | None,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        **kwargs: Any,
    ) -> None:
        opt = torch.optim.SGD(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        kwargs.setdefault("average_parameters", True)
        kwargs.setdefault("average_gradients", False)
        super().__init__(opt, node, prefix=prefix, target_group_size=target_group_size, **kwargs)


class DecentralizedAdam(DecentralizedOptimizer):
    """``torch.optim.Adam`` with parameters and the second moment (``exp_avg_sq``, or
    ``max_exp_avg_sq`` with ``amsgrad``) averaged in the background every
    ``averaging_steps_period`` steps. Other keyword arguments: see
    :class:`DecentralizedOptimizer`."""

    def __init__(
        self,
        params: Iterable[Any],
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
        **kwargs: Any,
    ) -> None:
        opt = torch.optim.Adam(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad
        )
        kwargs.setdefault("average_parameters", True)
        kwargs.setdefault("average_gradients", False)
        stat = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"
        super().__init__(
            opt,
            node,
            prefix=prefix,
            target_group_size=target_group_size,
            averaging_steps_period=averaging_steps_period,
            average_opt_statistics=(stat,),
            **kwargs,
        )
