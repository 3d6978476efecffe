"""A volunteer's peer: join a coordinator's run with an invite token and train it.

:class:`Volunteer` is what ``swarmgrad join URL --token T`` runs. In order:

1. ask the coordinator for a join challenge (it names the run and its task), check that the
   task imports and the device exists — before a use of the invite is spent;
2. load (or create) this volunteer's identity key in ``data_dir``, so a restart is the same
   peer, and join: the coordinator checks a signature over the challenge (proof that this
   process holds the private key), and answers with a peer token, a run certificate, the
   run's config and bootstrap peers;
3. start a :class:`~peer.Node` authenticated by that certificate and ask the coordinator to
   dial it back: reachable, it announces the address the coordinator saw; not reachable, it
   starts again in client mode (dialing out only) and says which ports to open;
4. build the task's model, load the swarm's state from a live peer, or the coordinator's
   newest checkpoint when no peer is left, and train with the collaborative
   :class:`~peer.Optimizer`, or :class:`~peer.DiLoCo` when the run's config says
   ``algorithm: diloco`` (its epochs are then outer syncs, and its checkpoints hold the
   outer parameters that every peer shares);
5. meanwhile a :class:`~peer.coordinator.CoordinatorSession` renews the certificate, sends
   progress reports (buffered while the coordinator is away: training never waits on it),
   follows the run's status (paused: stop stepping and wait; finished: leave) and asks for
   bootstrap peers when every link is lost; every ``checkpoint_every`` epochs one peer (the
   lowest peer id at the swarm's epoch: no lock needed) uploads a checkpoint. If the
   coordinator stops accepting the peer token (the volunteer was away longer than its
   lifetime, or was banned), ``run()`` raises :class:`~peer.coordinator.Unauthorized`
   saying to join again with an invite.

Everything a volunteer can get wrong ends in a :class:`~peer.exceptions.SwarmgradError`
whose message is one line, for the command line to print.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peer.exceptions import SwarmgradError
from peer.identity import Identity

if TYPE_CHECKING:
    from peer.node import Node

logger = logging.getLogger("peer.volunteer")

__all__ = [
    "DeviceError",
    "JoinOptions",
    "Volunteer",
    "VolunteerStatus",
    "default_data_dir",
    "load_identity",
]

IDENTITY_FILE = "identity.key"
# Progress reports go to the coordinator at the interval it gives at join (10 s by default:
# 10,000 volunteers make 1,000 reports a second); the dashboard shows a silent machine
# offline after PRESENCE_S (server/services/dashboard.py), a few intervals. The volunteer's
# own status refreshes every STATUS_INTERVAL_S.
STATUS_INTERVAL_S = 1.0
# Held-out evaluation runs on a new epoch at most every MIN_EVAL_INTERVAL_S seconds, and
# no sooner than EVAL_SPACING times its own duration after the previous one.
MIN_EVAL_INTERVAL_S = 1.0
EVAL_SPACING = 20.0
# After the run's last epoch: how long to wait for its final checkpoint before leaving.
FINAL_CHECKPOINT_GRACE_S = 60.0


class DeviceError(SwarmgradError):
    """The device asked for is not available on this machine."""


def default_data_dir() -> Path:
    """Where a volunteer keeps its identity key: ``$XDG_DATA_HOME/swarmgrad``, else
    ``~/.local/share/swarmgrad``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "swarmgrad"


