"""Scripts ported from the originals (hivemind, Lightning's HivemindStrategy, torch's
HierarchicalModelAverager) get the originals' behaviour, or a refusal at construction that
says why (docs/porting.md)."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from peer import Node
from peer.integrations.hivemind_options import map_dht_options
from peer.optim.decentralized.optimizers import (
    DecentralizedAdam,
    DecentralizedOptimizer,
    DecentralizedSGD,
)
from peer.optim.hierarchy.hierarchical import HierarchicalModelAverager
from tests.conftest import scaled

NEVER = 10**9  # an averaging period that never comes: no background round in these tests


@pytest.fixture
def node() -> Iterator[Node]:
    with Node(gossip_period=0.2) as n:
        yield n


# --------------------------------------------------------------- HierarchicalModelAverager


def test_a_level_above_the_world_without_a_node_is_refused_at_construction() -> None:
    """torch refuses a group larger than the world when the averager is built (its
    new_subgroups); so does this one, with torch's words, when no node could average it."""
    with pytest.raises(ValueError, match=r"The arg 'group_size' \(2\) must not exceed the world"):
        HierarchicalModelAverager({2: 2, 4: 1})
    with pytest.raises(ValueError, match=r"group_size' \(all online\) must not exceed"):
        HierarchicalModelAverager({2: None, 4: 1})
    # the last level must still be the world, as in torch
    with pytest.raises(ValueError, match=r"must be equal to the size of arg ``process_group`` 1"):
        HierarchicalModelAverager({2: 1, 4: 2})
    HierarchicalModelAverager({2: 1})  # a world of one: accepted, averages alone


# ---------------------------------------------------------------- hivemind's DHT options


