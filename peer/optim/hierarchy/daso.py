"""``DASO`` and ``DataParallelOptimizer``: data parallelism across a machine and the swarm.

:class:`DASO` has the signature and semantics of Heat's ``heat.optim.dp_optimizer.DASO``
(Distributed Asynchronous and Selective Optimization), with the global level moved from MPI
to Swarmgrad's peer-to-peer averaging: the *local* level is the machine's
``torch.distributed`` group, the *global* level the swarm (see the class for both, and for
what differs from the original). :class:`DataParallelOptimizer` is Heat's one-level
counterpart. The schedule is :mod:`peer.optim.hierarchy.daso_schedule`, the levels
:mod:`peer.optim.hierarchy.levels`.
"""

from __future__ import annotations

import logging
from typing import IO, TypedDict, Unpack

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from peer.averaging.control import StepControl
from peer.optim.averager_options import AveragerOptions
from peer.optim.hierarchy.daso_schedule import LocalSync, Plateau, SkipSchedule, plan_batch
from peer.optim.hierarchy.levels import LocalWorld, SwarmLevel, flatten_into, unflatten_from
from peer.optim.seam import SwarmNode

logger = logging.getLogger("peer.optim.daso")

__all__ = ["DASO", "DataParallelOptimizer"]

_DOWNCAST_TYPES = (torch.bfloat16, torch.half, torch.float)


class _PrintOptions(TypedDict, total=False):
    """``print``'s keyword arguments."""

    sep: str | None
    end: str | None
    file: IO[str] | None
    flush: bool


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, currently {type(value)}")


