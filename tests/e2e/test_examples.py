"""The examples in ``examples/`` trained as an organizer ships them: ``swarmgrad runs create
--task-file``, three ``swarmgrad join --trust-task --save-final`` volunteers (none has the
task; the run ships it) and a newcomer that joins mid-run. The GPT-2 trains with the
collaborative optimizer, the BatchNorm ResNet with DiLoCo. Each: the loss falls; every
volunteer's final file holds the same parameters and float buffers, bit for bit; the GPT-2's
output layer stays tied to its token embedding in each file and in the checkpoint; the
checkpoint loads strictly into the example's fresh model and holds the figure the dashboard
shows last; the newcomer's first reported figure lies within what the others reported while
it came in."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

from peer.coordinator import CoordinatorClient
from peer.tasks.base import TrainingConfig
from swarmgrad.local import LocalCoordinator, start_volunteer, stop_processes
from tests.conftest import scaled
from tests.e2e.test_shipped_task import organizer

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOLUNTEERS = 3


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Watch:
    """What the coordinator's API said while the run trained, read twice a second."""

    progress: list[dict[str, Any]] = field(default_factory=list)
    peers: list[list[dict[str, Any]]] = field(default_factory=list)  # one list per read


@dataclass
class Trained:
    checkpoint: dict[str, Any]
    finals: list[dict[str, Any]]  # each volunteer's --save-final file, the newcomer's last
    watch: Watch
    newcomer: str  # its peer id
    outputs: list[str]


def _watch(url: str, token: str, run_id: str, watch: Watch, stop: threading.Event) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, timeout=5, headers=headers) as client:
        while not stop.wait(0.5):
            try:
                watch.progress.append(client.get(f"/api/v1/runs/{run_id}/progress").json())
                watch.peers.append(client.get(f"/api/v1/runs/{run_id}/peers").json()["peers"])
            except (httpx.HTTPError, KeyError, ValueError):
                continue


def train(tmp_path: Path, example: str, epochs: int, *config: str) -> Trained:
    """Ship ``examples/<example>.py`` with a run of ``epochs`` epochs; three volunteers train
    it, and a fourth joins once the swarm has reached epoch 1 (the run paused until it has
    reported); all run to the end."""
    settings = [part for setting in (f"epochs={epochs}", *config) for part in ("--config", setting)]
    env = {"SWARMGRAD_REPORT_INTERVAL_S": "1"}
    with LocalCoordinator(tmp_path / "coordinator", env=env) as coordinator:
        run = organizer(
            coordinator,
            *("runs", "create", example, "--task-file", f"{EXAMPLES / example}.py:task"),
            *("--no-check", "--min-volunteers", str(VOLUNTEERS), *settings),
        )
        invite = organizer(coordinator, "invite", run["id"], "--uses", str(VOLUNTEERS + 1))
        watch, stop = Watch(), threading.Event()
        watcher = threading.Thread(
            target=_watch, args=(coordinator.url, coordinator.admin_token, run["id"], watch, stop)
        )
        watcher.start()
        processes: list[subprocess.Popen[str]] = []
        logs = []

        def volunteer(i: int) -> None:
            log = (tmp_path / f"volunteer-{i}.log").open("w")
            logs.append(log)
            processes.append(
                start_volunteer(
                    coordinator.url,
                    invite["token"],
                    tmp_path / f"volunteer-{i}",
                    *("--quiet", "--trust-task", "--host", "127.0.0.1"),
                    *("--save-final", str(tmp_path / f"final-{i}.pt")),
                    stdout=log,
                    env={"OMP_NUM_THREADS": "1"},
                )
            )

        try:
            for i in range(VOLUNTEERS):
                volunteer(i)
            ids_before: set[str] = set()
            for _ in range(int(scaled(240) / 0.5)):  # until the swarm is past epoch 0
                if watch.progress and watch.progress[-1].get("epoch", 0) >= 1:
                    ids_before = {p["peer_id"] for p in watch.peers[-1]}
                    break
                assert all(p.poll() is None for p in processes)
                stop.wait(0.5)
            assert len(ids_before) == VOLUNTEERS, watch.progress[-1:]
            # paused while the newcomer starts, so that it joins mid-run however slowly it
            # starts; resumed once it reported (it has the swarm's state by then)
            with CoordinatorClient(coordinator.url) as client:
                client.update_run(coordinator.admin_token, run["id"], status="paused")
                volunteer(VOLUNTEERS)
                for _ in range(int(scaled(120) / 0.5)):
                    if any(
                        p["peer_id"] not in ids_before and p["last_report_at"] is not None
                        for p in watch.peers[-1]
                    ):
                        break
                    assert all(p.poll() is None for p in processes), "all still train"
                    stop.wait(0.5)
                client.update_run(coordinator.admin_token, run["id"], status="running")
            codes = [p.wait(scaled(300)) for p in processes]
        finally:
            stop_processes(processes)
            stop.set()
            watcher.join(10)
            for log in logs:
                log.close()
        outputs = [(tmp_path / f"volunteer-{i}.log").read_text() for i in range(VOLUNTEERS + 1)]
        assert codes == [0] * (VOLUNTEERS + 1), outputs
        with CoordinatorClient(coordinator.url) as client:
            found = client.download_checkpoint(coordinator.admin_token, run["id"])
    assert found is not None and found[1] == epochs, outputs
    newcomer = {p["peer_id"] for p in watch.peers[-1]} - ids_before
    assert len(newcomer) == 1, watch.peers[-1]
    finals = [
        torch.load(tmp_path / f"final-{i}.pt", weights_only=True) for i in range(VOLUNTEERS + 1)
    ]
    checkpoint = torch.load(io.BytesIO(found[0]), weights_only=True)
    return Trained(checkpoint, finals, watch, newcomer.pop(), outputs)


