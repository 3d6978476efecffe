"""Run an averager in its own OS process and drive it over a line protocol (for tests).

``python -m swarmlab.averager_process --tensors PATH [--initial-peer ADDR] [--config JSON]
[--fault KIND] [--client-mode]`` starts a node and an averager over the tensors saved at
``PATH`` (``torch.save`` of a list), prints ``{"peer_id": ..., "addresses": [...]}`` and
answers JSON commands on standard input, one per line::

    {"cmd": "members"}                          -> {"members": <count>}
    {"cmd": "step", "kw": {...}, "out": PATH}   -> {"ok": true, "gathered": {...}}
                                                   or {"ok": false, "error": "Class: message"}
                                                   (tensors saved to PATH either way)
    {"cmd": "load_state", "out": PATH}          -> {"ok": bool, "metadata": ..., "donor": ...}
    {"cmd": "sharing", "allow": B, "priority": P} -> {"ok": true}
    {"cmd": "donors"}                           -> {"donors": [peer ids, best first]}
    {"cmd": "quit"}                             -> {"ok": true}, then exits

``--fault`` injects one misbehaviour (:func:`faulty_runner` lists the kinds).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys
from typing import Any

import torch

from peer.averaging.allreduce.round import ButterflyRound
from peer.averaging.allreduce.runner import AllreduceRunner, RunnerFactory
from peer.averaging.allreduce.send import RoundSending
from peer.averaging.protocol import PART
from peer.averaging.seam import Link
from peer.averaging.sharing.download import StateServer
from peer.wire import Frame
from swarmlab import child_env
from swarmlab.averager_doubles import averager_with
from swarmlab.node_process import ChildProcess, serve_json_lines
from swarmlab.send_gate import gated_runner

FAULTS = (
    "kill_after_first_part",
    "stall_after_first_part",
    "freeze_after_first_part",
    "kill_while_reducing",
    "nan",
    "wrong_length",
    "oversized",
    "kill_mid_state",
)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultySending(RoundSending):
    """A round's sending side whose frames misbehave as ``fault`` says (``nan``,
    ``wrong_length``, ``oversized``, ``bad_range``; others leave its frames alone)."""

    max_batch_bytes = 0  # one part per frame: faults land between parts

    def __init__(self, *, fault: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault = fault

    def _contribution_wire(self, r: int, index: int) -> tuple[dict[str, Any], Any]:
        header, payload = super()._contribution_wire(r, index)
        part = self.partition.part(r, index)
        if self.fault == "nan":
            bad = torch.full((part.numel,), float("nan"), dtype=self.flat.dtype)
            return header, bad.numpy().tobytes()
        if self.fault in ("wrong_length", "oversized"):
            numel = part.numel + 1 if self.fault == "wrong_length" else part.numel * 8
            header = {**header, "shape": [numel]}
            return header, torch.ones(numel, dtype=self.flat.dtype).numpy().tobytes()
        return header, payload

    def _frame(self, kind: str, r: int, index: int, count: int = 1) -> Frame:
        frame = super()._frame(kind, r, index, count)
        if kind == "part" and self.fault == "bad_range":
            # claims more parts than the span has (the payload is one part's)
            fields = {**frame.fields, "k": len(self.partition.parts_of(r)) + 1}
            return Frame(frame.type, fields, frame.payload)
        return frame


class FaultyRound(ButterflyRound):
    """A round that misbehaves as ``fault`` says: its frames (see :class:`FaultySending`:
    a subclass sets ``sending_class`` to one for its fault), or ``kill_while_reducing``."""

    def __init__(self, *args: Any, fault: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault = fault

    def _on_received_parts(self, sender: str, index: int, count: int) -> None:
        if self.fault == "kill_while_reducing":
            _kill_self()


class SendFault:
    """Awaited before each frame of a round goes out (see :mod:`swarmlab.send_gate`): once
    the first part went out, ``kill_after_first_part`` SIGKILLs this process,
    ``stall_after_first_part`` holds that send and every later one forever, and
    ``freeze_after_first_part`` SIGSTOPs the process. Counts over every round of the
    averager it is given to."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.parts_sent = 0
        self.stalled = False

    async def __call__(self, peer_id: str, frame: Frame) -> None:
        if self.stalled:
            await asyncio.Event().wait()  # never: stay silent until cancelled
        if frame.type != PART:
            return
        if self.parts_sent >= 1:
            if self.fault == "kill_after_first_part":
                _kill_self()
            elif self.fault == "stall_after_first_part":
                self.stalled = True
                await asyncio.Event().wait()
            elif self.fault == "freeze_after_first_part":
                os.kill(os.getpid(), signal.SIGSTOP)
        self.parts_sent += 1


