"""The training loop of one volunteer: what ``swarmgrad join`` runs between joining and
leaving (:class:`Trainer`, built by :class:`peer.volunteer.Volunteer`).

Each step: the task's loss on a batch, backward, the swarm optimizer's step; then, as the
swarm's epoch moves, held-out evaluation of the model every peer agrees on, a progress report
for the coordinator, and — by the peer whose turn it is — a checkpoint upload. It follows the
run's status (paused, finished) and, after the run's last epoch, waits for its checkpoint,
the run's model, and takes it if its own differs (a split swarm's other side uploaded it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Generic, cast

from peer.coordinator.joining import path_of
from peer.exceptions import SwarmgradError
from peer.formats.open_types import StateDict
from peer.formats.payloads import CheckpointHeld, CheckpointPublic
from peer.tasks.base import BatchT

if TYPE_CHECKING:
    import torch

    from peer.coordinator.client import CoordinatorClient, JoinAnswer
    from peer.coordinator.session import CoordinatorSession
    from peer.node import Node
    from peer.optim.collaborative.optimizer import Optimizer
    from peer.optim.diloco.outer import DiLoCo
    from peer.tasks.base import Task, TrainingConfig
    from peer.volunteer import Volunteer

logger = logging.getLogger("peer.trainer")

__all__ = ["STATISTICS_STREAM", "Trainer", "compute_gradients", "set_lr"]

# Progress reports go to the coordinator at the interval it gives at join (10 s by default:
# 10,000 volunteers make 1,000 reports a second); the dashboard shows a silent machine
# offline after PRESENCE_S (server/services/dashboard.py), a few intervals. The volunteer's
# own status refreshes every STATUS_INTERVAL_S.
STATUS_INTERVAL_S = 1.0
# Held-out evaluation runs on a new epoch at most every MIN_EVAL_INTERVAL_S seconds, and
# no sooner than EVAL_SPACING times its own duration after the previous one.
MIN_EVAL_INTERVAL_S = 1.0
EVAL_SPACING = 20.0
# The training stream batch-norm statistics are recomputed on (recompute_statistics): the
# task's batches for this name, the same on every volunteer.
STATISTICS_STREAM = "swarm-statistics"
# After the run's last epoch: how long to wait for its final checkpoint before leaving.
FINAL_CHECKPOINT_GRACE_S = 60.0
# An upload the coordinator held (the others' reports had not yet shown them at its epoch) is
# sent again after these pauses, doubling, while this peer is still at that epoch.
HELD_RETRY_FIRST_S = 1.0
HELD_RETRY_MAX_S = 16.0


class Trainer(Generic[BatchT]):
    """The training loop of one :class:`Volunteer`, with what it keeps between steps."""

    def __init__(
        self,
        volunteer: Volunteer,
        client: CoordinatorClient,
        answer: JoinAnswer,
        session: CoordinatorSession,
        task: Task[BatchT],
        config: TrainingConfig,
        model: torch.nn.Module,
        optimizer: Optimizer | DiLoCo,
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
        from peer.formats.rates import CountedRate
        from peer.optim.no_group import NoGroupWatch
        from peer.optim.shared.progress import SwarmCounter

        self.rate = CountedRate()  # this peer's samples over its clock
        self.swarm = SwarmCounter()  # the swarm's samples, from the progress records
        self.swarm_rate = CountedRate()
        self.no_group = NoGroupWatch()  # the line's "no group for N rounds"
        from peer.optim.shared.progress import ProgressWatch  # with the optimizer, torch is loaded

        self.others = ProgressWatch(answer.peer_id)  # a paused peer's sign of a resumed run
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
        batches: Iterator[BatchT] = self.task.train_batches(self.config, self.answer.peer_id)
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
                self._take_final_model()
                detail = self.session.status_detail
                why = f" ({detail})" if detail else ""
                return volunteer._finish(
                    f"the run is finished{why}; thank you for training with us"
                )
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
            self._step([next(batches) for _ in range(self.config.accumulation)])
        return volunteer._finish("left the run", state="stopped")

    def _step(self, batches: list[BatchT]) -> None:
        """One optimizer step on ``batches`` (the config's ``accumulation`` micro-batches)
        at the swarm epoch's learning rate; then evaluation, upload and report as due."""
        epoch = self.optimizer.local_epoch
        set_lr(self.optimizer, self.config.lr_at(epoch))
        started = time.perf_counter()
        value, n = compute_gradients(self.task, self.model, batches, self.config)
        computed = time.perf_counter()
        timed = self._inner_step_seconds()
        self.optimizer.step(batch_size=n)
        self.optimizer.zero_grad()
        after = self._inner_step_seconds()
        local = None if timed is None or after is None else after - timed
        self.meter.add(computed - started, time.perf_counter() - computed, local)
        self.samples += n
        if math.isfinite(value):
            self.losses.append(value)
        new_epoch = self.optimizer.local_epoch
        every = self.config.checkpoint_every
        if new_epoch != epoch and every and new_epoch % every == 0:
            self._maybe_upload()
        if new_epoch != self.evaluated_epoch:
            self._evaluate()
        if time.monotonic() - self.reported_at >= STATUS_INTERVAL_S:
            # the optimizer's compute speed: what the coordinator shows as this peer's claim
            self._report(self.optimizer.performance.samples_per_second)

    def _inner_step_seconds(self) -> float | None:
        """The seconds the optimizer spent in its inner steps so far: DiLoCo times its own
        (local work, apart from its rounds); None for an optimizer that does not."""
        seconds: float | None = getattr(self.optimizer, "inner_step_seconds", None)
        return seconds

    def _evaluate(self, *, force: bool = False) -> None:
        """The task's held-out metric of the swarm's model (:meth:`_evaluate_state`), at
        most once per epoch, and spaced so that evaluating takes at most about
        1/:data:`EVAL_SPACING` of the time."""
        started = time.monotonic()
        if not force and started - self.evaluated_at < self.eval_interval:
            return
        self.eval_metric = self._evaluate_state(self._swarm_state())
        took = time.monotonic() - started
        self.evaluated_at, self.evaluated_epoch = started, self.optimizer.local_epoch
        self.eval_interval = max(MIN_EVAL_INTERVAL_S, EVAL_SPACING * took)

    def _swarm_state(self) -> dict[str, torch.Tensor]:
        """The model the swarm agrees on, on the CPU: its parameters (DiLoCo: the outer
        ones) and shared buffers, with the batch-norm statistics recomputed at those
        parameters when the run's ``recompute_statistics`` asks for it."""
        state = self.optimizer.synchronised_state_dict(self.model)
        if self.config.recompute_statistics:
            state = self._recompute_statistics(state, self.config.recompute_statistics)
        return state

    def _recompute_statistics(
        self, state: dict[str, torch.Tensor], batches: int
    ) -> dict[str, torch.Tensor]:
        """``state`` with its batch-norm running statistics recomputed: the cumulative
        average over ``batches`` batches of the :data:`STATISTICS_STREAM` (forward passes in
        train mode, no gradients) at ``state``'s parameters. The model is put back."""
        import itertools

        import torch

        model = self.model
        norms = [
            m
            for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        ]
        if not norms:
            return state
        with torch.no_grad():
            own = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(state)
        momenta = [m.momentum for m in norms]
        training = model.training
        try:
            for m in norms:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average over the batches
            model.train()
            stream = self.task.train_batches(self.config, STATISTICS_STREAM)
            with torch.no_grad():
                for batch in itertools.islice(stream, batches):
                    self.task.loss(model, batch)
            return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        finally:
            for m, momentum in zip(norms, momenta, strict=True):
                m.momentum = momentum
            model.train(training)
            with torch.no_grad():
                model.load_state_dict(own)

    def _evaluate_state(self, state: dict[str, torch.Tensor]) -> float:
        """The task's metric of the model with ``state`` (a full state dict: the swarm's
        parameters and buffers, which this peer's own inner steps or running statistics may
        have left), evaluated in place and put back: every volunteer reports the metric of
        the model the swarm agrees on, and the uploader that of what it uploads."""
        import torch

        model = self.model
        with torch.no_grad():
            own = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(state)
        try:
            return float(self.task.evaluate(model, self.config))
        finally:
            with torch.no_grad():
                model.load_state_dict(own)

    def save_final(self, path: Path) -> None:
        """Write this volunteer's final model to ``path`` with ``torch.save``: ``{"model":
        state_dict, "epoch": int, "task": str}``, the state dict holding parameters and
        buffers as the swarm agrees on them (DiLoCo: the outer parameters), which every
        peer at the same epoch holds alike — load it with ``model.load_state_dict(
        state["model"])``. Waits for a round in flight first. Written through a temporary
        file in the same directory, so a reader never sees half of it."""
        import torch

        optimizer = self.optimizer
        optimizer.wait_for_pending()
        state = {
            "model": self._swarm_state(),
            "epoch": int(optimizer.local_epoch),
            "task": self.task.name,
        }
        directory = path.parent if str(path.parent) else Path(".")
        fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
        try:
            with os.fdopen(fd, "wb") as file:
                torch.save(state, file)
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def _report(self, samples_per_second: float, *, force: bool = False) -> None:
        """Refresh the volunteer's status, and queue a progress report (never blocks) if
        the coordinator's report interval (told at join) passed since the last one (or
        ``force``). ``samples_per_second`` is the speed this peer claims to compute at; the
        status shows the rates counted here (see :class:`VolunteerStatus`)."""
        optimizer = self.optimizer
        if self.losses:
            self.loss = sum(self.losses) / len(self.losses)
        loss = self.loss
        utilisation = self.meter.take()
        now = time.monotonic()
        reports = optimizer.tracker.fetch()
        self.rate.add(now, self.samples)
        self.swarm_rate.add(now, self.swarm.observe(reports))
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
        # the volunteer's optimizer runs on its peer.Node (Volunteer._train), which the
        # optimizer keeps as the narrower SwarmNode it needs
        node = cast("Node", optimizer.node)
        path = path_of(node.visible_addresses, node.link_kinds(), mapped=self.volunteer.port_mapped)
        self.volunteer._update(
            compute_utilisation=utilisation,
            bytes_per_sample=node.bytes_sent / self.samples if self.samples else None,
            epoch=optimizer.local_epoch,
            samples=self.samples,
            samples_per_second=self.rate.per_second,
            swarm_samples_per_second=self.swarm_rate.per_second,
            loss=loss,
            eval_metric=self.eval_metric,
            peers_online=len(reports),
            group_size=optimizer.last_group_size,
            coordinator_reachable=self.session.coordinator_reachable,
            path=path,
            no_group=self.no_group.observe(
                epoch=optimizer.local_epoch,
                rounds_done=int(optimizer.rounds_done),
                rounds_failed=int(optimizer.rounds_failed),
                peers_online=len(reports),
                path=path,
            ),
        )

    def _paused(self) -> None:
        volunteer = self.volunteer
        # "waiting for 3 volunteers (1 online)" while the run gathers its swarm
        detail = self.session.status_detail
        message = (
            f"the run is {detail}" if detail else "the run is paused; waiting for the organizer"
        )
        if volunteer.status.state != "paused" or volunteer.status.message != message:
            volunteer._update(state="paused", message=message)
        if time.monotonic() - self.reported_at >= STATUS_INTERVAL_S:
            self._report(0.0)  # still here: a paused peer stays online on the dashboard
            # and counted by the other peers, so the first to resume does not train alone
            self.optimizer.report_presence()
        if self.others.moved(self.optimizer.tracker.fetch()):
            # the others train: the organizer most likely resumed the run, so this peer
            # asks now rather than start a poll interval after them
            self.session.poll_soon()
        volunteer._wake.wait(STATUS_INTERVAL_S)
        volunteer._wake.clear()

    def _after_last_epoch(self) -> str | None:
        """The run's last epoch is reached: one peer uploads it, everyone leaves once the
        coordinator has it (or after a grace period). The final message, or None to wait."""
        epochs = self.config.epochs
        assert epochs is not None  # run() comes here only for a run with a last epoch
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
            final = _newest_checkpoint(self.client, self.answer.run_id)
            if final is not None and final.epoch >= epochs:
                self._take_final_checkpoint(final)
                return f"the run reached its last epoch ({epochs})"
        if now - self.last_epoch_since > FINAL_CHECKPOINT_GRACE_S:
            return (
                f"the run reached its last epoch ({epochs}); "
                "its checkpoint did not reach the coordinator"
            )
        self.volunteer._wake.wait(0.2)
        self.volunteer._wake.clear()
        return None

    def _take_final_model(self) -> None:
        """The run is finished: leave with its newest checkpoint where it is at least as new
        as this peer's model (a peer that learns of the end before it looked for the last
        epoch's checkpoint, on a side of a split swarm, would otherwise save its own)."""
        final = _newest_checkpoint(self.client, self.answer.run_id)
        if final is not None and final.epoch >= self.optimizer.local_epoch:
            self._take_final_checkpoint(final)

    def _take_final_checkpoint(self, final: CheckpointPublic) -> None:
        """The run's final model is its checkpoint of the last epoch. A peer whose own model
        differs from it (the swarm split in a round, and this peer's side averaged apart
        from the uploader's) takes the checkpoint's model and optimizer state, evaluates
        and reports it: every volunteer leaves with, and saves, the run's one model. The
        uploader holds it already; a checkpoint this peer cannot read changes nothing."""
        import torch

        if final.peer_id == self.answer.peer_id:
            return
        try:
            checkpoint = download_checkpoint(
                self.client, self.answer.peer_token, self.answer.run_id
            )
        except SwarmgradError as exc:
            logger.warning("the run's final checkpoint could not be downloaded: %s", exc)
            return
        if checkpoint is None or int(checkpoint.get("epoch", -1)) < final.epoch:
            return
        own, theirs = self._swarm_state(), checkpoint["model"]
        if own.keys() == theirs.keys() and all(
            not value.is_floating_point() or torch.equal(value, theirs[name])
            for name, value in own.items()
        ):
            return
        try:
            self.optimizer.load_checkpoint(self.model, checkpoint)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            logger.warning("the run's final checkpoint does not fit this model: %s", exc)
            return
        self._evaluate(force=True)
        self._report(0.0, force=True)
        self.volunteer._say(
            "this volunteer's model differed from the run's final checkpoint "
            f"(uploaded by peer {final.peer_id}): took the checkpoint's"
        )

    def _maybe_upload(self) -> None:
        """Upload a checkpoint in the background if this peer is the uploader of its epoch:
        the lowest peer id among the peers at (or just before) that epoch, which every peer
        works out alike from the gossiped progress reports, with no lock. Should two peers
        disagree for a moment, the coordinator keeps the first upload of an epoch and refuses
        the second before its body is read. One upload at a time."""
        import torch

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
        # the parameters and buffers every peer shares (DiLoCo: the outer ones; the model's
        # own are this peer's inner steps since the last sync), evaluated here so that the
        # figure this peer reports is the checkpoint's
        model_state = self._swarm_state()
        metric = self._evaluate_state(model_state)
        self.eval_metric = metric
        # (the next report carries it; no other evaluation before the next epoch)
        self.evaluated_at, self.evaluated_epoch = time.monotonic(), epoch
        state = {
            "model": model_state,
            "metric": metric,
            "epoch": epoch,
            "task": self.task.name,
            "config": dict(self.answer.config),
            "optimizer": optimizer_state,
        }
        client, answer, stopping = self.client, self.answer, self.volunteer._stopping

        def send() -> None:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = buffer.getvalue()
            pause = HELD_RETRY_FIRST_S
            while True:
                try:
                    result = client.upload_checkpoint(answer.peer_token, answer.run_id, epoch, data)
                except SwarmgradError as exc:
                    logger.info("checkpoint of epoch %d not uploaded: %s", epoch, exc)
                    return
                if not isinstance(result, CheckpointHeld):
                    logger.info("uploaded the checkpoint of epoch %d", epoch)
                    return
                # The coordinator has not yet seen the others at this epoch (their reports
                # lag): send it again once they had time to report, unless this peer has
                # moved on (its next epoch's upload replaces this one) or is stopping.
                logger.info("checkpoint of epoch %d held: %s", epoch, result.detail)
                if stopping.wait(pause) or optimizer.local_epoch != epoch:
                    return
                pause = min(2 * pause, HELD_RETRY_MAX_S)

        self.upload = self.uploads.submit(send)


def set_lr(optimizer: Optimizer | DiLoCo | torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of the swarm optimizer (the wrapped
    torch optimizer's; DiLoCo: the inner one's) — what the run's schedule gives the epoch."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def compute_gradients(
    task: Task[BatchT], model: torch.nn.Module, batches: list[BatchT], config: TrainingConfig
) -> tuple[float, int]:
    """Accumulate in ``.grad`` the gradient of the mean loss over every sample of ``batches``
    (micro-batches: each one's mean loss weighted by its share of the samples, so that one
    batch of N samples and four of N/4 give the same gradient), in train mode, the forward
    pass under ``config.precision``; then clip it to ``config.max_grad_norm``. The mean loss
    and the number of samples: what ``optimizer.step(batch_size=...)`` takes."""
    import torch

    sizes = [int(task.batch_size(batch)) for batch in batches]
    total = sum(sizes)
    model.train()
    autocast: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if config.precision == "bf16":
        device = next(iter(model.parameters())).device.type
        autocast = torch.autocast(device_type=device, dtype=torch.bfloat16)
    loss_sum = 0.0
    for batch, n in zip(batches, sizes, strict=True):
        with autocast:
            loss = task.loss(model, batch)
        # backward outside autocast: gradients land in the float32 parameters' dtype
        scaled = loss if len(batches) == 1 else loss * (n / total)
        # Tensor.backward is unannotated: an untyped call to mypy --strict only
        scaled.backward()  # type: ignore[no-untyped-call, unused-ignore]
        loss_sum += float(loss.detach()) * n
    if config.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    return (loss_sum / total if total else math.nan), total


def _newest_checkpoint(client: CoordinatorClient, run_id: str) -> CheckpointPublic | None:
    """The coordinator's newest checkpoint of the run; None if none or unknown."""
    try:
        return client.progress(run_id).checkpoint
    except SwarmgradError:
        return None


def download_checkpoint(client: CoordinatorClient, token: str, run_id: str) -> StateDict | None:
    """The coordinator's newest checkpoint of the run as ``torch.load`` reads it (weights
    only); None, with a warning, if there is none or it is unreadable or has no model.
    :class:`~peer.exceptions.SwarmgradError` if the coordinator cannot be asked."""
    import torch

    found = client.download_checkpoint(token, run_id)
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
