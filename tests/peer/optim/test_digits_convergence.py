"""Point 7 of issue 5: on the built-in digits task, 4 DecentralizedSGD peers reach test
accuracy within 2 points of one process trained on the same number of samples.

The peers run as threads of this process, each with its own Node over WebSocket on
loopback (robust on a 2-core machine: no interpreter start-up per peer); ``bench/train.py``
runs them as processes and also compares throughput.
"""

from __future__ import annotations

import threading

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
from peer.testing import wait_until
from tests.conftest import scaled


def test_shards_partition_the_training_set() -> None:
    data = load_digits_split(seed=0)
    n = len(data.y_train)
    shards = [shard_indices(n, 4, i) for i in range(4)]
    assert sorted(int(i) for s in shards for i in s) == list(range(n))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    again = load_digits_split(seed=0)
    assert (again.x_test == data.x_test).all() and (again.y_train == data.y_train).all()


@pytest.mark.slow
def test_four_decentralized_sgd_peers_match_one_process() -> None:
    config = DigitsConfig(epochs=20)
    data = load_digits_split(config.seed)
    single = train_single(config, data)
    nodes = [Node(gossip_period=0.2)]
    nodes += [Node(nodes[0].visible_addresses, gossip_period=0.2) for _ in range(3)]
    results: list[TrainResult | BaseException | None] = [None] * 4

    def run(i: int) -> None:
        try:
            results[i] = train_peer(
                nodes[i],
                i,
                4,
                config,
                data=data,
                start_timeout=scaled(60),
                finish_timeout=scaled(60),
            )
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
    peers = [r for r in results if isinstance(r, TrainResult)]
    assert sum(r.samples for r in peers) == single.samples  # the same sample budget
    assert all(r.averaging_rounds >= 1 for r in peers)
    for r in peers:
        assert r.accuracy >= single.accuracy - 0.02, (r.accuracy, single.accuracy)
