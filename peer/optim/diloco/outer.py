"""``peer.DiLoCo``: many local steps, then one outer step on the swarm's mean pseudo-gradient.

DiLoCo (Douillard et al., arXiv:2311.08105): each peer takes ``inner_steps`` (H) steps of
its *inner* optimizer on its own data; then the peers average their *pseudo-gradients*
(the parameters at the round's start minus the parameters now, weighted by the samples
behind them) and each applies its *outer* optimizer (default SGD, lr 0.7, Nesterov
momentum 0.9) to the round's starting parameters with that average as the gradient. Every
peer ends the round with the same outer parameters; the inner optimizer's state stays
local. With one group of every peer and no compression, the outer step is exactly the one
a single process would take on the weighted mean pseudo-gradient.

See :class:`DiLoCo` for the loop and the options (streamed fragments, overlap,
compression) and for how it copes with peers joining, leaving and failing; the schedule is
:mod:`peer.optim.diloco.sync_schedule`, one sync's round :mod:`peer.optim.diloco.sync`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch.optim.optimizer import ParamsT

from peer.averaging.allreduce.partition import zeros_back_to_back
from peer.averaging.allreduce.robust import check_aggregator
from peer.averaging.averager import DecentralizedAverager
from peer.compression import Compression, NoCompression, compression_from_name
from peer.formats.open_types import StateDict
from peer.optim.averager_options import RoundOptions, SharedAveragerOptions
from peer.optim.buffers import ModelBuffers
from peer.optim.diloco.error_feedback import ErrorFeedback
from peer.optim.diloco.sync import SyncRounds, SyncRun
from peer.optim.diloco.sync_schedule import (
    RoundTimer,
    fragment_of,
    split_fragments,
    steps_before_sync,
)
from peer.optim.seam import SwarmNode
from peer.optim.shared.live_catchup import LiveCatchUp
from peer.optim.shared.live_state import LiveState, OptimizerFactory
from peer.optim.shared.optimizer_state import SharedLiveState
from peer.optim.shared.pending import Pending
from peer.optim.shared.progress import PerformanceEMA, ProgressTracker

logger = logging.getLogger("peer.optim.diloco")

__all__ = ["DiLoCo"]


# How often step() compares this peer's sync with the swarm's (a peer left behind, e.g. after
# a pause, loads the outer state within this long).
SWARM_CHECK_S = 0.5

#: what a closure given to :meth:`DiLoCo.step` returns (the loss)
LossT = TypeVar("LossT")


def default_outer_optimizer(params: ParamsT) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class DiLoCo(SyncRounds, LiveCatchUp[SyncRun]):
    """DiLoCo across the swarm (see the module docstring).

    Typical loop::

        opt = DiLoCo(node=node, run_id="my-run", params=model.parameters(),
                     inner_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                     inner_steps=100, batch_size_per_step=32)
        for batch in data:
            loss(model, batch).backward()
            opt.step()        # an inner step; every H of them, an outer round
            opt.zero_grad()
        opt.shutdown()

    ``step(batch_size=...)`` (default ``batch_size_per_step``, else 1) counts the samples
    behind the step: they weigh this peer's pseudo-gradient. Other options:

    * ``matchmaking_time`` — how long a round's group assembles;
    * ``averaging_timeout`` — the first round's timeout and every round's ceiling (later
      ones follow the measured round times);
    * ``straggler_silence`` — a peer whose progress report is older than this (or four of
      this peer's step times, if longer) is presumed gone and not waited for;
    * ``load_state_timeout`` — how long a newcomer tries to download the outer state;
    * ``buffers`` — the model's buffers to share (``peer.optim.model_buffers(model)``;
      none by default): their *outer values* travel with the outer state to newcomers and
      into :meth:`synchronised_state_dict`; each round of the last fragment averages their
      change since those values (weighted like the pseudo-gradients) and adds it, so every
      peer leaves an outer round with the same buffers (integer ones rounded back);
    * ``aggregator``, ``relative_weight_bound``, ``averager_opts`` — as for
      :class:`peer.Optimizer` (``target_group_size`` in ``averager_opts``: the groups of
      the Moshpit grid that fits the run's peers, sync ``k`` along dimension ``k // F``).

    Streaming DiLoCo (arXiv:2501.18512) with ``fragments=F``: the parameters are cut into F
    fragments of whole tensors and sync ``k`` averages fragment ``k % F`` after about
    ``H / F`` inner steps, so each fragment syncs every H steps but only 1/F of the model is
    in flight at a time; :attr:`outer_step` counts syncs. ``overlap=True`` runs each sync's
    round on a background thread while inner steps go on; the outer update lands at a later
    ``step()`` (at the latest when the next sync is due) and keeps the local progress made
    meanwhile: the fragment becomes ``outer_result + (current - snapshot)``. ``compression``
    is a :class:`peer.compression.Compression` or its name (``"float16"``, ``"bfloat16"``,
    ``"int8"``, ``"int4"``); with ``error_feedback=True`` what compression loses of a
    pseudo-gradient is added to the fragment's next one.

    Elasticity and faults: the *outer state* (outer parameters and optimizer state, sync
    number) is served to newcomers, priority = the sync number; a peer joining mid-run or
    found behind downloads the newest (:mod:`peer.optim.shared.catchup`) and starts at the next
    sync. A peer that finished its inner steps waits, at most as long as those took, for
    the peers at its sync (or one behind) whose progress reports are fresh; a peer killed
    mid-round stops reporting and is not waited for. Round timeouts follow the swarm's
    measured round times (``averaging_timeout`` is the first and the ceiling). A round that
    fails while others are about changes nothing: the next ``step()`` loads their state if
    they moved on, else retries (the pseudo-gradient then includes the steps taken
    meanwhile). A peer alone in the run applies its own pseudo-gradient.

    Locking: only the training thread writes the model's parameters; the outer parameters
    and the outer optimizer's state (the *live state*) are read and written under the state
    averager's lock, which also guards the snapshot served to newcomers. A fragment's
    averaging buffer is touched only by its round, and by the training thread while no
    round of it runs.

    Call :meth:`shutdown` when done (the node is not shut down).
    """

    def __init__(
        self,
        *,
        node: SwarmNode,
        run_id: str,
        params: ParamsT,
        inner_optimizer: OptimizerFactory,
        buffers: Iterable[torch.Tensor] | None = None,
        inner_steps: int,
        outer_optimizer: OptimizerFactory = default_outer_optimizer,
        fragments: int = 1,
        compression: Compression | str = "none",
        overlap: bool = False,
        error_feedback: bool = False,
        batch_size_per_step: int | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 120.0,
        straggler_silence: float = 10.0,
        load_state_timeout: float = 600.0,
        client_mode: bool | None = None,
        aggregator: str = "mean",
        relative_weight_bound: float | None = None,
        averager_opts: SharedAveragerOptions | None = None,
        verbose: bool = False,
    ) -> None:
        if not run_id or not isinstance(run_id, str):
            raise ValueError("run_id must be a non-empty string shared by every peer of the run")
        if not isinstance(inner_steps, int) or isinstance(inner_steps, bool) or inner_steps < 1:
            raise ValueError("inner_steps must be a positive integer")
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
            raise ValueError("fragments must be a positive integer")
        if fragments > inner_steps:
            raise ValueError("fragments cannot exceed inner_steps: each sync needs an inner step")
        if batch_size_per_step is not None and batch_size_per_step <= 0:
            raise ValueError("batch_size_per_step must be positive")
        if isinstance(inner_optimizer, torch.optim.Optimizer) or not callable(inner_optimizer):
            raise TypeError("inner_optimizer must be a factory: params -> torch.optim.Optimizer")
        if isinstance(outer_optimizer, torch.optim.Optimizer) or not callable(outer_optimizer):
            raise TypeError("outer_optimizer must be a factory: params -> torch.optim.Optimizer")
        for name, value in (
            ("matchmaking_time", matchmaking_time),
            ("averaging_timeout", averaging_timeout),
            ("straggler_silence", straggler_silence),
            ("load_state_timeout", load_state_timeout),
        ):
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds")
        codec = compression_from_name(compression) if isinstance(compression, str) else compression
        if not isinstance(codec, Compression):
            raise TypeError("compression must be a peer.compression.Compression or its name")
        if client_mode is None:
            client_mode = bool(node.client_mode)

        given = list(params)
        if not given:
            raise ValueError("params is empty")
        self.params = [p for p in given if isinstance(p, torch.Tensor)]
        if len(self.params) != len(given):
            raise TypeError("params must be tensors (pass model.parameters())")
        self.inner_optimizer = inner_optimizer(self.params)
        inner_params = [p for g in self.inner_optimizer.param_groups for p in g["params"]]
        if {id(p) for p in inner_params} != {id(p) for p in self.params}:
            raise ValueError("the inner optimizer must step exactly the params given")
        # the outer parameters: host fp32 copies, stepped by the outer optimizer
        outer = [
            torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in self.params
        ]
        # the model's buffers (running statistics): their outer values travel with the outer
        # state, and each outer round of the last fragment averages their change
        self.model_buffers = ModelBuffers(buffers)
        self.live = LiveState(outer_optimizer, outer, offload=False, buffers=self.model_buffers)
        if [id(p) for p in self.live.opt_params] != [id(p) for p in outer]:
            raise ValueError(
                "the outer optimizer factory must keep the parameters it is given, in order"
            )
        self.outer_optimizer = self.live.opt
        self.outer_params: list[torch.Tensor] = self.live.opt_params

        self.node = node
        self.run_id = run_id
        self.inner_steps = inner_steps
        self.fragments = split_fragments([p.numel() for p in self.params], fragments)
        self.compression = codec
        self.overlap = bool(overlap)
        self.error_feedback = bool(error_feedback) and not isinstance(codec, NoCompression)
        self.batch_size_per_step = batch_size_per_step
        self.load_state_timeout = float(load_state_timeout)
        self.straggler_silence = float(straggler_silence)
        self.matchmaking_time = float(matchmaking_time)
        self.client_mode = client_mode
        self.verbose = verbose
        self.timer = RoundTimer(
            ceiling=float(averaging_timeout),
            floor=min(float(averaging_timeout), 2.0 * float(matchmaking_time) + 1.0),
        )

        self.local_epoch = 0  # the sync this peer works towards (= syncs done)
        self._steps = 0  # inner steps towards it
        self._samples = 0  # samples since the last sync
        self._samples_total = 0
        self._fragment_samples = [0] * len(self.fragments)
        self._phase_started = time.monotonic()  # when the inner steps towards the sync began
        self._phase_seconds: float | None = None  # how long the last ones took
        self._step_seconds = PerformanceEMA()  # inner steps per second
        self.performance = PerformanceEMA()  # samples per second
        self._pending: Pending[SyncRun] = Pending()  # the overlapped round, the round in flight
        self._retry = False  # the last round failed while others were about
        self._behind = False  # the others moved on without this peer: load their state
        self._swarm_checked_at = -math.inf  # when step() last compared with the swarm
        self.rounds_done = 0
        self.rounds_failed = 0
        # Where a step() call's time beyond the inner step goes (for utilisation figures):
        # blocked on the previous background round, and loading the swarm's state.
        self.inner_step_seconds = 0.0  # in the inner optimizer's step() (local work)
        self.round_wait_seconds = 0.0
        self.catch_up_seconds = 0.0
        self.round_seconds = 0.0  # the rounds' own time (matchmaking and all-reduce), summed
        self.straggler_wait_seconds = 0.0  # of which waiting for peers still on their way
        self.last_group_size: int | None = None
        self.last_failure: str | None = None
        self._round_mates: tuple[int, frozenset[str]] = (-1, frozenset())
        self._closed = False
        self._closing = threading.Event()

        opts: SharedAveragerOptions = {**(averager_opts or {})}
        opts.setdefault("aggregator", check_aggregator(aggregator))
        opts.setdefault("relative_weight_bound", relative_weight_bound)
        opts.setdefault("min_matchmaking_time", float(matchmaking_time))
        self._sync_in_group_bits = opts.get("target_group_size") is None
        self._feedback = (
            [ErrorFeedback(codec) for _ in self.fragments] if self.error_feedback else None
        )
        self.averagers: list[DecentralizedAverager] = []
        try:
            for f, indices in enumerate(self.fragments):
                values = [self.outer_params[i] for i in indices]
                if f == len(self.fragments) - 1:
                    values += self.model_buffers.shared
                buffers = zeros_back_to_back(values)
                self.averagers.append(
                    DecentralizedAverager(
                        buffers,
                        node,
                        start=True,
                        prefix=f"{run_id}_diloco_fragment{f}",
                        compression=codec,
                        client_mode=client_mode,
                        allow_state_sharing=False,
                        **opts,
                    )
                )
            state_opts: RoundOptions = {}
            if "declare_state_period" in opts:
                state_opts["declare_state_period"] = opts["declare_state_period"]
            if "request_timeout" in opts:
                state_opts["request_timeout"] = opts["request_timeout"]
            # the outer state, served to newcomers (the averager's lock guards it)
            self.shared = SharedLiveState(
                self.live,
                node,
                start=True,
                prefix=f"{run_id}_diloco_state",
                client_mode=client_mode,
                **state_opts,
            )
            self.state_averager = self.shared.averager
        except BaseException:
            for averager in self.averagers:
                averager.shutdown()
            raise
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"swarmgrad-diloco-{run_id}"
            )
            if self.overlap
            else None
        )
        self.tracker = ProgressTracker(node, run_id, steps_before_sync(0, inner_steps, fragments))
        self._wire_catch_up(self.load_state_timeout, round_mates=self._mates_at)
        self._report()
        self.load_state_from_peers()

    # ------------------------------------------------------------------------ state

    def _mates_at(self, epoch: int) -> frozenset[str]:
        """The peers that began sync ``epoch``'s all-reduce with this peer (its last try)."""
        sync, mates = self._round_mates
        return mates if sync == epoch else frozenset()

    def _start_epoch_at(self, epoch: int) -> None:
        """After a download (or a catch-up): the model takes the outer parameters and the
        inner steps start over towards sync ``epoch``."""
        with self.shared.lock(), torch.no_grad():
            for p, o in zip(self.params, self.outer_params, strict=True):
                p.copy_(o.to(p.device, p.dtype))
        self._steps = 0
        self._fragment_samples = [0] * len(self.fragments)
        for feedback in self._feedback or ():
            feedback.reset()
        self._phase_started = time.monotonic()
        self._samples = 0
        self.local_epoch = epoch
        self._report()

    # -------------------------------------------------------------------------- API

    @property
    def outer_step(self) -> int:
        """Syncs done (outer rounds; with ``fragments=F``, F of them cover the model once)."""
        return self.local_epoch

    @property
    def samples_total(self) -> int:
        """Samples this peer has stepped on (for bytes sent per sample: ``node.bytes_sent``)."""
        return self._samples_total

    @property
    def param_groups(self) -> list[StateDict]:
        """The inner optimizer's parameter groups (e.g. for a learning-rate scheduler)."""
        return self.inner_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradients."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(
        self, closure: Callable[[], LossT] | None = None, batch_size: int | None = None
    ) -> LossT | None:
        """One inner step on the current ``.grad``; when the next sync is due, its round
        (inline, or started in the background with ``overlap``). First applies a
        background round that landed; a peer behind the swarm loads the outer state
        instead of stepping. Returns the closure's loss, if a closure was given."""
        if self._closed:
            raise RuntimeError("this optimizer was shut down")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if batch_size is None:
            batch_size = self.batch_size_per_step or 1
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 0:
            raise ValueError("batch_size must be a non-negative integer")
        if self._pending.landed:
            self._settle_pending()
        due = self._retry or self._steps + 1 >= steps_before_sync(
            self.local_epoch, self.inner_steps, len(self.fragments)
        )
        if self._pending.run is None and (self._behind or self._swarm_ahead(now=due)):
            logger.info("sync %d is behind the swarm: loading its state", self.local_epoch)
            self._behind = self._retry = False
            started = time.monotonic()
            self.load_state_from_peers()
            self.catch_up_seconds += time.monotonic() - started
            return loss
        started = time.perf_counter()
        self.inner_optimizer.step()
        self.inner_step_seconds += time.perf_counter() - started
        self._steps += 1
        self._samples += batch_size
        self._samples_total += batch_size
        for f in range(len(self.fragments)):
            self._fragment_samples[f] += batch_size
        self._step_seconds.update(1)
        self._report(batch_size)
        if self._retry or self._steps >= steps_before_sync(
            self.local_epoch, self.inner_steps, len(self.fragments)
        ):
            self._sync()
        return loss

    def _swarm_ahead(self, *, now: bool = False) -> bool:
        """Whether the swarm reports a later sync than this peer's. Looked at before each
        sync (``now``) and otherwise at most every :data:`SWARM_CHECK_S`: reading the
        swarm's reports waits on the node's event loop, which a round in flight keeps busy,
        and an inner step should not wait on it."""
        at = time.monotonic()
        if not now and at - self._swarm_checked_at < SWARM_CHECK_S:
            return False
        self._swarm_checked_at = at
        return self.global_progress.epoch > self.local_epoch

    def state_dict(self) -> StateDict:
        """Inner and outer optimizers, outer parameters, sync number and inner steps
        towards it (after waiting for a background round)."""
        self.wait_for_pending()
        with self.shared.lock():
            return {
                "inner_optimizer": self.inner_optimizer.state_dict(),
                "outer_optimizer": self.outer_optimizer.state_dict(),
                "outer_params": [p.detach().clone() for p in self.outer_params],
                "outer_buffers": [b.clone() for b in self.model_buffers.shared],
                "sync": self.local_epoch,
                "steps": self._steps,
            }

    def synchronised_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` on the CPU with the parameters this optimizer steps at
        their outer values, each in its own dtype: the model every peer of the run agrees
        on, to checkpoint or evaluate (the model's own parameters hold this peer's inner
        steps since the last sync). The buffers given to this optimizer (e.g. batch-norm
        statistics) are at their outer values too, integer ones rounded; others are the
        model's own. Waits for no background round: call :meth:`wait_for_pending` first to
        include it. ``ValueError`` if ``model`` holds none of this optimizer's parameters."""
        where = {id(p): i for i, p in enumerate(self.params)}
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        found = 0
        with self.shared.lock(), torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=False):
                i = where.get(id(p))
                if i is not None and name in state:
                    state[name] = self.outer_params[i].to(p.dtype, copy=True)
                    found += 1
        if not found:
            raise ValueError("the model holds none of the parameters this optimizer steps")
        self._with_shared_buffers(model, state)
        return state

    def load_state_dict(self, state: StateDict) -> None:
        """Restore what :meth:`state_dict` returned; ``ValueError`` if it does not fit."""
        outer = list(state["outer_params"])
        if len(outer) != len(self.outer_params) or any(
            a.shape != b.shape for a, b in zip(outer, self.outer_params, strict=True)
        ):
            raise ValueError("the state's outer parameters do not match this model")
        # (a state saved without buffers keeps this peer's)
        buffers = list(state.get("outer_buffers", self.model_buffers.shared))
        if len(buffers) != len(self.model_buffers) or any(
            a.shape != b.shape for a, b in zip(buffers, self.model_buffers.shared, strict=True)
        ):
            raise ValueError("the state's outer buffers do not match this model")
        sync, steps = int(state["sync"]), int(state["steps"])
        if sync < 0 or steps < 0:
            raise ValueError("the state's sync and steps must be non-negative")
        self._settle_pending(cancel=True)
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        with self.shared.lock(), torch.no_grad():
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
            for p, value in zip(self.outer_params, outer, strict=True):
                p.copy_(value)
            for b, value in zip(self.model_buffers.shared, buffers, strict=True):
                b.copy_(value)
            self.model_buffers.write()
            self.live.version += 1
            self.shared.set_epoch(sync)
        self.local_epoch = sync
        self._steps = steps
        self._report()

    def _round_averagers(self) -> list[DecentralizedAverager]:
        return self.averagers

    # ------------------------------------------------------------------------ syncs

    def _sync(self) -> None:
        """Sync ``local_epoch``: its fragment's pseudo-gradient into the averager, then the
        round (here, or in the background with ``overlap``). Training thread."""
        started = time.monotonic()
        self._settle_pending()  # one round in flight at a time
        self._pending.interrupted = False  # an interrupt() calls off the sync under way only
        self.round_wait_seconds += time.monotonic() - started
        if self._behind:
            return  # (the landed round found the others gone on: the next step loads state)
        sync = self.local_epoch
        f = fragment_of(sync, len(self.fragments))
        run = SyncRun(sync, f, self._fragment_samples[f])
        now = time.monotonic()
        if not self._retry:
            self._phase_seconds = now - self._phase_started
        self._retry = False
        indices = self.fragments[f]
        with self.averagers[f].get_tensors() as buffers, torch.no_grad():
            for b, i in zip(buffers, indices, strict=False):
                b.copy_(self.outer_params[i]).sub_(self.params[i].detach().to("cpu", torch.float32))
            if self._feedback is not None:
                self._feedback[f].apply(buffers[: len(indices)])
            if len(buffers) > len(indices):
                # the model's buffers' change since the outer values: averaged, it moves them
                changes = list(buffers[len(indices) :])
                self.model_buffers.read(into=changes)
                with self.shared.lock():
                    torch._foreach_sub_(changes, self.model_buffers.shared)
        if self.overlap:
            assert self._executor is not None
            run.snapshot = [self.params[i].detach().clone() for i in indices]
            self._pending.run = run
            self._advance(sync)
            run.future = self._executor.submit(self._run_round, run)
            self._report()
        else:
            self._run_round(run)
            self._land(run)

    def _advance(self, sync: int) -> None:
        """The inner steps now count towards sync ``sync + 1``."""
        self.local_epoch = sync + 1
        self._steps = 0
        self._phase_started = time.monotonic()

    def _land(self, run: SyncRun) -> None:
        """Bring a finished round to the model: the outer step on the averaged
        pseudo-gradient, the fragment's parameters from its result. Training thread."""
        if run.cancelled or self._behind:
            return
        if run.failed:
            # nothing changes; the next step retries this sync (or loads a newer state)
            self.local_epoch = run.sync
            self._retry = True
            return
        indices = self.fragments[run.fragment]
        with self.averagers[run.fragment].get_tensors() as buffers:
            averaged = [b.clone() for b in buffers]
        with self.shared.lock(), torch.no_grad():
            if len(averaged) > len(indices):
                # the buffers' outer values move by the averaged change, and the model takes
                # them (with overlap, statistics gathered while the round ran are dropped:
                # they are running averages, refreshed by the next batches)
                torch._foreach_add_(self.model_buffers.shared, averaged[len(indices) :])
                self.model_buffers.write()
            for i, delta in zip(indices, averaged, strict=False):
                self.outer_params[i].grad = delta
            try:
                self.outer_optimizer.step()
            finally:
                for p in self.outer_params:
                    p.grad = None
            self.live.version += 1
            self.shared.set_epoch(run.sync + 1)
            for k, i in enumerate(indices):
                p = self.params[i]
                result = self.outer_params[i].to(p.device, p.dtype)
                if run.snapshot is None:
                    p.copy_(result)
                else:  # keep the local progress made while the round ran
                    p.add_(result - run.snapshot[k])
        self._fragment_samples[run.fragment] = 0
        if not self.overlap:
            self._advance(run.sync)
        self._report()

    # --------------------------------------------------------------------- progress

    def _progress(self) -> tuple[int, int, int]:
        pending = self._pending.run
        if pending is not None:
            # its round still runs: keep inviting slower peers into it
            done = steps_before_sync(pending.sync, self.inner_steps, len(self.fragments))
            return pending.sync, done, self._samples_total
        return self.local_epoch, self._steps, self._samples_total