def load_identity(data_dir: Path) -> Identity:
    """The identity kept in ``data_dir`` (created, with a private file, on first use)."""
    path = Path(data_dir) / IDENTITY_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        identity = Identity()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_suffix(".tmp")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(identity.private_bytes())
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, path)
        except OSError as exc:
            raise SwarmgradError(
                f"cannot keep this volunteer's key in {path.parent}: {exc.strerror or exc}; "
                "pass --data-dir with a writable directory"
            ) from exc
        return identity
    except OSError as exc:
        raise SwarmgradError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return Identity.from_private_bytes(raw)
    except ValueError as exc:
        raise SwarmgradError(
            f"{path} is not a swarmgrad identity key; move it away to start as a new peer"
        ) from exc


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
    data_dir: Path = field(default_factory=default_data_dir)


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
    samples_per_second: float = 0.0
    swarm_samples_per_second: float = 0.0
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
    message: str | None = None


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
        self._optimizer: Any = None

    # ------------------------------------------------------------------ status

    @property
    def status(self) -> VolunteerStatus:
        with self._status_lock:
            return self._status

    def _update(self, **changes: Any) -> None:
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
        if optimizer is not None:
            optimizer.interrupt()

    # ------------------------------------------------------------------- run

    def run(self) -> str:
        """Join, train until the run finishes or :meth:`stop` is called; the final message."""
        from peer.coordinator import CoordinatorClient
        from peer.coordinator.membership import NodeOptions, join_run
        from peer.coordinator.responses import when_allowed
        from peer.tasks.registry import load_task

        options = self.options
        with contextlib.ExitStack() as stack:
            client = stack.enter_context(CoordinatorClient(options.url))
            challenge = when_allowed(lambda: client.join_challenge(options.token))
            task = load_task(options.task or challenge.task)
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
                    options.host, options.port, options.bulk_port, options.client_mode
                ),
                display_name=options.name,
                challenge=challenge,
                on_status=lambda status: self._wake.set(),
                on_credentials_lost=lambda line: self._wake.set(),
            )
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
        client: Any,
        answer: Any,
        node: Node,
        session: Any,
        task: Any,
        config: Any,
        device: str,
    ) -> str:
        self._update(state="loading")
        model = task.build_model(config).to(device)
        checkpoint = _download_checkpoint(client, answer)
        if checkpoint is not None:
            # before the optimizer exists: with offload_optimizer it copies these weights
            model.load_state_dict(checkpoint["model"])
        # the run's algorithm: peer.Optimizer, or peer.DiLoCo (which keeps its outer
        # parameters in host memory whatever the device)
        extra = {"offload_optimizer": device != "cpu"} if config.algorithm != "diloco" else {}
        optimizer = config.make_swarm_optimizer(
            node, answer.run_id, model.parameters(), client_mode=node.client_mode, **extra
        )
        self._optimizer = optimizer
        trainer = _Trainer(self, client, answer, session, task, config, model, optimizer)
        try:
            # The constructor loaded the swarm's state if a live peer had a newer one.
            if checkpoint is not None and int(checkpoint.get("epoch", 0)) > optimizer.local_epoch:
                optimizer.load_state_dict(checkpoint["optimizer"])
                self._say(
                    f"resumed from the coordinator's checkpoint at epoch {optimizer.local_epoch}"
                )
            return trainer.run()
        finally:
            self._optimizer = None
            optimizer.shutdown()
            trainer.close()