def faulty_runner(fault: str) -> RunnerFactory:
    """A runner factory (an averager's ``runner_class``, see
    :func:`swarmlab.averager_doubles.averager_with`) whose rounds misbehave as ``fault`` says,
    in their sends or their frames.

    ``--fault`` injects one misbehaviour, through the averager's ``runner_class`` (a round
    whose frames misbehave, sends held at the seam by :mod:`swarmlab.send_gate`) or its
    ``state_server_class`` (a donor that dies):
    ``kill_after_first_part`` / ``stall_after_first_part`` / ``freeze_after_first_part``
    (SIGKILL itself, stop sending anything, or SIGSTOP itself -- no more reading either, its
    connections left open, like a laptop put to sleep -- right after its first part went out),
    ``kill_while_reducing`` (SIGKILL on the first part it receives as a reducer), ``nan`` /
    ``wrong_length`` / ``oversized`` (corrupt parts), ``kill_mid_state`` (SIGKILL while serving
    the third chunk of a state download).
    """

    class Round(FaultyRound):
        sending_class = functools.partial(FaultySending, fault=fault)

    class Runner(AllreduceRunner):
        round_class = functools.partial(Round, fault=fault)

    return gated_runner(SendFault(fault), Runner)


class FaultyStateServer(StateServer):
    """A donor that SIGKILLs itself as it is asked for the third chunk of a state."""

    async def on_chunk(self, link: Link, frame: Frame) -> Frame:
        if frame.fields["i"] == 2:
            _kill_self()
        return await super().on_chunk(link, frame)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", required=True)
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--config", default="{}")
    parser.add_argument("--fault", choices=FAULTS, default=None)
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s"
    )
    from peer import DecentralizedAverager, Node

    tensors = torch.load(args.tensors, weights_only=True)
    node = Node(args.initial_peer, gossip_period=0.2, client_mode=args.client_mode)
    config = json.loads(args.config)
    averager_class = DecentralizedAverager
    if args.fault == "kill_mid_state":
        averager_class = averager_with(state_server=FaultyStateServer)
    elif args.fault:
        averager_class = averager_with(runner=faulty_runner(args.fault))
    averager = averager_class(tensors, node, start=True, **config)

    def step(command: dict[str, Any]) -> Any:
        try:
            reply: dict[str, Any] = {"ok": True, "gathered": averager.step(**command.get("kw", {}))}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if command.get("out"):
            with averager.get_tensors() as current:
                torch.save([t.clone() for t in current], command["out"])
        return reply

    def load_state(command: dict[str, Any]) -> Any:
        loaded = averager.load_state_from_peers(timeout=command.get("timeout"))
        if loaded is None:
            return {"ok": False}
        metadata, state = loaded  # type: ignore[misc]
        torch.save(state, command["out"])
        return {"ok": True, "metadata": metadata, "donor": averager.last_state_donor}

    def donors(command: dict[str, Any]) -> Any:
        from peer.averaging.sharing.download import list_donors

        found = node.run_coroutine(list_donors(node.core, averager.config.prefix))
        return {"donors": [peer_id for _, peer_id in found]}

    def sharing(command: dict[str, Any]) -> Any:
        averager.allow_state_sharing = bool(command["allow"])
        averager.state_sharing_priority = float(command.get("priority", 0.0))
        return {"ok": True}

    try:
        serve_json_lines(
            node,
            {
                "members": lambda c: {"members": len(node.members())},
                "step": step,
                "load_state": load_state,
                "donors": donors,
                "sharing": sharing,
            },
        )
    finally:
        averager.shutdown()
        node.shutdown()


class AveragerProcess(ChildProcess):
    """An averager in a child process (``python -m swarmlab.averager_process``)."""

    what = "averager"

    def __init__(
        self,
        tensors_path: str,
        *,
        initial_peers: list[str] = (),  # type: ignore[assignment]
        config: dict[str, Any] | None = None,
        fault: str | None = None,
        client_mode: bool = False,
    ) -> None:
        args = [sys.executable, "-m", "swarmlab.averager_process", "--tensors", tensors_path]
        for address in initial_peers:
            args += ["--initial-peer", address]
        args += ["--config", json.dumps(config or {})]
        if fault:
            args += ["--fault", fault]
        if client_mode:
            args.append("--client-mode")
        super().__init__(args, env=child_env())


if __name__ == "__main__":
    main()