class DASO:
    """Two-level data parallelism with asynchronous, selective global synchronisation.

    Use as Heat's: build it around the local optimizer, ``set_model(model)``, set
    ``last_batch`` to the index of each epoch's last batch (``len(loader) - 1``), call
    ``step()`` after every backward pass and ``epoch_loss_logic(loss)`` after every epoch.

    The *local* level is ``comm`` (default the whole world, or this process alone): its
    gradients are synchronised every ``local_skip`` batches, by ``DistributedDataParallel``
    when the model is one, by an all-reduce before the local step otherwise. The *global*
    level is the swarm: every ``global_skip`` batches the machine's leader (local rank 0,
    which holds the ``node``) casts the parameters to ``downcast_type``, sends them in chunks
    of at most ``sending_chunk_size`` elements, and training goes on; the average is applied
    ``batches_to_wait`` batches later, merged as the original does —
    ``(2·w·local + n·average) / (n + 2·w)`` for ``n`` machines and ``w`` batches waited —
    then broadcast to the local ranks. On an epoch's last batch, and in warm-up and
    cool-down, the global sync blocks and the average replaces the parameters.

    What the swarm changes: machines join and leave (a round that finds no group in
    ``averaging_timeout`` is skipped, counted in :attr:`global_rounds_skipped`); machines
    may have different process counts (each weighted by its count), so the leader always
    sends; ``use_mpi_groups`` has no effect; ``scheduler`` is an LR scheduler *instance*,
    stepped after every local optimizer step.

    Swarm options (keyword-only): ``node`` (the :class:`peer.Node`, on the local rank 0;
    without it the global level is the local world alone), ``prefix`` (the key shared by
    the swarm's averagers), ``target_group_size`` (machines per global round; ``None``:
    everyone online), ``matchmaking_time``, ``averaging_timeout`` and ``averager_opts`` (for
    the :class:`~peer.averaging.DecentralizedAverager`).
    """

    def __init__(
        self,
        local_optimizer: torch.optim.Optimizer,
        total_epochs: int,
        comm: dist.ProcessGroup | None = None,
        warmup_epochs: int = 4,
        cooldown_epochs: int = 4,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        stability_level: float = 0.05,
        max_global_skips: int = 8,
        sending_chunk_size: int = 10_000_000,
        downcast_type: torch.dtype = torch.bfloat16,
        use_mpi_groups: bool = True,
        skip_reduction_factor: int = 2,
        local_skip_factor: int = 4,
        verbose: bool = False,
        *,
        node: SwarmNode | None = None,
        prefix: str = "daso",
        target_group_size: int | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        averager_opts: AveragerOptions | None = None,
    ) -> None:
        if not isinstance(local_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Local optimizer must be a torch optimizer object, currently {type(local_optimizer)}"
            )
        if comm is not None and not isinstance(comm, dist.ProcessGroup):
            raise TypeError(
                f"comm must be a torch.distributed ProcessGroup or None, currently {type(comm)}"
            )
        for name, value in (
            ("total_epochs", total_epochs),
            ("warmup_epochs", warmup_epochs),
            ("cooldown_epochs", cooldown_epochs),
            ("max_global_skips", max_global_skips),
            ("sending_chunk_size", sending_chunk_size),
            ("skip_reduction_factor", skip_reduction_factor),
            ("local_skip_factor", local_skip_factor),
        ):
            _check_int(name, value)
        if scheduler is not None and not isinstance(
            scheduler, torch.optim.lr_scheduler.LRScheduler
        ):
            raise TypeError(
                f"scheduler must be a torch learning rate scheduler, currently {scheduler}"
            )
        if not isinstance(stability_level, float):
            raise TypeError(f"stability_level must be a float, currently {type(stability_level)}")
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool, currently {type(verbose)}")
        if not isinstance(use_mpi_groups, bool):
            raise TypeError(f"use_mpi_groups must be a bool, currently {type(use_mpi_groups)}")
        if not isinstance(downcast_type, torch.dtype):
            raise TypeError(f"downcast_type must be a torch.dtype, currently {downcast_type}")
        if downcast_type not in _DOWNCAST_TYPES:
            raise ValueError(
                "downcast_type must be one of [torch.bfloat16, torch.half, torch.float], "
                f"currently {downcast_type}"
            )
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, currently {warmup_epochs}")
        if cooldown_epochs < 0:
            raise ValueError(f"cooldown_epochs must be >= 0, currently {cooldown_epochs}")
        if max_global_skips < 0:
            raise ValueError(f"max_global_skips must be >= 0, currently {max_global_skips}")
        if sending_chunk_size <= 0:
            raise ValueError(f"sending_chunk_size must be > 0, currently {sending_chunk_size}")
        if total_epochs <= 0:
            raise ValueError(f"total_epochs must be > 0, currently {total_epochs}")
        if skip_reduction_factor <= 0:
            raise ValueError(
                f"skip_reduction_factor must be > 0, currently {skip_reduction_factor}"
            )
        if local_skip_factor <= 0:
            raise ValueError(f"local_skip_factor must be > 0, currently {local_skip_factor}")

        self.local_optimizer = local_optimizer
        self.scheduler = scheduler
        self.verbose = verbose
        self.cast_dtype = downcast_type
        self.split_val = sending_chunk_size
        self.local = LocalWorld(comm)
        self.comm = self.local.group
        self.schedule = SkipSchedule(
            total_epochs=total_epochs,
            warmup_epochs=warmup_epochs,
            cooldown_epochs=cooldown_epochs,
            stability_level=stability_level,
            max_global_skips=max_global_skips,
            skip_reduction_factor=skip_reduction_factor,
            local_skip_factor=local_skip_factor,
        )
        self.module: torch.nn.Module | None = None
        self.current_batch = 0
        self.last_batch: int | None = None
        self.epoch = 0
        self.amp = False
        self.scaler: torch.amp.GradScaler | None = None
        self.node = node if self.local.is_leader else None
        self._global: SwarmLevel | None = None
        self._loss_level: SwarmLevel | None = None
        if self.node is not None:
            self._global = SwarmLevel(
                self.node,
                f"{prefix}.params",
                target_group_size,
                matchmaking_time=matchmaking_time,
                averaging_timeout=averaging_timeout,
                weight=self.local.size,
                dtype=downcast_type,
                chunk_numel=sending_chunk_size,
                averager_opts=averager_opts,
            )
            self._loss_level = SwarmLevel(
                self.node,
                f"{prefix}.loss",
                None,
                matchmaking_time=matchmaking_time,
                averaging_timeout=averaging_timeout,
                weight=self.local.size,
                averager_opts=averager_opts,
            )
        # the global round in flight: its control and the batches it waits
        self._pending: tuple[StepControl, int] | None = None
        self._local_sync = True  # synchronise the next backward's gradients locally
        self.global_rounds_done = 0
        self.global_rounds_skipped = 0
        self.print0("Finished DASO init")

    # ------------------------------------------------------------ the original's API

    @property
    def global_skip(self) -> int:
        return self.schedule.global_skip

    @global_skip.setter
    def global_skip(self, value: int) -> None:
        self.schedule.global_skip = value

    @property
    def local_skip(self) -> int:
        return self.schedule.local_skip

    @local_skip.setter
    def local_skip(self, value: int) -> None:
        self.schedule.local_skip = value

    @property
    def batches_to_wait(self) -> int:
        return self.schedule.batches_to_wait

    @batches_to_wait.setter
    def batches_to_wait(self, value: int) -> None:
        self.schedule.batches_to_wait = value

    @property
    def stability(self) -> Plateau:
        return self.schedule.plateau

    def add_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Use ``scaler`` (a ``torch.amp.GradScaler``) for the local steps."""
        self.scaler = scaler
        self.amp = True

    def set_model(self, model: torch.nn.Module) -> None:
        """The local model whose parameters are synchronised (a ``DistributedDataParallel``
        module lets DDP do the local gradient synchronisation)."""
        self.module = model

    def print0(self, *args: object, **kwargs: Unpack[_PrintOptions]) -> None:
        """Print on the local rank 0 when ``verbose``."""
        if self.verbose and self.local.is_leader:
            print(*args, **kwargs)

    def zero_grad(self) -> None:
        """Reset the local optimizer's gradients to zero (they stay allocated)."""
        self.local_optimizer.zero_grad(set_to_none=False)

    def reset(self) -> None:
        """Back to the state of a new optimizer: schedule, counters, no round in flight."""
        self.schedule.reset()
        self.current_batch = 0
        self.epoch = 0
        if self._pending is not None:
            self._pending[0].cancel()
            self._pending = None
        self.zero_grad()

    @torch.no_grad()
    def epoch_loss_logic(
        self, loss: torch.Tensor | float, loss_globally_averaged: bool = False
    ) -> None:
        """Set the next epoch's skips from this epoch's training loss (call after every
        epoch). Unless ``loss_globally_averaged``, the loss is averaged over the local world
        and, by the leader, over the swarm (a blocking round; its own loss if none forms)."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if not loss_globally_averaged:
            value = self.local.mean(value)
            if self._loss_level is not None:
                shared = torch.tensor([value], dtype=torch.float32)
                if self._loss_level.average_(shared):
                    value = float(shared)
            value = self.local.share(value)
        phase = self.schedule.after_epoch(self.epoch, value)
        self.print0(
            f"{phase.value} phase, parameters of next epoch: global skips {self.global_skip}, "
            f"local skips {self.local_skip}, batches to wait {self.batches_to_wait}; "
            f"loss {value:.4f}"
        )

    def step(self) -> None:
        """The local optimizer step, then this batch's part of the schedule: a global sync
        every ``global_skip`` batches (and on the last batch), the pending global average
        applied ``batches_to_wait`` batches after it was sent, and local synchronisation
        switched on or off for the next batch."""
        if self.last_batch is None:
            raise ValueError(
                "self.last_batch must be set as the index of the epoch's last batch "
                "(len(dataloader) - 1)"
            )
        if self._local_sync and not self._is_ddp():
            self._average_local_gradients()
        if self.amp:
            if self.scaler is None:
                raise ValueError("amp is on but there is no scaler: call add_scaler(scaler)")
            self.scaler.step(self.local_optimizer)
            self.scaler.update()
        else:
            self.local_optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        plan = plan_batch(
            self.current_batch,
            self.last_batch,
            self.global_skip,
            self.local_skip,
            self.batches_to_wait,
        )
        if plan.global_sync:
            self._global_sync(plan.batches_to_wait)
            return
        if plan.receive:
            self._receive_pending()
            self._local_update()
        if plan.local is LocalSync.START:
            self._set_local_sync(True)
        elif plan.local is LocalSync.STOP:
            self._set_local_sync(False)
        self.current_batch += 1

    # ------------------------------------------------------------------- internals

    def _params(self) -> list[torch.Tensor]:
        if self.module is not None:
            return [p for p in self.module.parameters() if p.requires_grad]
        return [
            p for g in self.local_optimizer.param_groups for p in g["params"] if p.requires_grad
        ]

    def _is_ddp(self) -> bool:
        return isinstance(self.module, torch.nn.parallel.DistributedDataParallel)

    def _set_local_sync(self, on: bool) -> None:
        self._local_sync = on
        if isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            self.module.require_backward_grad_sync = on

    @torch.no_grad()
    def _average_local_gradients(self) -> None:
        if self.local.size <= 1:
            return
        grads = [p.grad for p in self._params() if p.grad is not None]
        if not grads:
            return
        flat = torch.empty(
            sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device
        )
        flatten_into(flat, grads)
        self.local.average_(flat)
        unflatten_from(flat, grads)

    def _flat_params(
        self, dtype: torch.dtype | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        params = self._params()
        flat = torch.empty(
            sum(p.numel() for p in params),
            dtype=dtype or params[0].dtype,
            device="cpu" if dtype is not None else params[0].device,
        )
        flatten_into(flat, params)
        return params, flat

    @torch.no_grad()
    def _global_sync(self, batches_to_wait: int) -> None:
        staged = None
        if self._global is not None:
            _, staged = self._flat_params(self.cast_dtype)
            if not torch.isfinite(staged).all():
                raise ValueError("non-finite parameters: DASO will not send them to the swarm")
        if self.batches_to_wait != 0:
            self._receive_pending()
            self._local_update()  # a collective: every local rank decides alike
        else:
            self._receive_pending()  # none is pending unless the schedule just changed
        if staged is not None:
            assert self._global is not None
            self._pending = (self._global.begin(staged), batches_to_wait)
        last = self.current_batch == self.last_batch
        if last or self.batches_to_wait == 0:
            self._receive_pending(replace=True)
            self._local_update()
            if last:
                self.epoch += 1
                self.current_batch = 0
                return
        self.current_batch += 1

    @torch.no_grad()
    def _receive_pending(self, replace: bool = False) -> None:
        """Apply the round in flight (leader only): replace the parameters by its average,
        or merge it with them as the original does."""
        if self._pending is None:
            return
        control, waited = self._pending
        self._pending = None
        assert self._global is not None and self._global.buffer is not None  # (a round began)
        average = torch.empty(self._global.buffer.numel(), dtype=self.cast_dtype)
        n = self._global.finish(control, out=average)
        if n == 0:
            self.global_rounds_skipped += 1
            return
        self.global_rounds_done += 1
        params, flat = self._flat_params()
        received = average.to(flat.device, flat.dtype)
        if replace:
            flat.copy_(received)
        else:
            numer = 2.0 * waited if waited > 0 else 1.0
            flat.mul_(numer).add_(received, alpha=float(n)).div_(n + numer)
        unflatten_from(flat, params)

    @torch.no_grad()
    def _local_update(self) -> None:
        """Give every local rank the leader's parameters."""
        if self.local.size <= 1:
            return
        params, flat = self._flat_params()
        self.local.broadcast_(flat)
        unflatten_from(flat, params)

    def shutdown(self) -> None:
        """Stop the swarm averagers (the node stays up)."""
        for level in (self._global, self._loss_level):
            if level is not None:
                level.shutdown()


