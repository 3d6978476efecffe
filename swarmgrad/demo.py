"""``swarmgrad demo``: a whole swarm on this machine, run the way people run it.

A coordinator process (production mode, fresh secrets, SQLite in a temporary directory), a
run with one single-use invite per peer made through the REST API, and N ``swarmgrad join
... --quiet`` processes exactly as volunteers start them. The run waits for all N
(``min_volunteers``; after :data:`JOIN_GRACE_S` the demo starts it anyway), the demo prints
one line per swarm epoch, and at the last epoch the run finishes once its checkpoint is
saved; the demo then waits for the peers to leave, evaluates the checkpoint and stops the
coordinator. Ctrl-C, SIGTERM or any failure stops every process it started
(:mod:`swarmgrad.local`).
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Annotated, TextIO

import typer
from rich.console import Console

from peer.coordinator import CoordinatorClient
from peer.coordinator.exceptions import RunNotAccepting
from peer.formats.open_types import ConfigValues
from peer.formats.payloads import ProgressPublic, RunPublic
from swarmgrad.errors import CommandError
from swarmgrad.extras import require_coordinator
from swarmgrad.local import LocalCoordinator, start_volunteer, stop_processes
from swarmgrad.organizer import check_run_config, parse_config, write_atomically
from swarmgrad.shipping import RequirementOption, TaskFileOption, task_source

# How often the demo reads the run's progress (a display refresh, not a synchronisation).
POLL_INTERVAL_S = 1.0
# How long the run waits for every volunteer to come online before the demo starts it anyway.
JOIN_GRACE_S = 120.0
# After the last epoch: how long to wait for its checkpoint before finishing the run anyway.
FINAL_CHECKPOINT_GRACE_S = 60.0
# After the run is finished: how long the peers get to notice and leave.
PEER_EXIT_TIMEOUT_S = 60.0


class DemoAlgorithm(enum.StrEnum):
    collaborative = "collaborative"
    diloco = "diloco"


# A demo's DiLoCo run: outer rounds after this many inner steps (its epochs count outer
# rounds), short enough that a demo's rounds come every few seconds.
DEMO_INNER_STEPS = 10


def demo(
    peers: Annotated[int, typer.Option(min=1, max=32, help="How many volunteers to start.")] = 4,
    task: Annotated[
        str,
        typer.Option(
            help="What the swarm trains: digits, charlm, or package.module:function (a "
            "function returning a peer.tasks.Task, importable from here; the current "
            "directory counts, as for python -m)."
        ),
    ] = "digits",
    task_file: TaskFileOption = None,
    requirement: RequirementOption = None,
    epochs: Annotated[
        int, typer.Option(min=1, help="Swarm epochs to train before the run finishes.")
    ] = 40,
    port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="The coordinator's port (default: a free one).",
            show_default=False,
        ),
    ] = None,
    save: Annotated[
        Path | None,
        typer.Option(
            help="Save the run's final checkpoint here (load it with "
            '`model.load_state_dict(torch.load(path)["model"])`).',
            show_default=False,
        ),
    ] = None,
    save_volunteers: Annotated[
        Path | None,
        typer.Option(
            "--save-volunteers",
            help="Have each volunteer write its own final model into this directory "
            "(peer-N.pt, as `swarmgrad join --save-final`).",
            show_default=False,
            file_okay=False,
        ),
    ] = None,
    algorithm: Annotated[
        DemoAlgorithm,
        typer.Option(
            help="collaborative: peer.Optimizer, gradients averaged every epoch; diloco: "
            f"peer.DiLoCo, {DEMO_INNER_STEPS} local steps per outer round (epochs count "
            "outer rounds)."
        ),
    ] = DemoAlgorithm.collaborative,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            help="A run setting as key=value, as for `swarmgrad runs create` (e.g. "
            "aggregator=mean); repeat for more.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Start a coordinator and a few volunteers on this machine and train a run to the end."""
    settings = parse_config(config or [])
    # --task's default is digits: with a file, --task was not given
    source = task_source(
        None if task == "digits" else task, task_file, requirement or [], default="digits"
    )
    # --task module:function: the demo and its volunteers import it from here, as python
    # -m does; a --task-file is shipped to the volunteers with the run
    import_path = [os.getcwd()] if source.file is None and ":" in source.task else []
    sys.path[:0] = [p for p in import_path if p not in sys.path]
    for reserved, option in (("epochs", "--epochs"), ("algorithm", "--algorithm")):
        if reserved in settings:
            raise typer.BadParameter(f"set {reserved} with {option}", param_hint="'--config'")
    run = Demo(
        peers=peers,
        task=source.task,
        task_file=source.body,
        import_path=import_path,
        epochs=epochs,
        port=port,
        save=save,
        save_volunteers=save_volunteers,
        algorithm=algorithm.value,
        settings=settings,
    )
    check_run_config(run.task, run.run_config(), source)
    require_coordinator("demo")
    with _signals_interrupt():
        try:
            run.run()
        except KeyboardInterrupt:
            # Everything is cleaned up: another Ctrl-C (or an impatient second signal from a
            # supervisor) while the interpreter exits must not turn the exit status 130 into
            # a death by signal.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            typer.echo("stopped: every process the demo started is gone", err=True)
            raise


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP stop the demo as Ctrl-C does: through the clean-up path."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signals = (signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, interrupt) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@dataclass
class _Peer:
    index: int
    process: subprocess.Popen[str]
    log_path: Path

    def last_line(self) -> str:
        try:
            lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x]
        except OSError:
            return ""
        return lines[-1] if lines else ""


