"""One peer of a DiLoCo test, as its own process (not collected by pytest).

Prints one JSON line with its addresses, trains until ``--syncs`` syncs are done (printing
``{"epoch": n}`` as it reaches each, as ``collab_worker.py`` does, so the helpers of
``collab_swarm.py`` read it), then writes its final parameters to ``--out`` with torch.save
and stays until every expected peer is done (serving its state meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from peer import DiLoCo, Node
from peer.averaging.allreduce.round import ButterflyRound, Idle, Send
from peer.averaging.control import AveragingStage, StepControl
from peer.formats.identity import OpenAuth
from peer.optim.shared.progress import ProgressTracker

RUN_ID = "diloco-test"


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def die_once_the_allreduce_runs(control: StepControl) -> None:
    """SIGKILL this process (no goodbye) as soon as ``control``'s all-reduce has begun."""

    def watch() -> None:
        while control.stage not in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED):
            if control.done():
                break
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def die_owing_one_average() -> None:
    """From now on this peer sends its averages to one other member only (the lowest peer
    id), and is SIGKILLed once they are all out: the other members are owed them and
    nothing this peer sends fails, so only their watchdogs see it go."""
    real_next_send, real_sent = ButterflyRound.next_send, ButterflyRound.sent
    out: dict[int, int] = {}  # parts of averages sent, per round

    def favoured(machine: ButterflyRound) -> str:
        return min(p for p in machine.peer_index if p != machine.me)

    def next_send(self: ButterflyRound, peer_id: str) -> Send | Idle:
        send = real_next_send(self, peer_id)
        if isinstance(send, Send) and send.kind == "avg" and peer_id != favoured(self):
            return Idle.WAIT  # withheld: that member is owed it
        return send

    def sent(self: ButterflyRound, now: float, send: Send, error: str | None = None) -> list:
        commands = real_sent(self, now, send, error)
        if send.kind == "avg" and send.peer_id == favoured(self) and error is None:
            out[id(self)] = out.get(id(self), 0) + send.count
            if self.reducer is not None and out[id(self)] == self.reducer.num_parts:
                # (a moment for the frames to leave the socket before the kill resets it)
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return commands

    ButterflyRound.next_send = next_send  # type: ignore[method-assign]
    ButterflyRound.sent = sent  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--syncs", type=int, required=True)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--done-dir", required=True)
    parser.add_argument("--expected", type=int, required=True, help="peers that will finish")
    parser.add_argument("--wait-peers", type=int, default=0, help="train once this many report")
    parser.add_argument(
        "--wait-members", type=int, default=0, help="start once this many nodes are up"
    )
    parser.add_argument("--join-at-sync", type=int, default=0)
    parser.add_argument("--die-in-sync", type=int, default=-1)
    parser.add_argument(
        "--owing-one-average",
        action="store_true",
        help="die in that sync once its averages reached one member only (not as it begins)",
    )
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--silence", type=float, default=3.0)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    import logging

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    node = Node(
        [args.initial_peer] if args.initial_peer else None,
        auth=OpenAuth(),
        gossip_period=0.2,
        member_ttl=10.0,
    )
    print(json.dumps({"addresses": node.visible_addresses, "peer_id": node.peer_id}), flush=True)
    deadline = time.monotonic() + 240
    while len(node.members()) < args.wait_members and time.monotonic() < deadline:
        time.sleep(0.05)
    if args.join_at_sync:
        tracker = ProgressTracker(node, RUN_ID, 1)
        while (
            max((r.epoch for r in tracker.fetch(fresh=True)), default=0) < args.join_at_sync
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
    model = make_model()
    opt = DiLoCo(
        node=node,
        run_id=RUN_ID,
        params=model.parameters(),
        inner_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        overlap=args.overlap,
        compression=args.compression,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=30.0,
        straggler_silence=args.silence,
        load_state_timeout=30.0,
        verbose=args.verbose,
        averager_opts={"sender_timeout": 2.0, "reducer_timeout": 4.0},
    )
    joined_at = opt.outer_step
    while opt.tracker.others_reporting() < args.wait_peers - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if args.die_in_sync >= 0:
        for averager in opt.averagers:
            real_step = averager.step

            def step_then_die(*a: object, _real=real_step, **kw: object) -> object:
                dying = opt.outer_step == args.die_in_sync
                if dying and args.owing_one_average:
                    die_owing_one_average()
                control = _real(*a, **kw)
                if dying and not args.owing_one_average and isinstance(control, StepControl):
                    die_once_the_allreduce_runs(control)
                return control

            averager.step = step_then_die  # type: ignore[method-assign]
    step = 0
    seen = opt.outer_step
    while opt.outer_step < args.syncs and time.monotonic() < deadline:
        x, y = batch(args.rank, step)
        step += 1
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step(batch_size=len(x))
        opt.zero_grad()
        if args.step_delay:
            time.sleep(args.step_delay)
        if opt.outer_step != seen:
            seen = opt.outer_step
            print(json.dumps({"epoch": seen}), flush=True)
    if not opt.wait_for_pending(timeout=60):
        raise SystemExit("the last background round did not finish")
    torch.save(
        {
            "params": [p.detach().clone() for p in model.parameters()],
            "outer": [p.detach().clone() for p in opt.outer_params],
            "sync": opt.outer_step,
            "joined_at": joined_at,
            "rounds": [opt.rounds_done, opt.rounds_failed, opt.last_group_size],
        },
        args.out,
    )
    Path(args.done_dir, f"{args.rank}.done").touch()
    while (
        len(list(Path(args.done_dir).glob("*.done"))) < args.expected
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    opt.shutdown()
    node.shutdown()


if __name__ == "__main__":
    main()