class DataParallelOptimizer:
    """Heat's ``DataParallelOptimizer``: one level of data parallelism around
    ``torch_optimizer``. The gradients are averaged over the local world (``comm``) or,
    with a ``node``, over the swarm; ``blocking=True`` steps at once, ``blocking=False``
    starts the averaging at :meth:`step` and applies it at the model's next forward pass
    (call :meth:`set_model`), so that the round overlaps the data loading."""

    def __init__(
        self,
        torch_optimizer: torch.optim.Optimizer,
        blocking: bool = False,
        *,
        comm: dist.ProcessGroup | None = None,
        node: SwarmNode | None = None,
        prefix: str = "data-parallel",
        target_group_size: int | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        averager_opts: AveragerOptions | None = None,
    ) -> None:
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking parameter must be a boolean, currently {type(blocking)}")
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"torch_optimizer must be a torch optimizer object, currently {type(torch_optimizer)}"
            )
        self.torch_optimizer = torch_optimizer
        self.blocking_parameter_updates = blocking
        self.update_next = False
        self.local = LocalWorld(comm)
        self._swarm = (
            SwarmLevel(
                node,
                prefix,
                target_group_size,
                matchmaking_time=matchmaking_time,
                averaging_timeout=averaging_timeout,
                weight=self.local.size,
                averager_opts=averager_opts,
            )
            if node is not None and self.local.is_leader
            else None
        )
        self._grads: list[torch.Tensor] = []
        self._flat: torch.Tensor | None = None
        self._control: StepControl | None = None
        self._hook: RemovableHandle | None = None

    def set_model(self, model: torch.nn.Module) -> None:
        """Apply a non-blocking update just before ``model``'s next forward pass."""
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_pre_hook(lambda *_: self._apply_pending())

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients and step (now if blocking, else at the next forward)."""
        self._apply_pending()
        params = [p for g in self.torch_optimizer.param_groups for p in g["params"]]
        self._grads = [p.grad for p in params if p.grad is not None]
        if not self._grads:
            return
        self._flat = torch.empty(
            sum(g.numel() for g in self._grads),
            dtype=self._grads[0].dtype,
            device=self._grads[0].device,
        )
        flatten_into(self._flat, self._grads)
        self.local.average_(self._flat)
        if self._swarm is not None:
            self._control = self._swarm.begin(self._flat.to("cpu", torch.float32))
        self.update_next = True
        if self.blocking_parameter_updates:
            self._apply_pending(zero=False)

    @torch.no_grad()
    def _apply_pending(self, zero: bool = True) -> None:
        if not self.update_next:
            return
        self.update_next = False
        assert self._flat is not None
        if self._swarm is not None and self._control is not None:
            host = self._flat.to("cpu", torch.float32)
            self._swarm.finish(self._control, out=host)
            self._control = None
            self._flat.copy_(host)
        self.local.broadcast_(self._flat)
        unflatten_from(self._flat, self._grads)
        self.torch_optimizer.step()
        if zero:
            # the caller already zeroed the gradients for this pass: keep them zero
            self.torch_optimizer.zero_grad(set_to_none=False)

    def zero_grad(self) -> None:
        """Reset the gradients to zero (they stay allocated)."""
        self.torch_optimizer.zero_grad(set_to_none=False)

    def shutdown(self) -> None:
        if self._swarm is not None:
            self._swarm.shutdown()