class Demo:
    """One demo: :meth:`run` does it all and leaves no process behind."""

    def __init__(
        self,
        *,
        peers: int,
        task: str,
        epochs: int,
        port: int | None = None,
        save: Path | None = None,
        save_volunteers: Path | None = None,
        out: TextIO | None = None,
        algorithm: str = "collaborative",
        settings: ConfigValues | None = None,
        import_path: Sequence[str] = (),
        task_file: Mapping[str, str | list[str]] | None = None,
    ) -> None:
        self.peers = peers
        self.task_file = task_file  # POST /runs' task_file: the volunteers get it shipped
        self.import_path = list(import_path)
        self.settings = dict(settings or {})
        self.algorithm = algorithm
        self.save = save
        self.save_volunteers = save_volunteers
        self.task = task
        self.epochs = epochs
        self.port = port or 0
        self.console = Console(file=out, highlight=False)
        self.metric_name = "eval"

    def say(self, line: str) -> None:
        self.console.print(line, soft_wrap=True)
        self.console.file.flush()

    def run_config(self) -> dict[str, object]:
        """The config of the run the demo creates."""
        config: dict[str, object] = {"epochs": self.epochs}
        if self.algorithm == "diloco":
            config.update(algorithm="diloco", inner_steps=DEMO_INNER_STEPS)
        config.update(self.settings)
        return config

    def _save_final(self, i: int) -> list[str]:
        """``swarmgrad join``'s arguments to write volunteer ``i``'s final model, if asked."""
        if self.save_volunteers is None:
            return []
        self.save_volunteers.mkdir(parents=True, exist_ok=True)
        return ["--save-final", str((self.save_volunteers / f"peer-{i}.pt").absolute())]

    def _python_path(self) -> dict[str, str]:
        """``PYTHONPATH`` for the volunteers: where the task is imported from, first."""
        if not self.import_path:
            return {}
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return {"PYTHONPATH": os.pathsep.join([*self.import_path, *inherited])}

    def run(self) -> None:
        with (
            tempfile.TemporaryDirectory(prefix="swarmgrad-demo-") as temp,
            contextlib.ExitStack() as stack,
        ):
            directory = Path(temp)
            # A few volunteers on one machine: reports every second keep the epoch lines and
            # the dashboard fresh (a public run's coordinator keeps the 10 s default).
            coordinator = LocalCoordinator(
                directory / "coordinator", self.port, env={"SWARMGRAD_REPORT_INTERVAL_S": "1"}
            )
            stack.callback(coordinator.stop)
            self.say(f"starting a coordinator on {coordinator.url} ...")
            coordinator.start()
            self.say(f"coordinator: {coordinator.url} (API docs at {coordinator.url}/docs)")
            client = stack.enter_context(CoordinatorClient(coordinator.url))
            token = coordinator.admin_token
            # held until every volunteer is online: they start training together
            run = client.create_run(
                token,
                f"demo-{self.task}",
                self.task,
                self.run_config(),
                min_volunteers=self.peers,
                task_file=self.task_file,
            )
            invites = [
                client.create_invite(token, run.id, max_uses=1, label=f"demo peer {i}")
                for i in range(self.peers)
            ]
            peers: list[_Peer] = []
            # Registered before the first start: peers leave first, then the coordinator stops.
            stack.callback(lambda: stop_processes([p.process for p in peers]))
            threads = max(1, (os.cpu_count() or 1) // self.peers)
            for i, invite in enumerate(invites):
                log_path = directory / f"peer-{i}.log"
                with open(log_path, "w") as log:
                    process = start_volunteer(
                        coordinator.url,
                        invite.token,
                        directory / f"peer-{i}",
                        "--quiet",
                        "--name",
                        f"demo-{i}",
                        "--host",
                        "127.0.0.1",
                        # the file is the demo user's own: consent given by running the demo
                        *(["--trust-task"] if self.task_file is not None else []),
                        *self._save_final(i),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={"OMP_NUM_THREADS": str(threads), **self._python_path()},
                    )
                peers.append(_Peer(i, process, log_path))
            self.say(
                f"run {run.name} ({run.id}): {self.peers} volunteer(s) training "
                f"{self.task} for {self.epochs} epoch(s)"
                + (" (DiLoCo: an epoch is an outer round)" if self.algorithm == "diloco" else "")
                + "; Ctrl-C stops everything"
            )
            self.say(f"dashboard: {coordinator.url}/runs/{run.id}")
            self.say(f"organizer sign-in: {coordinator.url}/signin (token {token})")
            self.metric_name = _metric_name(self.task)
            self._start_once_online(client, token, run.id, coordinator, peers)
            progress = self._watch(client, run.id, coordinator, peers)
            self._finish(client, token, run.id)
            self._wait_for_peers(peers)
            self._report(client, token, run, progress)
            self.say("stopping the coordinator")

    def _start_once_online(
        self,
        client: CoordinatorClient,
        token: str,
        run_id: str,
        coordinator: LocalCoordinator,
        peers: list[_Peer],
    ) -> None:
        """Wait until the run started by itself (every volunteer online), or start it after
        the grace."""
        self.say(f"waiting for the {self.peers} volunteer(s) to come online ...")
        deadline = time.monotonic() + JOIN_GRACE_S
        while True:
            _check_alive(coordinator, peers)
            run = client.run(run_id)
            if run.status.value == "running":
                return
            if time.monotonic() >= deadline:
                online = run.volunteers_online or 0
                self.say(f"{online} of {self.peers} volunteer(s) online; starting anyway")
                client.update_run(token, run_id, status="running")
                return
            time.sleep(POLL_INTERVAL_S / 4)

    def _watch(
        self,
        client: CoordinatorClient,
        run_id: str,
        coordinator: LocalCoordinator,
        peers: list[_Peer],
    ) -> ProgressPublic:
        """Print a line per new swarm epoch until the run is done; its last progress."""
        shown = -1
        reached_at: float | None = None
        while True:
            _check_alive(coordinator, peers)
            progress = client.progress(run_id)
            epoch = progress.epoch
            if epoch > shown and progress.samples:
                shown = epoch
                self.say(self._epoch_line(progress))
            if progress.status.value == "finished":
                return progress  # at its last epoch, with its checkpoint: it ended by itself
            if epoch >= self.epochs:
                reached_at = reached_at if reached_at is not None else time.monotonic()
                if time.monotonic() - reached_at > FINAL_CHECKPOINT_GRACE_S:
                    self.say(f"no checkpoint of epoch {self.epochs} arrived; finishing anyway")
                    return progress
            if all(p.process.poll() == 0 for p in peers):
                return progress  # every peer left on its own: it saw the run end
            time.sleep(POLL_INTERVAL_S)

    def _epoch_line(self, progress: ProgressPublic) -> str:
        groups = progress.recent_group_sizes
        metric = progress.eval_metric
        loss = progress.loss
        return " | ".join(
            [
                f"epoch {progress.epoch}",
                f"samples {progress.samples:,}",
                f"{progress.samples_per_second:,.1f} samples/s",
                f"loss {'-' if loss is None else f'{loss:.3f}'}",
                f"{self.metric_name} {'-' if metric is None else f'{metric:.3f}'}",
                f"peers {progress.peers_online}",
                f"groups {', '.join(str(g) for g in groups[-4:]) or '-'}",
            ]
        )

    def _finish(self, client: CoordinatorClient, token: str, run_id: str) -> None:
        """Finish the run unless it finished by itself; say how it ended."""
        run = client.run(run_id)
        if run.status.value != "finished":
            try:
                run = client.update_run(token, run_id, status="finished")
            except RunNotAccepting:  # it finished by itself in the meantime
                run = client.run(run_id)
        why = f" ({run.status_detail})" if run.status_detail else ""
        self.say(f"the run is finished{why}; waiting for the volunteers to leave")

    def _wait_for_peers(self, peers: list[_Peer]) -> None:
        deadline = time.monotonic() + PEER_EXIT_TIMEOUT_S
        for peer in peers:
            try:
                code = peer.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise CommandError(
                    f"volunteer {peer.index} did not leave within {PEER_EXIT_TIMEOUT_S:.0f} s "
                    "of the run's end"
                ) from None
            if code != 0:
                raise CommandError(_failure(peer, code))

    def _report(
        self,
        client: CoordinatorClient,
        token: str,
        run: RunPublic,
        progress: ProgressPublic,
    ) -> None:
        found = client.download_checkpoint(token, run.id)
        if found is None:
            metric = progress.eval_metric
            if metric is not None:
                self.say(f"last reported {self.metric_name}: {metric:.4f} (no checkpoint saved)")
            if self.save is not None:
                raise CommandError(f"the run left no checkpoint; nothing saved to {self.save}")
            return
        data, epoch = found
        value = _evaluate(self.task, run.config, data)
        self.say(
            f"the checkpoint of epoch {epoch} ({len(data):,} bytes): "
            f"{self.metric_name} {value:.4f} on held-out data"
        )
        if self.save is not None:
            write_atomically(self.save, data)
            self.say(f"saved it to {self.save}")


def _failure(peer: _Peer, code: int | None) -> str:
    last = peer.last_line()
    return f"volunteer {peer.index} exited with status {code}" + (f": {last}" if last else "")


def _check_alive(coordinator: LocalCoordinator, peers: list[_Peer]) -> None:
    """A one-line error if a volunteer or the coordinator stopped."""
    _check_peers(peers)
    if not coordinator.running:
        raise CommandError(f"the coordinator stopped (log: {coordinator.log_path})")


def _check_peers(peers: list[_Peer]) -> None:
    for peer in peers:
        code = peer.process.poll()
        if code is not None and code != 0:
            raise CommandError(_failure(peer, code))


def _metric_name(task: str) -> str:
    from peer.tasks.registry import load_task

    return str(load_task(task).metric_name)


def _evaluate(task_name: str, run_config: ConfigValues, data: bytes) -> float:
    """The task's held-out metric of the model in a checkpoint (the file a peer uploaded)."""
    import torch

    from peer.tasks.base import TrainingConfig
    from peer.tasks.registry import load_task

    task = load_task(task_name)
    config = TrainingConfig.from_run_config(task, run_config)
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    model = task.build_model(config)
    model.load_state_dict(state["model"])
    model.eval()
    with torch.no_grad():
        return float(task.evaluate(model, config))
