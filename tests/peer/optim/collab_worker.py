"""One peer of a collaborative-optimizer test, as its own process (not collected by pytest).

Prints one JSON line with its addresses, trains ``--epochs`` epochs on its deterministic
shard (printing ``{"epoch": n}`` as it reaches each), then writes its final parameters (and
epoch) to ``--out`` with torch.save.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from peer import Node
from peer.formats.identity import OpenAuth
from peer.optim.collaborative.optimizer import Optimizer
from peer.optim.shared.progress import ProgressTracker


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(rank: int, epoch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * epoch + rank)
    x = torch.randn(size, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def make_optimizer(name: str):
    if name == "sgd":
        return partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    if name == "plain-sgd":
        return partial(torch.optim.SGD, lr=1.0)
    return partial(torch.optim.Adam, lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--batch-sizes", type=str, required=True)  # e.g. 8,16,32
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--done-dir", required=True)
    parser.add_argument(
        "--start-epoch-wait",
        type=int,
        default=0,
        help="join only after the swarm reaches this epoch",
    )
    parser.add_argument(
        "--wait-peers",
        type=int,
        default=0,
        help="train once this many peers (this one included) report progress: a peer alone "
        "in the run skips its rounds, so one that starts first would train ahead alone",
    )
    parser.add_argument("--matchmaking-time", type=float, default=1.5)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (an emulated network's, e.g.): the swarm is open",
    )
    parser.add_argument(
        "--member-ttl", type=float, default=30.0, help="a silent peer leaves after this long"
    )
    parser.add_argument(
        "--target-group-size",
        type=int,
        default=0,
        help="groups assemble as soon as this many peers are in (0: after the matchmaking time)",
    )
    parser.add_argument(
        "--sender-timeout",
        type=float,
        default=10.0,
        help="a round excludes a member silent this long as a sender (twice as long as a reducer)",
    )
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--average-state-every", type=int, default=1)
    parser.add_argument(
        "--continuous", action="store_true", help="train new batches until the epoch advances"
    )
    parser.add_argument("--delay-grad-averaging", action="store_true")
    parser.add_argument("--delay-optimizer-step", action="store_true")
    parser.add_argument(
        "--die-in-round", type=int, default=-1, help="SIGKILL itself during this epoch's averaging"
    )
    args = parser.parse_args()
    import logging

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    node = Node(
        [args.initial_peer] if args.initial_peer else None,
        host=args.host,
        auth=OpenAuth(),
        gossip_period=0.2,
        member_ttl=args.member_ttl,
    )
    logging.getLogger("collab_worker").info("rank %d is peer %s", args.rank, node.peer_id)
    print(json.dumps({"addresses": node.visible_addresses, "peer_id": node.peer_id}), flush=True)
    deadline = time.monotonic() + 300
    if args.start_epoch_wait:
        # A latecomer: wait until the swarm is at that epoch before joining it.
        tracker = ProgressTracker(node, "collab-test", sum(sizes))

        def swarm_epoch() -> int:
            return max((r.epoch for r in tracker.fetch(fresh=True)), default=0)

        while swarm_epoch() < args.start_epoch_wait and time.monotonic() < deadline:
            time.sleep(0.1)
    model = make_model()
    opt = Optimizer(
        node=node,
        run_id="collab-test",
        target_batch_size=sum(sizes),
        optimizer=make_optimizer(args.optimizer),
        params=model.parameters(),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=30.0,
        load_state_timeout=30.0,
        verbose=args.verbose,
        average_state_every=args.average_state_every,
        delay_grad_averaging=args.delay_grad_averaging,
        delay_optimizer_step=args.delay_optimizer_step or None,
        averager_opts={
            "target_group_size": args.target_group_size or None,
            "sender_timeout": args.sender_timeout,
            "reducer_timeout": 2 * args.sender_timeout,
        },
    )
    while opt.tracker.others_reporting() < args.wait_peers - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    joined_at = opt.local_epoch
    if args.die_in_round >= 0:
        real_step = opt.grad_averager.step

        def step_then_die(*a: object, **kw: object) -> object:
            if opt.local_epoch == args.die_in_round:
                # Dies in the middle of this round's matchmaking / all-reduce, without cleanup.
                threading.Timer(
                    args.matchmaking_time * 0.8, os.kill, (os.getpid(), signal.SIGKILL)
                ).start()
            return real_step(*a, **kw)

        opt.grad_averager.step = step_then_die  # type: ignore[method-assign]
    trace: list = []
    counter = 0
    overlapped = 0  # batches accumulated while a background epoch was still pending
    while opt.local_epoch < args.epochs and time.monotonic() < deadline:
        epoch = opt.local_epoch
        x, y = batch(args.rank, counter if args.continuous else epoch, sizes[args.rank])
        counter += 1
        overlapped += opt.pending_update
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step(batch_size=sizes[args.rank])
        opt.zero_grad()
        while not args.continuous and opt.local_epoch == epoch and time.monotonic() < deadline:
            # Nothing new to add: take part in the swarm's progress until the epoch advances.
            opt.step(batch_size=0)
            time.sleep(0.05)
        if opt.local_epoch != epoch:
            trace.append([p.detach().clone() for p in model.parameters()])
            print(json.dumps({"epoch": opt.local_epoch}), flush=True)
    if not opt.wait_for_pending(timeout=120):  # the last epoch's delayed update, if any
        raise SystemExit("the last background epoch did not finish")
    result = {
        "params": [p.detach() for p in model.parameters()],
        "epoch": opt.local_epoch,
        "joined_at": joined_at,
        "trace": trace,
        "overlapped": overlapped,
        "rounds": [opt.rounds_done, opt.rounds_failed, opt.last_group_size],
    }
    torch.save(result, args.out)
    Path(args.done_dir, f"{args.rank}.done").touch()
    # Stay for the others' last rounds and state downloads.
    world = len(list(Path(args.done_dir).glob("*.expected"))) or len(sizes)
    while len(list(Path(args.done_dir).glob("*.done"))) < world and time.monotonic() < deadline:
        opt.step(batch_size=0)
        time.sleep(0.1)
    opt.shutdown()
    node.shutdown()


if __name__ == "__main__":
    main()