def check_swarm(trained: Trained, example: ModuleType, epochs: int) -> Any:
    """What both examples must hold; the example's model with the checkpoint loaded."""
    finals, checkpoint = trained.finals, trained.checkpoint
    first = finals[0]["model"]
    for final in finals:
        assert final["epoch"] == epochs, trained.outputs
        assert final["model"].keys() == first.keys()
        for name, tensor in final["model"].items():
            # one all-reduce result and the same optimizer step on every peer: bit for bit
            # (integer counters are each volunteer's own count and left out)
            if tensor.is_floating_point():
                assert torch.equal(tensor, first[name]), name
    for name, tensor in checkpoint["model"].items():
        if tensor.is_floating_point():
            assert torch.equal(tensor, first[name]), name
    task = example.task()
    config = TrainingConfig.from_run_config(task, checkpoint["config"])
    model = task.build_model(config)
    untrained = float(task.evaluate(model, config))
    model.load_state_dict(checkpoint["model"], strict=True)
    figure = float(task.evaluate(model, config))
    assert checkpoint["metric"] == pytest.approx(figure, abs=1e-9)
    # the dashboard's last figure at the last epoch: that of the checkpoint's model
    shown = [
        read
        for read in trained.watch.progress
        if read.get("epoch", 0) >= epochs and read.get("eval_metric") is not None
    ]
    assert shown, trained.watch.progress[-3:]
    assert shown[-1]["eval_metric"] == pytest.approx(figure, abs=1e-6)
    # the newcomer's first figure, against what the others reported from the read before it
    # to the read after it (they evaluate the same model at the same epochs)
    reads = trained.watch.peers
    at = next(
        i
        for i, peers in enumerate(reads)
        if any(p["peer_id"] == trained.newcomer and p["eval_metric"] is not None for p in peers)
    )
    mine = next(p["eval_metric"] for p in reads[at] if p["peer_id"] == trained.newcomer)
    # it reported before the run's last epoch: it joined mid-run
    reported = [
        p["epoch"]
        for peers in reads
        for p in peers
        if p["peer_id"] == trained.newcomer and p["last_report_at"] is not None
    ]
    assert reported and reported[0] < epochs, reported
    theirs = [
        p["eval_metric"]
        for peers in reads[max(at - 1, 0) : at + 2]
        for p in peers
        if p["peer_id"] != trained.newcomer and p["eval_metric"] is not None
    ]
    assert theirs and min(theirs) <= mine <= max(theirs), (mine, theirs)
    losses = [p["loss"] for p in trained.watch.progress if p.get("loss") is not None]
    assert losses and losses[-1] < losses[0], losses
    return task, model, untrained, figure


def test_the_gpt2_example_trained_by_volunteers_stays_tied_and_agrees(tmp_path: Path) -> None:
    epochs = 5
    # micro-batches and a warmed-up cosine schedule, as an organizer would set them
    trained = train(
        tmp_path,
        "gpt2",
        epochs,
        *("batch_size=8", "accumulation=2", "lr_schedule=cosine", "warmup_epochs=1"),
        "target_batch_size=128",
        "matchmaking_time=0.5",
    )
    example = load_example("gpt2")
    _, model, untrained, figure = check_swarm(trained, example, epochs)
    for state in [trained.checkpoint, *trained.finals]:
        assert torch.equal(state["model"]["wte.weight"], state["model"]["lm_head.weight"])
    assert model.lm_head.weight is model.wte.weight
    assert figure < untrained - 0.3, (untrained, figure)


def test_the_batchnorm_example_trained_with_diloco_shares_its_statistics(tmp_path: Path) -> None:
    epochs = 4
    trained = train(tmp_path, "bn_resnet", epochs, "algorithm=diloco", "matchmaking_time=2")
    example = load_example("bn_resnet")
    check_swarm(trained, example, epochs)
    state = trained.checkpoint["model"]
    counted = state["stem.1.num_batches_tracked"]
    assert counted.dtype == torch.int64 and int(counted) > 0
    # statistics gathered in training, not a fresh layer's
    assert not torch.allclose(state["stem.1.running_mean"], torch.zeros(8), atol=1e-3)
    for final in trained.finals:
        assert final["model"]["stem.1.num_batches_tracked"].dtype == torch.int64