class _Trainer:
    """The training loop of one :class:`Volunteer`, with what it keeps between steps."""

    def __init__(
        self,
        volunteer: Volunteer,
        client: Any,
        answer: Any,
        session: Any,
        task: Any,
        config: Any,
        model: Any,
        optimizer: Any,
    ) -> None:
        self.volunteer = volunteer
        self.client = client
        self.answer = answer
        self.session = session
        self.task = task
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.samples = 0
        self.losses: list[float] = []
        self.reported_at = -math.inf  # the status's refresh
        self.submitted_at = -math.inf  # the last report queued for the coordinator
        from peer.coordinator.reports import OptimizerReports

        self.reports = OptimizerReports()
        from peer.optim.utilisation import ComputeMeter

        self.meter = ComputeMeter()  # forward/backward against waiting, per report
        self.loss: float | None = None  # mean training loss since the previous report
        self.eval_metric: float | None = None
        self.evaluated_at = -math.inf
        self.evaluated_epoch = -1
        self.eval_interval = MIN_EVAL_INTERVAL_S
        self.uploads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="swarmgrad-ckpt")
        self.upload: concurrent.futures.Future[None] | None = None
        self.uploaded_epoch = -1
        self.last_epoch_since: float | None = None  # when the run's last epoch was reached
        self.checked_at = -math.inf

    def close(self) -> None:
        self.uploads.shutdown(wait=True, cancel_futures=True)

    def run(self) -> str:
        volunteer = self.volunteer
        batches: Iterator[Any] = self.task.train_batches(self.config, self.answer.peer_id)
        volunteer._update(state="training")
        while not volunteer._stopping.is_set():
            lost = self.session.credentials_lost
            if lost is not None:
                # The coordinator will take nothing more from this peer: a failure the
                # volunteer must act on (join again with an invite), not a clean finish.
                from peer.coordinator.exceptions import Unauthorized

                volunteer._update(state="stopped")
                raise Unauthorized(lost, status_code=401)
            status = self.session.status
            if status == "finished":
                return volunteer._finish("the run is finished; thank you for training with us")
            if status == "paused":
                self._paused()
                continue
            if self.config.epochs is not None and self.optimizer.local_epoch >= self.config.epochs:
                done = self._after_last_epoch()
                if done is not None:
                    return volunteer._finish(done)
                continue
            if volunteer.status.state == "paused":
                volunteer._update(state="training", message="the run resumed")
            self._step(next(batches))
        return volunteer._finish("left the run", state="stopped")

    def _step(self, batch: Any) -> None:

        epoch = self.optimizer.local_epoch
        self.model.train()
        started = time.perf_counter()
        loss = self.task.loss(self.model, batch)
        loss.backward()
        computed = time.perf_counter()
        n = self.task.batch_size(batch)
        timed = getattr(self.optimizer, "inner_step_seconds", None)  # DiLoCo times its own
        self.optimizer.step(batch_size=n)
        self.optimizer.zero_grad()
        local = None if timed is None else self.optimizer.inner_step_seconds - timed
        self.meter.add(computed - started, time.perf_counter() - computed, local)
        self.samples += n
        value = float(loss.detach())
        if math.isfinite(value):
            self.losses.append(value)
        new_epoch = self.optimizer.local_epoch
        every = self.config.checkpoint_every
        if new_epoch != epoch and every and new_epoch % every == 0:
            self._maybe_upload()
        if new_epoch != self.evaluated_epoch:
            self._evaluate()
        if time.monotonic() - self.reported_at >= STATUS_INTERVAL_S:
            self._report(self.optimizer.performance.samples_per_second)

    def _evaluate(self, *, force: bool = False) -> None:
        """The task's held-out metric, at most once per epoch, and spaced so that evaluating
        takes at most about 1/:data:`EVAL_SPACING` of the time."""
        started = time.monotonic()
        if not force and started - self.evaluated_at < self.eval_interval:
            return
        self.eval_metric = float(self.task.evaluate(self.model, self.config))
        took = time.monotonic() - started
        self.evaluated_at, self.evaluated_epoch = started, self.optimizer.local_epoch
        self.eval_interval = max(MIN_EVAL_INTERVAL_S, EVAL_SPACING * took)

    def _report(self, samples_per_second: float, *, force: bool = False) -> None:
        """Refresh the volunteer's status, and queue a progress report (never blocks) if
        the coordinator's report interval (told at join) passed since the last one (or
        ``force``)."""
        optimizer = self.optimizer
        if self.losses:
            self.loss = sum(self.losses) / len(self.losses)
        loss = self.loss
        utilisation = self.meter.take()
        now = time.monotonic()
        if force or now - self.submitted_at >= self.answer.report_interval_s:
            self.session.submit_report(
                self.reports.fields(
                    optimizer,
                    samples=self.samples,
                    samples_per_second=samples_per_second,
                    loss=loss,
                    eval_metric=self.eval_metric,
                    compute_utilisation=utilisation,
                )
            )
            self.losses.clear()  # the report's loss: the mean since the previous report
            self.submitted_at = now
        self.reported_at = now
        self.volunteer._update(
            compute_utilisation=utilisation,
            bytes_per_sample=optimizer.node.bytes_sent / self.samples if self.samples else None,
            epoch=optimizer.local_epoch,
            samples=self.samples,
            samples_per_second=samples_per_second,
            swarm_samples_per_second=optimizer.global_progress.samples_per_second,
            loss=loss,
            eval_metric=self.eval_metric,
            peers_online=len(optimizer.tracker.fetch()),
            group_size=optimizer.last_group_size,
            coordinator_reachable=self.session.coordinator_reachable,
        )

    def _paused(self) -> None:
        volunteer = self.volunteer
        if volunteer.status.state != "paused":
            volunteer._update(
                state="paused", message="the run is paused; waiting for the organizer"
            )
        if time.monotonic() - self.reported_at >= STATUS_INTERVAL_S:
            self._report(0.0)  # still here: a paused peer stays online on the dashboard
        volunteer._wake.wait(STATUS_INTERVAL_S)
        volunteer._wake.clear()

    def _after_last_epoch(self) -> str | None:
        """The run's last epoch is reached: one peer uploads it, everyone leaves once the
        coordinator has it (or after a grace period). The final message, or None to wait."""
        epochs = self.config.epochs
        self._maybe_upload()
        now = time.monotonic()
        if self.last_epoch_since is None:
            self.last_epoch_since = now
            self._evaluate(force=True)
            self._report(0.0, force=True)
            self.volunteer._update(state="finished")
            self.volunteer._say(f"the run reached its last epoch ({epochs}); saving it")
        if now - self.checked_at >= 1.0:
            self.checked_at = now
            if _checkpoint_epoch(self.client, self.answer.run_id) >= epochs:
                return f"the run reached its last epoch ({epochs})"
        if now - self.last_epoch_since > FINAL_CHECKPOINT_GRACE_S:
            return (
                f"the run reached its last epoch ({epochs}); "
                "its checkpoint did not reach the coordinator"
            )
        self.volunteer._wake.wait(0.2)
        self.volunteer._wake.clear()
        return None

    def _maybe_upload(self) -> None:
        """Upload a checkpoint in the background if this peer is the uploader of its epoch:
        the lowest peer id among the peers at (or just before) that epoch, which every peer
        works out alike from the gossiped progress reports, with no lock. Should two peers
        disagree for a moment, the coordinator keeps the first upload of an epoch and refuses
        the second before its body is read. One upload at a time."""
        import torch

        from peer.optim.diloco import DiLoCo

        optimizer = self.optimizer
        epoch = optimizer.local_epoch
        if epoch == self.uploaded_epoch or (self.upload is not None and not self.upload.done()):
            return
        peer_id = self.answer.peer_id
        # Peers one epoch behind count too: they are about to arrive (or their report of the
        # new epoch has not reached this peer yet).
        candidates = [r.peer_id for r in optimizer.tracker.fetch() if r.epoch >= epoch - 1]
        self.uploaded_epoch = epoch
        if min([*candidates, peer_id]) != peer_id:
            return
        optimizer_state = optimizer.state_dict()  # (DiLoCo: once a round in flight landed)
        if isinstance(optimizer, DiLoCo):
            # the outer parameters, which every peer shares; the model's own are this
            # peer's inner steps since the last sync (with fragments or overlap, mid-round)
            model_state = optimizer.synchronised_state_dict(self.model)
        else:
            model_state = {
                k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
            }
        state = {
            "model": model_state,
            "epoch": epoch,
            "task": self.task.name,
            "config": dict(self.answer.config),
            "optimizer": optimizer_state,
        }
        client, answer = self.client, self.answer

        def send() -> None:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            try:
                client.upload_checkpoint(answer.peer_token, answer.run_id, epoch, buffer.getvalue())
                logger.info("uploaded the checkpoint of epoch %d", epoch)
            except SwarmgradError as exc:
                logger.info("checkpoint of epoch %d not uploaded: %s", epoch, exc)

        self.upload = self.uploads.submit(send)


def _download_checkpoint(client: Any, answer: Any) -> dict[str, Any] | None:
    """The coordinator's newest checkpoint, if the join answer names one and it loads."""
    if answer.checkpoint is None:
        return None
    import torch

    found = client.download_checkpoint(answer.peer_token, answer.run_id)
    if found is None:
        return None
    data, epoch = found
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        logger.warning("the coordinator's checkpoint of epoch %d is unreadable: %s", epoch, exc)
        return None
    if not isinstance(state, dict) or "model" not in state:
        logger.warning("the coordinator's checkpoint of epoch %d has no model", epoch)
        return None
    return state


def _checkpoint_epoch(client: Any, run_id: str) -> int:
    """The epoch of the coordinator's newest checkpoint of the run; -1 if none or unknown."""
    try:
        checkpoint = client.progress(run_id).checkpoint
    except SwarmgradError:
        return -1
    return checkpoint.epoch if checkpoint is not None else -1
