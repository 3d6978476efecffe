"""One process of a HierarchicalModelAverager or DASO test (not collected by pytest).

A "machine" is a gloo world of ``--local-size`` processes (``--store-port`` is its rendezvous;
a world of one does not initialise torch.distributed). Its rank 0 holds a Node and prints one
JSON line with its addresses. Every process writes what it saw to ``--out`` (torch.save).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from peer import DecentralizedAverager, Node
from peer.averaging.allreduce.round import ButterflyRound
from peer.averaging.allreduce.runner import AllreduceRunner
from peer.averaging.allreduce.send import RoundSending
from peer.wire import Frame
from swarmlab.node_process import wait_until

DONE_KEY = "levels-test.done"

# (prefix, dtype, payload bytes, elements, parts): adjacent plain parts share a frame
WIRE: list[tuple[str, str, int, int, int]] = []


class RecordingSending(RoundSending):
    """Records what every tensor frame this process sends carries; with ``die_in_round``
    set, SIGKILLs this process as it sends the first part of that round (1-based)."""

    die_in_round = 0
    rounds: set[bytes] = set()

    def _frame(self, kind: str, r: int, index: int, count: int = 1) -> Frame:
        type(self).rounds.add(self.group.group_id)
        if kind == "part" and len(type(self).rounds) == self.die_in_round:
            os.kill(os.getpid(), signal.SIGKILL)
        frame = super()._frame(kind, r, index, count)
        header = frame.fields.get("c")
        if header is not None:
            numel = 1
            for n in header["shape"]:
                numel *= n
            nbytes = memoryview(frame.payload).nbytes
            WIRE.append((self.prefix, header["dtype"], nbytes, numel, count))
        return frame


class RecordingRound(ButterflyRound):
    sending_class = RecordingSending


class RecordingRunner(AllreduceRunner):
    round_class = RecordingRound


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["hma", "daso"], required=True)
    parser.add_argument("--index", type=int, required=True, help="global index (data, init)")
    parser.add_argument("--local-rank", type=int, default=0)
    parser.add_argument("--local-size", type=int, default=1)
    parser.add_argument("--store-port", type=int, default=0)
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--peers", type=int, required=True, help="machines in the swarm")
    parser.add_argument("--levels", default="2:2,4:4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--last-batch", type=int, default=3)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--die-in-round", type=int, default=0, help="with --die-index")
    parser.add_argument("--die-index", type=int, default=-1, help="the process that dies")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # on stderr: the test shows it when something goes wrong
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)6.0f %(name)s %(message)s")
    # the optimizers build their averagers themselves: every one in this process records
    DecentralizedAverager.runner_class = RecordingRunner
    if args.index == args.die_index:
        RecordingSending.die_in_round = args.die_in_round
    if args.local_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.store_port}",
            rank=args.local_rank,
            world_size=args.local_size,
        )
    node = None
    if args.local_rank == 0:
        node = Node([args.initial_peer] if args.initial_peer else None, gossip_period=0.2)
        print(json.dumps({"addresses": node.visible_addresses}), flush=True)
        # members() counts this node too: every machine known before the first round
        if not wait_until(lambda: len(node.members()) >= args.peers, 60, 0.05):
            raise SystemExit("the other machines did not show up")
    if args.local_size > 1:
        dist.barrier()  # every machine's leader sees the others: start together
    torch.manual_seed(args.index)
    model = torch.nn.Linear(6, 3)
    result: dict[str, Any] = (_hma if args.mode == "hma" else _daso)(args, model, node)
    result["wire"] = WIRE
    torch.save(result, args.out)
    if args.local_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    if node is not None:
        # a machine told to die never says it is done
        _leave_together(node, args.peers - (args.die_index >= 0))


def _leave_together(node: Any, machines: int) -> None:
    """Shut down only once every machine's leader says it is done: a peer that left at once
    could take with it a last average that a slower peer had not read yet."""
    node.store(DONE_KEY, True, node.get_time() + 120, subkey=node.peer_id)

    def everyone_done() -> bool:
        found = node.get(DONE_KEY)
        return found is not None and isinstance(found.value, dict) and len(found.value) >= machines

    if not wait_until(everyone_done, 60, 0.05):
        raise SystemExit("the other machines did not finish")
    node.shutdown()


def _hma(args: argparse.Namespace, model: torch.nn.Module, node: Any) -> dict[str, Any]:
    from peer.optim.hierarchy.hierarchical import HierarchicalModelAverager

    levels = {}
    for item in args.levels.split(","):
        period, size = item.split(":")
        levels[int(period)] = None if size == "all" else int(size)
    averager = HierarchicalModelAverager(
        levels,
        warmup_steps=args.warmup,
        node=node,
        prefix="hma-test",
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=20.0,
    )
    snapshots, group_sizes = [], []
    for step in range(args.steps):
        # a local step that differs on every process
        for p in model.parameters():
            p.grad = torch.full_like(p, float(args.index + 1))
            with torch.no_grad():
                p -= 0.01 * (step + 1) * p.grad
        averager.average_parameters(model.parameters())
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        sizes = {
            period: level.last_group_size
            for period, level in averager._swarm.items()
            if level is not None
        }
        group_sizes.append(sizes)
    averager.shutdown()
    return {
        "snapshots": snapshots,
        "group_sizes": group_sizes,
        "rounds": averager.rounds,
        "skipped": averager.skipped,
    }


def _daso(args: argparse.Namespace, model: torch.nn.Module, node: Any) -> dict[str, Any]:
    from peer.optim.hierarchy.daso import DASO

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    daso = DASO(
        opt,
        total_epochs=args.epochs,
        warmup_epochs=1,
        cooldown_epochs=1,
        max_global_skips=4,
        sending_chunk_size=7,
        node=node,
        prefix="daso-test",
        target_group_size=args.peers,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=20.0,
    )
    daso.set_model(model)
    daso.last_batch = args.last_batch
    gen = torch.Generator().manual_seed(args.index)
    at_epoch_end, schedule = [], []
    for _ in range(args.epochs):
        for _ in range(args.last_batch + 1):
            x = torch.randn(16, 6, generator=gen)
            y = x[:, :3] * (1 + args.index)
            daso.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            daso.step()
        at_epoch_end.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        daso.epoch_loss_logic(loss)
        schedule.append((daso.global_skip, daso.local_skip, daso.batches_to_wait))
    daso.shutdown()
    return {
        "at_epoch_end": at_epoch_end,
        "schedule": schedule,
        "epoch": daso.epoch,
        "rounds": (daso.global_rounds_done, daso.global_rounds_skipped),
    }


if __name__ == "__main__":
    main()
