"""SwarmgradStrategy: what Lightning's own tests of HivemindStrategy check, and two real
processes training one model through a Trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

try:
    import lightning as L
except ModuleNotFoundError:  # the swarmgrad[lightning] extra, which `make test` installs
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("needs the swarmgrad[lightning] extra", allow_module_level=True)

from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from peer import Node
from peer.integrations.lightning import SwarmgradStrategy, SwarmScheduler
from peer.optim.collaborative.optimizer import Optimizer
from tests.conftest import scaled

WORKER = Path(__file__).with_name("lightning_worker.py")

# Lightning's own use of a torch API that torch has since deprecated
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"
    ),
    # a module's own scheduler on an optimizer the swarm re-created never sees a step:
    # what the scheduler_fn warning is about
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before"),
]


@pytest.fixture
def node() -> Any:
    with Node(gossip_period=0.2) as n:
        yield n


def _trainer(strategy: SwarmgradStrategy, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        fast_dev_run=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _strategy(node: Node, **kwargs: Any) -> SwarmgradStrategy:
    options: dict[str, Any] = {"target_batch_size": 1, "matchmaking_time": 0.2, "node": node}
    return SwarmgradStrategy(**(options | kwargs))


def test_the_trainer_takes_the_strategy(node: Node) -> None:
    strategy = _strategy(node)
    assert _trainer(strategy).strategy is strategy
    assert strategy.node is node and strategy.num_peers == 1


def test_the_optimizer_is_wrapped_and_steps(node: Node) -> None:
    seen: list[Any] = []

    class Model(BoringModel):
        def on_before_backward(self, loss: torch.Tensor) -> None:
            seen.append(self.trainer.optimizers[0])

    model = Model()
    before = [p.detach().clone() for p in model.parameters()]
    _trainer(_strategy(node)).fit(model)
    assert isinstance(seen[0], Optimizer)
    assert seen[0].local_epoch == 1  # a lone peer's batch of 2 >= target_batch_size 1
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_schedulers_are_wrapped_to_step_on_swarm_epochs(node: Node) -> None:
    seen: list[Any] = []

    class Model(BoringModel):
        def on_before_backward(self, loss: torch.Tensor) -> None:
            seen.append(self.trainer.lr_scheduler_configs[0].scheduler)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.layer.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)]

    _trainer(_strategy(node)).fit(Model())
    wrapper = seen[0]
    assert isinstance(wrapper, SwarmScheduler)
    # stepped once per swarm epoch, however often Lightning calls it
    assert wrapper.current_step == wrapper.optimizer.local_epoch == 1
    wrapper.step()
    wrapper.step()
    assert wrapper.scheduler.get_last_lr() == [0.05]


def test_reduce_lr_on_plateau_is_refused(node: Node) -> None:
    class Model(BoringModel):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.layer.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "loss"}}

    with pytest.raises(ValueError, match="`ReduceLROnPlateau` scheduler is not supported"):
        _trainer(_strategy(node)).fit(Model())


def test_initial_peers_from_the_environment(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_INITIAL_PEERS", "ws://10.0.0.1:4000, ws://10.0.0.2:4000")
    strategy = _strategy(node, initial_peers=["ws://ignored:1"])
    assert strategy._initial_peers == ["ws://10.0.0.1:4000", "ws://10.0.0.2:4000"]
    monkeypatch.delenv("PL_INITIAL_PEERS")
    assert _strategy(node, initial_peers="ws://a:1,ws://b:2")._initial_peers == [
        "ws://a:1",
        "ws://b:2",
    ]


def test_a_strategy_without_a_node_starts_one_and_logs_how_to_join(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="peer.integrations.lightning")
    strategy = SwarmgradStrategy(target_batch_size=1, host="127.0.0.1")
    try:
        address = strategy.node.visible_addresses[0]
        assert f"PL_INITIAL_PEERS={address} python" in caplog.text
        assert strategy._own_node  # shut down with the strategy
    finally:
        strategy.node.shutdown()


def test_reuse_grad_buffers_warns_disables_zero_grad_and_restores_it(node: Node) -> None:
    during: list[Any] = []

    class Model(BoringModel):
        def on_before_backward(self, loss: torch.Tensor) -> None:
            during.append(self.optimizer_zero_grad)

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad()

    model = Model()
    original = model.optimizer_zero_grad
    with pytest.warns(
        UserWarning, match="You have overridden `optimizer_zero_grad` which will be disabled"
    ):
        _trainer(_strategy(node, reuse_grad_buffers=True, batch_size=2)).fit(model)
    assert during and during[0] != original
    assert model.optimizer_zero_grad == original  # restored at teardown


def test_more_than_one_optimizer_is_refused(node: Node) -> None:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.layer.parameters(), lr=0.1)] * 2

    with pytest.raises(MisconfigurationException, match="supports exactly one optimizer"):
        _trainer(_strategy(node)).fit(Model())


def test_a_batch_size_that_cannot_be_inferred_is_refused(node: Node) -> None:
    with (
        mock.patch.object(
            SwarmgradStrategy.lightning_package,
            "extract_batch_size",
            side_effect=MisconfigurationException("no tensor in the batch"),
        ),
        pytest.raises(MisconfigurationException, match="provide the batch size"),
    ):
        _trainer(_strategy(node)).fit(BoringModel())


def test_the_batch_size_is_inferred_from_the_first_batch(node: Node) -> None:
    class Model(BoringModel):
        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(RandomDataset(32, 64), batch_size=4)

    strategy = _strategy(node)
    _trainer(strategy).fit(Model())
    assert strategy._batch_size == 4
    assert strategy.optimizer.batch_size_per_step == 4


@pytest.mark.parametrize(
    "delays",
    [
        {"delay_grad_averaging": True, "delay_state_averaging": True, "delay_optimizer_step": True},
        {"delay_state_averaging": True},
    ],
)
def test_options_that_recreate_the_optimizer_warn_without_scheduler_fn(
    node: Node, delays: dict[str, bool]
) -> None:
    with pytest.warns(UserWarning, match="requires a `scheduler_fn` to be passed to the strategy"):
        _trainer(_strategy(node, **delays)).fit(BoringModel())


def test_options_are_forwarded_to_the_optimizer(node: Node) -> None:
    from peer.compression import ScaledFloat16Compression

    compression = ScaledFloat16Compression()
    with mock.patch("peer.optim.collaborative.optimizer.Optimizer", wraps=Optimizer) as spy:
        model = BoringModel()
        _trainer(
            _strategy(
                node,
                reuse_grad_buffers=True,
                delay_state_averaging=True,
                delay_optimizer_step=True,
                offload_optimizer=True,
                grad_compression=compression,
                state_averaging_compression=compression,
                average_state_every=2,
                scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1),
            )
        ).fit(model)
    kwargs = spy.call_args.kwargs
    expected = {
        "delay_optimizer_step": True,
        "delay_state_averaging": True,
        "offload_optimizer": True,
        "reuse_grad_buffers": True,
        "grad_compression": compression,
        "state_averaging_compression": compression,
        "average_state_every": 2,
        "target_batch_size": 1,
        "batch_size_per_step": 1,  # BoringModel's batches, inferred
        "run_id": "lightning_run",
        "matchmaking_time": 0.2,
    }
    assert {k: kwargs[k] for k in expected} == expected
    assert kwargs["optimizer"] is torch.optim.SGD and kwargs["scheduler"] is not None
    assert model.optimizer_zero_grad is not None


def test_float16_precision_is_refused_with_a_reason(node: Node) -> None:
    with pytest.raises(
        MisconfigurationException, match="supports precision '32-true' and 'bf16-mixed'"
    ):
        _trainer(_strategy(node), precision="16-true").fit(BoringModel())


@pytest.mark.slow
def test_two_processes_train_one_model(tmp_path: Path) -> None:
    procs = []
    first = None
    try:
        for rank in range(2):
            cmd = [
                sys.executable,
                str(WORKER),
                "--rank",
                str(rank),
                "--out",
                str(tmp_path / f"{rank}.pt"),
            ]
            if first:
                cmd += ["--initial-peer", first]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
            if first is None:
                line = procs[0].stdout.readline()  # type: ignore[union-attr]
                assert line, procs[0].communicate()[1]
                first = json.loads(line)["addresses"][0]
        for proc in procs:
            _, err = proc.communicate(timeout=scaled(180))
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    for r in results:
        assert r["seen"][-1] == 3 and len(set(r["seen"])) >= 3  # swarm epochs advanced
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        torch.testing.assert_close(a, b)


def test_a_coordinators_invite_joins_its_run_and_reports_progress(tmp_path: Path) -> None:
    """coordinator= and token=: the strategy joins the run as `swarmgrad join` would, trains
    under the run's id and its reports show in the run's progress."""
    server_fixtures = pytest.importorskip("tests.server.conftest")
    from peer.coordinator import CoordinatorClient
    from peer.data_dir import DataDirInUse, lock_data_dir
    from server.app import create_app
    from tests.conftest import served

    settings = server_fixtures.make_settings(
        f"sqlite:///{tmp_path / 'coordinator.db'}",
        checkpoint_dir=tmp_path / "checkpoints",
        report_flush_interval_s=0,
    )
    admin = server_fixtures.ADMIN_TOKEN
    with served(create_app(settings)) as url, CoordinatorClient(url) as client:
        run = client.create_run(admin, "lightning", "digits", {})
        token = client.create_invite(admin, run.id).token
        strategy = SwarmgradStrategy(
            target_batch_size=4,
            matchmaking_time=0.2,
            host="127.0.0.1",
            coordinator=url,
            token=token,
            name="lightning volunteer",
            data_dir=tmp_path / "volunteer",
        )
        assert strategy._run_id == run.id
        # one process per key, as for swarmgrad join: a second volunteer needs its own
        with pytest.raises(DataDirInUse, match="--data-dir"):
            lock_data_dir(tmp_path / "volunteer")
        trainer = L.Trainer(
            strategy=strategy,
            max_steps=12,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(BoringModel())
        assert not strategy.node.is_alive()  # teardown left the run
        lock_data_dir(tmp_path / "volunteer").release()  # and let the directory go
        progress = client.progress(run.id)
    assert progress.samples == 12  # batches of 1, every one reported by the last flush
    assert progress.epoch == 3  # 12 samples, 4 per swarm epoch
    with pytest.raises(ValueError, match="needs both coordinator= and token="):
        SwarmgradStrategy(target_batch_size=4, coordinator=url)


def test_algorithm_diloco_takes_inner_steps_with_the_modules_optimizer(node: Node) -> None:
    from peer.optim.diloco.outer import DiLoCo

    seen: list[Any] = []

    class Model(BoringModel):
        def on_before_backward(self, loss: torch.Tensor) -> None:
            seen.append(self.trainer.optimizers[0])

    model = Model()
    before = [p.detach().clone() for p in model.parameters()]
    strategy = SwarmgradStrategy(
        algorithm="diloco", inner_steps=2, matchmaking_time=0.2, node=node, batch_size=2
    )
    L.Trainer(
        strategy=strategy,
        fast_dev_run=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model)
    opt = seen[0]
    assert isinstance(opt, DiLoCo) and opt.inner_steps == 2
    assert opt.outer_step == 2, "a lone peer applies its own pseudo-gradient every 2 steps"
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="'collaborative' or 'diloco'"):
        SwarmgradStrategy(algorithm="gossip", node=node)
    with pytest.raises(ValueError, match="delay_"):
        SwarmgradStrategy(algorithm="diloco", delay_grad_averaging=True, node=node)
    with pytest.raises(ValueError, match="target_batch_size"):
        SwarmgradStrategy(node=node)


# ------------------------------------------------------------- one strategy, two packages


def _pytorch_lightning() -> Any:
    """``pytorch_lightning`` (the swarmgrad[lightning] extra brings it along), or a skip."""
    try:
        import pytorch_lightning
    except ModuleNotFoundError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("needs the pytorch_lightning package")
    return pytorch_lightning


def test_both_packages_strategies_are_one_implementation() -> None:
    """Each package's class declares only which package it is for: every method, property
    and default is the shared class's own object, none a copy."""
    _pytorch_lightning()
    from peer.integrations import pytorch_lightning as for_pl
    from peer.integrations.lightning_strategy import SwarmgradStrategyBase

    for strategy, package in (
        (SwarmgradStrategy, "lightning.pytorch"),
        (for_pl.SwarmgradStrategy, "pytorch_lightning"),
    ):
        assert set(vars(strategy)) - {
            "__module__",
            "__doc__",
            "__abstractmethods__",
            "_abc_impl",
        } == {"lightning_package"}
        assert strategy.lightning_package.name == package
        assert strategy.__mro__[1] is SwarmgradStrategyBase
        for name in ("optimizer_step", "teardown", "on_train_batch_start", "__init__"):
            assert getattr(strategy, name) is getattr(SwarmgradStrategyBase, name)
    assert for_pl.SwarmScheduler is SwarmScheduler


