"""A volunteer's peer: join a coordinator's run with an invite token and train it.

:class:`Volunteer` is what ``swarmgrad join URL --token T`` runs::

    Volunteer(JoinOptions(url, token), on_update=show).run()  # blocks; stop() from a handler

In order, it holds ``data_dir`` (:func:`~peer.data_dir.lock_data_dir`: one key, one
process); loads the run's task (a shipped task file only with ``task_consent``,
:mod:`peer.tasks.shipped`) and checks the device before an invite's use is spent; joins
with this machine's key (:func:`~peer.coordinator.joining.join_run`: a node, reachable or
dialing out); builds the model, resumes from a live peer or the newest checkpoint, and trains
(:class:`~peer.trainer.Trainer`) with :class:`~peer.Optimizer`, or :class:`~peer.DiLoCo`
for ``algorithm: diloco``, until the run finishes or :meth:`Volunteer.stop`. A token the
coordinator stops accepting raises :class:`~peer.coordinator.Unauthorized`; everything a
volunteer can get wrong is a one-line :class:`~peer.exceptions.SwarmgradError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

from peer.data_dir import DataDirInUse, default_data_dir, load_identity, lock_data_dir
from peer.exceptions import SwarmgradError
from peer.tasks.base import BatchT
from peer.tasks.shipped import Consent
from peer.trainer import Trainer, download_checkpoint

if TYPE_CHECKING:
    from peer.coordinator.client import CoordinatorClient, JoinAnswer
    from peer.coordinator.session import CoordinatorSession
    from peer.node import Node
    from peer.optim.collaborative.optimizer import Optimizer
    from peer.optim.diloco.outer import DiLoCo
    from peer.tasks.base import Task, TrainingConfig

logger = logging.getLogger("peer.volunteer")

__all__ = [
    "DataDirInUse",
    "DeviceError",
    "JoinOptions",
    "Volunteer",
    "VolunteerStatus",
    "default_data_dir",
    "load_identity",
]


class DeviceError(SwarmgradError):
    """The device asked for is not available on this machine."""


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda was asked for, but this machine has no usable CUDA GPU")
    if device not in ("cpu", "cuda"):
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda or auto")
    return device


@dataclass(frozen=True)
class JoinOptions:
    url: str
    token: str
    task: str | None = None  # overrides the run's task
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    name: str | None = None  # display name
    host: str = "0.0.0.0"  # interface to listen on
    port: int = 0
    bulk_port: int = 0
    client_mode: bool = False
    # ask the home router (UPnP) to forward the node's ports (peer.transport.port_mapping)
    port_mapping: bool = True
    data_dir: Path = field(default_factory=default_data_dir)
    # whether to run a task file the run ships (peer.tasks.shipped): never, unless given
    task_consent: Consent = field(default_factory=Consent)
    # where to write this volunteer's final model when it finishes or leaves
    # (Trainer.save_final); None: nowhere
    save_final: Path | None = None


@dataclass(frozen=True)
class VolunteerStatus:
    """What a progress display shows; a snapshot (see :attr:`Volunteer.status`)."""

    state: str = "joining"  # joining | loading | training | paused | finished | stopped
    run_id: str | None = None
    run_name: str | None = None
    task: str | None = None
    peer_id: str | None = None
    epoch: int = 0
    samples: int = 0
    # counted over the last seconds of this machine's clock, as the dashboard counts them
    # (peer.formats.rates): this peer's samples, and the swarm's from its progress records;
    # None until there is a second of training to count over
    samples_per_second: float | None = None
    swarm_samples_per_second: float | None = None
    loss: float | None = None
    eval_metric: float | None = None
    metric_name: str | None = None
    peers_online: int = 0
    group_size: int | None = None
    # the share of the training loop's time spent computing rather than waiting on the
    # swarm (peer.optim.utilisation), and bytes this peer's node sent per sample it trained
    compute_utilisation: float | None = None
    bytes_per_sample: float | None = None
    coordinator_reachable: bool = True
    reachability: str | None = None
    # how this peer takes part (peer.coordinator.joining.path_of): public, punched,
    # relayed, dialing out or unreachable; None before it joined
    path: str | None = None
    # "no group for N rounds while K other peers are online: why; what helps"
    # (peer.optim.no_group), or None while this peer averages or is alone in the run
    no_group: str | None = None
    message: str | None = None


class StatusChanges(TypedDict, total=False):
    """Fields of a :class:`VolunteerStatus` to change (:meth:`Volunteer._update`)."""

    state: str
    run_id: str | None
    run_name: str | None
    task: str | None
    peer_id: str | None
    epoch: int
    samples: int
    samples_per_second: float | None
    swarm_samples_per_second: float | None
    loss: float | None
    eval_metric: float | None
    metric_name: str | None
    peers_online: int
    group_size: int | None
    compute_utilisation: float | None
    bytes_per_sample: float | None
    coordinator_reachable: bool
    reachability: str | None
    path: str | None
    no_group: str | None
    message: str | None


class Volunteer:
    """One volunteer's peer in one run; see the module docstring. ``run()`` blocks until the
    run is finished or :meth:`stop` is called (from any thread, e.g. a signal handler)."""

    def __init__(
        self,
        options: JoinOptions,
        *,
        on_update: Callable[[VolunteerStatus], None] | None = None,
    ) -> None:
        self.options = options
        self._on_update = on_update
        self._status = VolunteerStatus()
        self._status_lock = threading.Lock()
        self._stopping = threading.Event()
        self._wake = threading.Event()  # set on stop() and on every change of the run's status
        self._optimizer: Optimizer | DiLoCo | None = None
        #: whether the home router forwards this peer's ports (asked by UPnP at the join)
        self.port_mapped = False

    # ------------------------------------------------------------------ status

    @property
    def status(self) -> VolunteerStatus:
        with self._status_lock:
            return self._status

    def _update(self, **changes: Unpack[StatusChanges]) -> None:
        with self._status_lock:
            self._status = replace(self._status, **changes)
            status = self._status
        if self._on_update is not None:
            try:
                self._on_update(status)
            except Exception:  # a display must never stop training
                logger.exception("progress display failed")

    def _say(self, message: str) -> None:
        logger.info("%s", message)
        self._update(message=message)

    def _finish(self, message: str, state: str = "finished") -> str:
        self._update(state=state, message=message)
        return message

    def stop(self) -> None:
        """Leave the swarm: ``run()`` returns within a few seconds. Thread-safe, idempotent."""
        self._stopping.set()
        self._wake.set()
        optimizer = self._optimizer
        if optimizer is not None:  # its averaging round in flight is called off
            optimizer.interrupt()

    # ------------------------------------------------------------------- run

    def run(self) -> str:
        """Join, train until the run finishes or :meth:`stop` is called; the final message."""
        from peer.coordinator import CoordinatorClient
        from peer.coordinator.joining import NodeOptions, join_run
        from peer.coordinator.responses import when_allowed
        from peer.tasks.shipped import load_run_task

        options = self.options
        with contextlib.ExitStack() as stack:
            # one process per key, refused before anything else (see peer.data_dir)
            stack.enter_context(lock_data_dir(options.data_dir))
            client = stack.enter_context(CoordinatorClient(options.url))
            challenge = when_allowed(lambda: client.join_challenge(options.token))
            task = load_run_task(
                client,
                options.token,
                challenge.run_id,
                options.data_dir,
                options.task_consent,
                override=options.task,
            )
            device = resolve_device(options.device)
            identity = load_identity(options.data_dir)
            self._update(
                run_id=challenge.run_id,
                run_name=challenge.run_name,
                task=task.name,
                peer_id=identity.peer_id,
                metric_name=task.metric_name,
            )
            membership = join_run(
                client,
                options.token,
                identity,
                node_options=NodeOptions(
                    options.host,
                    options.port,
                    options.bulk_port,
                    options.client_mode,
                    port_mapping=options.port_mapping,
                ),
                display_name=options.name,
                challenge=challenge,
                on_status=lambda status: self._wake.set(),
                on_credentials_lost=lambda line: self._wake.set(),
            )
            if membership.mapping is not None:  # removed once the node is down
                stack.callback(membership.mapping.close)
                self.port_mapped = True
            stack.callback(membership.node.shutdown)
            stack.callback(membership.session.close)
            self._update(reachability=membership.reachability)
            from peer.tasks.base import TaskError, TrainingConfig

            answer = membership.answer
            try:
                config = TrainingConfig.from_run_config(task, answer.config)
            except ValueError as exc:
                raise TaskError(
                    f"the run's config does not suit the task {task.name!r}: {exc}"
                ) from exc
            return self._train(
                client, answer, membership.node, membership.session, task, config, device
            )

    # ------------------------------------------------------------------ training

    def _train(
        self,
        client: CoordinatorClient,
        answer: JoinAnswer,
        node: Node,
        session: CoordinatorSession,
        task: Task[BatchT],
        config: TrainingConfig,
        device: str,
    ) -> str:
        self._update(state="loading")
        model = task.build_model(config).to(device)
        checkpoint = (
            None
            if answer.checkpoint is None
            else download_checkpoint(client, answer.peer_token, answer.run_id)
        )
        if checkpoint is not None:
            # before the optimizer exists: with offload_optimizer it copies these weights
            model.load_state_dict(checkpoint["model"])
        # the run's algorithm: peer.Optimizer, or peer.DiLoCo (which keeps its outer
        # parameters in host memory whatever the device)
        extra = {"offload_optimizer": device != "cpu"} if config.algorithm != "diloco" else {}
        from peer.optim.buffers import model_buffers

        # the model's buffers (running statistics) are shared with the state unless the
        # run's config keeps them local (local_buffers)
        optimizer = config.make_swarm_optimizer(
            node,
            answer.run_id,
            model.parameters(),
            buffers=model_buffers(model),
            client_mode=node.client_mode,
            **extra,
        )
        self._optimizer = optimizer
        trainer = Trainer(self, client, answer, session, task, config, model, optimizer)
        try:
            # The constructor loaded the swarm's state if a live peer had a newer one.
            if checkpoint is not None and int(checkpoint.get("epoch", 0)) > optimizer.local_epoch:
                optimizer.load_state_dict(checkpoint["optimizer"])
                self._say(
                    f"resumed from the coordinator's checkpoint at epoch {optimizer.local_epoch}"
                )
            message = trainer.run()
            if self.options.save_final is not None:
                trainer.save_final(self.options.save_final)
            return message
        finally:
            self._optimizer = None
            optimizer.shutdown()
            trainer.close()