def test_host_maddrs_map_onto_the_nodes_host_and_port() -> None:
    options: dict[str, Any] = {
        "host_maddrs": ["/ip4/127.0.0.1/tcp/4321", "/ip4/0.0.0.0/udp/0/quic"]
    }
    assert map_dht_options("0.0.0.0", 0, options) == ("127.0.0.1", 4321)
    assert options == {}  # taken out: nothing reaches the optimizer
    assert map_dht_options("0.0.0.0", 0, {"host_maddrs": "/ip6/::1/tcp/0"}) == ("::1", 0)
    # hivemind's defaults of options without a counterpart are accepted and taken out
    defaults: dict[str, Any] = {"use_ipfs": False, "wait_timeout": 3, "use_relay": True, "x": 1}
    assert map_dht_options("0.0.0.0", 7, defaults) == ("0.0.0.0", 7)
    assert defaults == {"x": 1}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"host_maddrs": ["/ip4/0.0.0.0/tcp/1", "/ip4/0.0.0.0/tcp/2"]}, "one TCP address"),
        ({"host_maddrs": ["/ip4/0.0.0.0/udp/0/quic"]}, "these name 0"),
        ({"host_maddrs": ["0.0.0.0:80"]}, "not a multiaddr"),
        ({"host_maddrs": ["/ip4/1.2.3.4/tcp/1/p2p/Qm"]}, "more than a host and a TCP port"),
        ({"host_maddrs": ["/ip4/1.2.3.4/tcp/99999"]}, "names no TCP port"),
        ({"use_ipfs": True}, "use_ipfs=True has no counterpart here: there is no IPFS"),
        ({"identity_path": "key.pem"}, "identity_path='key.pem' has no counterpart"),
    ],
)
def test_dht_options_without_a_counterpart_are_refused(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        map_dht_options("0.0.0.0", 0, options)


def test_host_maddrs_and_a_different_host_are_refused() -> None:
    with pytest.raises(ValueError, match="pass one of them"):
        map_dht_options("10.0.0.1", 0, {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"]})


# ------------------------------------------------------------------ DecentralizedOptimizer


def _adam(node: Node, net: torch.nn.Module, **kwargs: Any) -> DecentralizedAdam:
    return DecentralizedAdam(
        net.parameters(),
        0.05,
        node=node,
        prefix="ports",
        target_group_size=2,
        averaging_steps_period=NEVER,
        timeout=scaled(5),  # the seed's defaults: max_allowed_epoch_difference=1, 1000 steps
        **kwargs,
    )


def _train(opt: DecentralizedOptimizer, net: torch.nn.Module, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        opt.step()


def test_the_decentralized_optimizer_is_a_torch_optimizer_for_schedulers(node: Node) -> None:
    net = torch.nn.Linear(4, 2)
    opt = DecentralizedSGD(
        net.parameters(),
        0.1,
        node=node,
        prefix="sched",
        target_group_size=2,
        averaging_steps_period=NEVER,
        max_allowed_epoch_difference=1,
        total_steps_in_epoch=1000,
    )
    try:
        assert isinstance(opt, torch.optim.Optimizer)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        _train(opt, net, 1, seed=0)
        scheduler.step()
        assert opt.opt.param_groups[0]["lr"] == pytest.approx(0.05)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
        with pytest.raises(ValueError, match="does not take parameter groups after construction"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    finally:
        opt.shutdown()


def test_state_dict_round_trip_restores_the_averaged_statistics_in_place(node: Node) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = _adam(node, net)
    try:
        _train(opt, net, 3, seed=1)
        saved = copy.deepcopy(opt.state_dict())  # as torch.save would: torch's refers to the state
        kept = {k: v.clone() for k, v in opt.opt.state[net.weight].items()}
        held = opt.opt.state[net.weight]["exp_avg_sq"]  # the tensor the averager averages
        assert saved["local_step"] == 3
        _train(opt, net, 2, seed=2)
        assert not torch.equal(held, kept["exp_avg_sq"])
        opt.load_state_dict(saved)
        restored = opt.opt.state[net.weight]
        assert restored["exp_avg_sq"] is held, "the averager's tensor is kept, refilled"
        for name, value in kept.items():
            assert torch.equal(restored[name], value), name
        assert opt.local_step == 3
        with pytest.raises(ValueError, match="no 'optimizer' entry"):
            opt.load_state_dict(opt.opt.state_dict())
    finally:
        opt.shutdown()


def test_hiveminds_older_name_loads_state_from_peers(node: Node) -> None:
    net = torch.nn.Linear(4, 2)
    opt = _adam(node, net)
    try:
        assert (
            DecentralizedOptimizer.load_states_from_peers
            is DecentralizedOptimizer.load_state_from_peers
        )
        assert opt.load_states_from_peers(timeout=0.5) is False  # nobody to load from
        assert opt.is_synchronized()  # alone: never behind
        assert (opt.config.max_allowed_epoch_difference, opt.config.total_steps_in_epoch) == (
            1,
            1000,
        )
    finally:
        opt.shutdown()


# ---------------------------------------------------------------------------- Lightning
# (the swarmgrad[lightning] extra, which `make test` installs, brings both packages)

_LIGHTNING_WARNINGS = (
    # Lightning's own use of a torch API that torch has since deprecated
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"
)


def _lightning(package: str) -> tuple[Any, Any]:
    """The package (lightning.pytorch or pytorch_lightning) and its BoringModel."""
    import importlib

    try:
        trainer_module = importlib.import_module(package)
    except ModuleNotFoundError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("needs the swarmgrad[lightning] extra")
    return trainer_module, importlib.import_module(f"{package}.demos.boring_classes").BoringModel


def _fit(trainer_module: Any, boring: Any, strategy: Any) -> Any:
    trainer = trainer_module.Trainer(
        strategy=strategy,
        fast_dev_run=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = boring()
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    return trainer


@pytest.mark.filterwarnings(_LIGHTNING_WARNINGS)
@pytest.mark.parametrize(
    ("package", "integration"),
    [("lightning.pytorch", "lightning"), ("pytorch_lightning", "pytorch_lightning")],
)
def test_each_lightning_package_trains_with_its_strategy_and_counts_peers_after_fit(
    node: Node, package: str, integration: str
) -> None:
    import importlib

    trainer_module, boring = _lightning(package)
    strategy_class = importlib.import_module(f"peer.integrations.{integration}").SwarmgradStrategy
    strategy = strategy_class(target_batch_size=1, matchmaking_time=0.2, node=node)
    assert isinstance(strategy, trainer_module.strategies.Strategy)
    trainer = _fit(trainer_module, boring, strategy)
    assert trainer.strategy is strategy
    assert strategy.optimizer.local_epoch == 1
    assert strategy.num_peers == 1  # after fit, as hivemind's: the last count, no exception


@pytest.mark.filterwarnings(_LIGHTNING_WARNINGS)
def test_the_strategy_maps_host_maddrs_at_construction_and_trains() -> None:
    pl, boring = _lightning("lightning.pytorch")
    from peer.integrations.lightning import SwarmgradStrategy

    with pytest.raises(ValueError, match="use_ipfs=True has no counterpart"):
        SwarmgradStrategy(target_batch_size=1, use_ipfs=True)
    strategy = SwarmgradStrategy(
        target_batch_size=1,
        matchmaking_time=0.2,
        host="127.0.0.1",  # hivemind's default multiaddrs name any interface: this one agrees
        host_maddrs=["/ip4/127.0.0.1/tcp/0", "/ip4/0.0.0.0/udp/0/quic"],
    )
    assert strategy.node.visible_addresses
    assert all("127.0.0.1" in a for a in strategy.node.visible_addresses)
    _fit(pl, boring, strategy)  # nothing of hivemind's options reached the optimizer
