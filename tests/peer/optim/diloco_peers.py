"""DiLoCo peers in one process for state-sharing tests: honest peers training on threads
over loopback, and a hostile peer that claims a sync and serves outer state of its own
making."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

from peer import DiLoCo, Node
from peer.averaging.sharing.download import StateServer, state_key
from peer.optim.shared.optimizer_state import StateSharingAverager
from peer.optim.shared.progress import ProgressReport, ProgressTracker
from peer.wire import Frame
from swarmlab.node_process import wait_until
from tests.conftest import scaled

RUN = "run"
INNER_STEPS = 8
BATCH = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every peer starts from the same initialisation
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def make_nodes(n: int) -> list[Node]:
    """``n`` nodes on loopback that all know each other."""
    first = Node(gossip_period=0.2)
    made = [first] + [Node(first.visible_addresses, gossip_period=0.2) for _ in range(1, n)]
    assert wait_until(lambda: all(len(x.members()) == n for x in made), scaled(15))
    return made


class Trainer:
    """An honest DiLoCo peer with the run's defaults (but a short matchmaking time, to keep
    the test quick), training on its own thread while :meth:`train` runs. Counts the states
    it adopted."""

    def __init__(self, node: Node, rank: int) -> None:
        self.rank = rank
        self.model = make_model()
        self.adopted: list[int] = []
        self.opt = DiLoCo(
            node=node,
            run_id=RUN,
            params=self.model.parameters(),
            inner_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
            inner_steps=INNER_STEPS,
            batch_size_per_step=BATCH,
            matchmaking_time=0.5,
        )
        host = self.opt.catch_up.host
        adopt = host.adopt

        def counted(epoch: int, metadata: Any, tensors: Sequence[torch.Tensor]) -> None:
            adopt(epoch, metadata, tensors)
            self.adopted.append(epoch)

        self.opt.catch_up.host = dataclasses.replace(host, adopt=counted)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0

    def train_until(self, sync: int) -> None:
        """Train on a thread until this peer reaches ``sync`` (or :meth:`pause`)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(sync,), daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def pause(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(scaled(60))
            assert not self._thread.is_alive(), "a training step did not return"

    def _loop(self, sync: int) -> None:
        g = torch.Generator().manual_seed(self.rank)
        while not self._stop.is_set() and self.sync < sync:
            x = torch.randn(BATCH, 4, generator=g)
            loss = ((self.model(x) - x.sum(dim=1, keepdim=True).sin()) ** 2).mean()
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            self.steps += 1

    @property
    def sync(self) -> int:
        return self.opt.local_epoch

    def outer_state(self) -> list[torch.Tensor]:
        """The outer state this peer would serve (outer parameters, outer optimizer)."""
        with self.opt.shared.lock():
            return self.opt.shared.snapshot()[1]

    def largest_outer_value(self) -> float:
        return max(float(t.abs().max()) for t in self.outer_state())

    def close(self) -> None:
        self.pause()
        self.opt.shutdown()


class _CountingServer(StateServer):
    """A donor side that counts the downloads each peer begins."""

    begun: collections.Counter[str]

    async def on_begin(self, link: Any, frame: Frame) -> Frame:
        self.begun[link.peer_id] += 1
        return await super().on_begin(link, frame)


class Forger:
    """A hostile peer of the run: it reports sync ``sync`` and declares itself a donor of
    that sync's outer state, which it makes of ``value`` everywhere (shaped as the honest
    peers' ``shapes``). Counts the downloads each honest peer begins from it."""

    def __init__(
        self, node: Node, shapes: Sequence[torch.Size], sync: int, value: float = 1000.0
    ) -> None:
        self.node = node
        self.downloads: collections.Counter[str] = collections.Counter()
        begun = self.downloads

        def server(*args: Any) -> StateServer:
            made = _CountingServer(*args)
            made.begun = begun
            return made

        class Averager(StateSharingAverager):
            state_server_class = server

        self.averager = Averager(
            [torch.zeros(1)],
            node,
            lambda: ({"epoch": sync}, [torch.full(s, value) for s in shapes]),
            prefix=f"{RUN}_diloco_state",
            start=True,
        )
        self.averager.state_sharing_priority = float(sync)
        self.tracker = ProgressTracker(node, RUN, INNER_STEPS)
        self.tracker.report(ProgressReport(node.peer_id, sync, 0, 0, node.get_time(), 0.0, False))

    def seen_by(self, trainer: Trainer) -> bool:
        """Whether ``trainer``'s node holds this peer's claim and its declaration."""
        me = self.node.peer_id
        declared = trainer.opt.node.get(state_key(f"{RUN}_diloco_state"))
        return (
            any(r.peer_id == me for r in trainer.opt.tracker.fetch())
            and declared is not None
            and me in declared.value
        )

    def close(self) -> None:
        self.tracker.shutdown()
        self.averager.shutdown()