def test_a_strategy_declared_for_a_package_derives_from_its_strategy() -> None:
    from peer.integrations.lightning_strategy import LightningPackage, SwarmgradStrategyBase

    with pytest.raises(TypeError, match=r"derives from lightning\.pytorch\.strategies\.Strategy"):

        class Detached(SwarmgradStrategyBase):
            lightning_package = LightningPackage.load("lightning.pytorch")


def test_pytorch_lightning_trains_with_its_own_helpers_and_counts_peers_after_fit(
    node: Node,
) -> None:
    """pytorch_lightning's Trainer takes its strategy, which raises pytorch_lightning's
    configuration error and, after fit, gives the last count without asking the swarm."""
    pl = _pytorch_lightning()
    from pytorch_lightning.demos.boring_classes import BoringModel as PlBoringModel
    from pytorch_lightning.utilities.exceptions import (
        MisconfigurationException as PlMisconfigurationException,
    )

    from peer.integrations.pytorch_lightning import SwarmgradStrategy as PlStrategy

    def fit(strategy: Any) -> None:
        pl.Trainer(
            strategy=strategy,
            fast_dev_run=True,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(PlBoringModel())

    strategy = PlStrategy(target_batch_size=1, matchmaking_time=0.2, node=node)
    fit(strategy)
    assert isinstance(strategy.optimizer, Optimizer) and strategy.optimizer.local_epoch == 1
    with mock.patch.object(
        Optimizer, "global_progress", new_callable=mock.PropertyMock, side_effect=AssertionError
    ):
        assert strategy.num_peers == 1
    assert PlMisconfigurationException is not MisconfigurationException
    with pytest.raises(PlMisconfigurationException, match="supports exactly one optimizer"):

        class TwoOptimizers(PlBoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = False

            def training_step(self, batch: Any, batch_idx: int) -> None:
                pass

            def configure_optimizers(self) -> Any:
                return [torch.optim.SGD(self.layer.parameters(), lr=0.1)] * 2

        pl.Trainer(
            strategy=PlStrategy(target_batch_size=1, matchmaking_time=0.2, node=node),
            fast_dev_run=True,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(TwoOptimizers())


def test_num_peers_after_a_diloco_fit_is_the_last_count(node: Node) -> None:
    from peer.optim.diloco.outer import DiLoCo

    strategy = SwarmgradStrategy(
        algorithm="diloco", inner_steps=2, matchmaking_time=0.2, node=node, batch_size=2
    )
    _trainer(strategy).fit(BoringModel())
    assert isinstance(strategy.optimizer, DiLoCo)
    with mock.patch.object(
        DiLoCo, "global_progress", new_callable=mock.PropertyMock, side_effect=AssertionError
    ):
        assert strategy.num_peers == 1
