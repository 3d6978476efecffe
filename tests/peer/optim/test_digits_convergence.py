"""On the built-in digits task, 4 peers — with DecentralizedSGD, HierarchicalModelAverager or
DASO — reach test accuracy within 2 points of one process trained on as many samples.

The peers run as threads of this process, each with its own Node over WebSocket on
loopback (robust on a 2-core machine: no interpreter start-up per peer); ``bench/train.py``
runs them as processes and also compares throughput.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from peer import Node
from peer.tasks.digits import (
    DigitsConfig,
    TrainResult,
    load_digits_split,
    shard_indices,
    train_peer,
    train_single,
)
from swarmlab.digits_compare import METHODS, train_peer_with
from swarmlab.node_process import wait_until
from tests.conftest import scaled


def test_shards_partition_the_training_set() -> None:
    data = load_digits_split(seed=0)
    n = len(data.y_train)
    shards = [shard_indices(n, 4, i) for i in range(4)]
    assert sorted(int(i) for s in shards for i in s) == list(range(n))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    again = load_digits_split(seed=0)
    assert (again.x_test == data.x_test).all() and (again.y_train == data.y_train).all()


def _four_peers(train) -> list[TrainResult]:
    """Run ``train(node, i)`` for 4 peers in threads, each with its own node."""
    nodes = [Node(gossip_period=0.2)]
    nodes += [Node(nodes[0].visible_addresses, gossip_period=0.2) for _ in range(3)]
    results: list[TrainResult | BaseException | None] = [None] * 4

    def run(i: int) -> None:
        try:
            results[i] = train(nodes[i], i)
        except BaseException as exc:
            results[i] = exc

    try:
        assert wait_until(lambda: all(len(n.members()) == 4 for n in nodes), scaled(15))
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(scaled(240))
        assert not any(thread.is_alive() for thread in threads)
    finally:
        for node in nodes:
            node.shutdown()
    for result in results:
        assert isinstance(result, TrainResult), result
    return [r for r in results if isinstance(r, TrainResult)]


@pytest.mark.slow
def test_four_decentralized_sgd_peers_match_one_process() -> None:
    config = DigitsConfig(epochs=10)
    data = load_digits_split(config.seed)
    single = train_single(config, data)
    peers = _four_peers(
        lambda node, i: train_peer(
            node, i, 4, config, data=data, start_timeout=scaled(60), finish_timeout=scaled(60)
        )
    )
    assert sum(r.samples for r in peers) == single.samples  # the same sample budget
    assert all(r.averaging_rounds >= 1 for r in peers)
    for r in peers:
        assert r.accuracy >= single.accuracy - 0.02, (r.accuracy, single.accuracy)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["hierarchical", "daso"])
def test_four_peers_with_levels_match_one_process(method: str) -> None:
    config = DigitsConfig(epochs=10)
    data = load_digits_split(config.seed)
    single = train_single(config, data)
    peers = _four_peers(
        lambda node, i: train_peer_with(
            node, i, 4, config, method, data=data, start_timeout=scaled(60)
        )
    )
    # every peer covers its shard's share each epoch: at least the single process's samples
    assert single.samples <= sum(r.samples for r in peers) <= single.samples * 1.05
    assert all(r.averaging_rounds >= config.epochs for r in peers)
    assert all(r.bytes_sent > 0 for r in peers)
    for r in peers:
        assert r.accuracy >= single.accuracy - 0.02, (r.accuracy, single.accuracy)


@pytest.mark.slow
def test_bench_train_prints_the_methods_side_by_side() -> None:
    bench = Path(__file__).resolve().parents[3] / "bench" / "train.py"
    small = ["--peers", "2", "--epochs", "2", "--batch-size", "64"]
    # Two methods show the table and its ratios against the reference; each method's
    # training is checked by the tests above (the docs' figures run them all).
    shown = ("collaborative", "hierarchical")
    done = subprocess.run(
        [sys.executable, str(bench), "--methods", ",".join(shown), *small],
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert done.returncode == 0, done.stderr
    rows = {
        line.split()[0]: line.split()[1:]
        for line in done.stdout.splitlines()
        if line.strip().split(" ")[0] in METHODS
    }
    assert set(rows) == set(shown), done.stdout
    assert rows["collaborative"][-2:] == ["1.00", "1.00"]  # the reference
    for method in set(shown) - {"collaborative"}:
        accuracy, _gap, samples, per_sample, per_epoch, *ratios = rows[method]
        assert 0.5 < float(accuracy) <= 1 and int(samples) > 0
        assert float(per_sample) > 0 and float(per_epoch) > 0 and len(ratios) == 2
