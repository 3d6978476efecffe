"""Averaging rounds with a peer SIGKILLed in each: does every survivor always finish?

    .venv/bin/python bench/chaos.py [--rounds 100] [--peers 5] [--numel 200000] [--seed 0]
    .venv/bin/python bench/chaos.py --coordinator    # the coordinator's (bench/chaos_coordinator.py)

``--peers - 1`` survivors live for the whole run, each an averager in its own process
(:class:`swarmlab.averager_process.AveragerProcess`, on loopback). Every round a fresh victim
joins them and dies in one of four ways (each in turn, in a random order every four rounds):
in an averaging round of all ``--peers``, SIGKILLed from outside while the group is
matchmaking, SIGKILL after its first part went out (a sender dies), or SIGKILL on the first
part it receives as a reducer; or, as the best donor of a state download a survivor makes,
SIGKILL while serving its third chunk.

A round counts as survived when every survivor's step returned within the bound
(``matchmaking`` + ``allreduce_timeout``) with finite values, each one of the outcomes the
protocol allows — the mean over its group's survivors, the mean over its group with the
victim (the victim's part arrived before it died), or the survivor's own value (its part of
the dead reducer's span) — and at least half of its values averaged. A survivor that found
no group must keep its own values untouched; it is counted apart ("left without a group").
Survivors carry their results into the next round, so every round averages what the last
one produced. A state round counts as survived when the download, within the bound, gave
exactly another donor's current values (a survivor's: they share their state with a lower
priority than the victim's).

Prints, for the docs: rounds survived / rounds run, the longest round a survivor saw, the
bound, the victims' moments of death, and the survivors' resident memory after the first
round and after the last (growth per 100 rounds). ``--check`` exits with status 1 unless every round was
survived; ``--check-values`` only unless every result is one the protocol allows.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from swarmlab.averager_process import AveragerProcess
from swarmlab.node_process import wait_until

MOMENTS = ("matchmaking", "kill_after_first_part", "kill_while_reducing", "kill_mid_state")
CONFIG: dict[str, Any] = {
    "prefix": "chaos",
    "min_matchmaking_time": 1.0,
    "request_timeout": 2.0,
    "part_size_bytes": 64 * 1024,
    "sender_timeout": 2.0,
    "reducer_timeout": 4.0,
    "allreduce_timeout": 20.0,
}
BOUND_S = CONFIG["min_matchmaking_time"] + CONFIG["allreduce_timeout"] + 5.0  # + start-up


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def allowed(result: torch.Tensor, options: list[torch.Tensor]) -> tuple[bool, float]:
    """Whether every value is one of ``options`` (survivors' mean, everyone's mean, own),
    and the fraction that is one of the first two (averaged)."""
    near = [torch.isclose(result, o, atol=1e-5, rtol=0) for o in options]
    ok = bool((near[0] | near[1] | near[2]).all())
    return ok, float((near[0] | near[1]).float().mean())


def state_round(
    survivors: list[AveragerProcess],
    victim: AveragerProcess,
    newcomer: int,
    values: dict[int, list[torch.Tensor]],
    path: Path,
) -> tuple[float, str | None]:
    """Survivor ``newcomer`` downloads the state while the victim, the best donor, dies
    serving it. Returns the time the download took and what went wrong, if anything."""
    victim.call(cmd="sharing", allow=True, priority=10.0)
    downloader = survivors[newcomer]
    if not wait_until(lambda: downloader.call(cmd="donors")["donors"][:1] == [victim.peer_id], 30):
        return 0.0, "the victim's donor declaration never arrived"
    started = time.monotonic()
    reply = downloader.call(cmd="load_state", out=str(path), timeout=BOUND_S)
    took = time.monotonic() - started
    if not reply["ok"]:
        return took, "no state downloaded"
    donors = {p.peer_id: i for i, p in enumerate(survivors)}
    if reply["donor"] not in donors:
        return took, f"state taken from {reply['donor']}, not from a surviving donor"
    state = torch.load(path, weights_only=True)
    if not torch.equal(state[0], values[donors[reply["donor"]]][0]):
        return took, "the state downloaded is not its donor's"
    victim.proc.wait(timeout=30)
    if victim.proc.returncode != -signal.SIGKILL:
        return took, "the victim did not die serving the state"
    return took, None


def run(rounds: int, peers: int, numel: int, seed: int, out: Any = sys.stdout) -> dict[str, Any]:
    rng = random.Random(seed)
    config = {**CONFIG, "target_group_size": peers}
    work = Path(tempfile.mkdtemp(prefix="swarmgrad-chaos-"))
    values = {
        i: [torch.randn(numel, generator=torch.Generator().manual_seed(i))]
        for i in range(peers - 1)
    }
    for i, v in values.items():
        torch.save(v, work / f"in{i}.pt")
    survivors = [AveragerProcess(str(work / "in0.pt"), config=config)]
    survivors += [
        AveragerProcess(
            str(work / f"in{i}.pt"), initial_peers=survivors[0].addresses, config=config
        )
        for i in range(1, peers - 1)
    ]
    survived, longest, moments = 0, 0.0, {m: 0 for m in MOMENTS}
    left_out = wrong = 0  # survivors that found no group; results that no rule allows
    rss_first: list[int] = []
    failures: list[str] = []
    for p in survivors:  # donors, below any victim
        p.call(cmd="sharing", allow=True, priority=1.0)
    try:
        for round_ in range(rounds):
            if round_ % len(MOMENTS) == 0:  # every way to die, in a random order each time
                order = rng.sample(MOMENTS, len(MOMENTS))
            moment = order[round_ % len(MOMENTS)]
            moments[moment] += 1
            mine = [torch.randn(numel, generator=torch.Generator().manual_seed(10_000 + round_))]
            torch.save(mine, work / "victim.pt")
            victim = AveragerProcess(
                str(work / "victim.pt"),
                initial_peers=survivors[0].addresses,
                config=config,
                fault=None if moment == "matchmaking" else moment,
            )
            everyone = [*survivors, victim]
            if not wait_until(
                lambda: all(p.call(cmd="members")["members"] >= peers for p in survivors), 60
            ):
                failures.append(f"round {round_}: the victim never joined")
                victim.kill()
                continue
            if moment == "kill_mid_state":
                took, failure = state_round(
                    survivors, victim, rng.randrange(len(survivors)), values, work / "state.pt"
                )
                victim.kill()
                longest = max(longest, took)
                good = failure is None and took <= BOUND_S
                if failure is not None:
                    wrong += 1
                    failures.append(f"round {round_ + 1} ({moment}): {failure}")
                survived += good
                if round_ == 0:
                    rss_first = [rss_kib(p.proc.pid) for p in survivors]
                print(
                    f"round {round_ + 1}/{rounds}: {moment}, {took:.1f} s, "
                    f"{'ok' if good else 'FAILED'}",
                    file=out,
                    flush=True,
                )
                continue
            started = time.monotonic()
            kw = {"timeout": BOUND_S, "allow_retries": False}
            for i, p in enumerate(everyone):
                p.send(cmd="step", kw=kw, out=str(work / f"out{i}.pt"))
            if moment == "matchmaking":
                delay = rng.uniform(0.0, 0.1)  # the group assembles within about that
                threading.Timer(delay, victim.proc.send_signal, (signal.SIGKILL,)).start()
            replies = [p.receive() for p in survivors]
            took = time.monotonic() - started
            longest = max(longest, took)
            victim.kill()
            good = took <= BOUND_S
            inputs = {j: v[0] for j, v in values.items()}  # this round's, before any result
            for i, reply in enumerate(replies):
                result = torch.load(work / f"out{i}.pt", weights_only=True)[0]
                own = inputs[i]
                if not reply["ok"]:  # no group: it must keep its own values, untouched
                    left_out += 1
                    good = False
                    if not torch.equal(result, own):
                        wrong += 1
                    failures.append(
                        f"round {round_ + 1} ({moment}): survivor {i}: {reply['error']}"
                    )
                    values[i] = [result]
                    continue
                # the exact mean over the contributions it accepted: its group's, with or
                # without the victim's, or its own value where the dead reducer's span was
                members = set(reply["gathered"])
                group = [j for j in inputs if survivors[j].peer_id in members]
                total = torch.stack([inputs[j] for j in group]).sum(0)
                options = [total / len(group), total / len(group), own]
                if victim.peer_id in members:
                    options[1] = (total + mine[0]) / (len(group) + 1)
                fine, averaged = allowed(result, options)
                if not (torch.isfinite(result).all() and fine and averaged >= 0.5):
                    wrong += 1
                    good = False
                    failures.append(
                        f"round {round_ + 1} ({moment}): survivor {i}: values other than the "
                        f"group's mean or its own (averaged {averaged:.2f})"
                    )
                values[i] = [result]
            survived += good
            if round_ == 0:  # after one round: buffers and allocator pools are warm
                rss_first = [rss_kib(p.proc.pid) for p in survivors]
            print(
                f"round {round_ + 1}/{rounds}: {moment}, {took:.1f} s, {'ok' if good else 'FAILED'}",
                file=out,
                flush=True,
            )
        rss_last = [rss_kib(p.proc.pid) for p in survivors]
    finally:
        for p in survivors:
            p.kill()
        shutil.rmtree(work, ignore_errors=True)
    growth = [(b - a) / 1024 for a, b in zip(rss_first, rss_last, strict=True)]
    per_100 = max(growth) * 100 / max(1, rounds - 1)
    print(f"rounds survived: {survived}/{rounds}", file=out)
    print(f"survivors left without a group: {left_out}; results no rule allows: {wrong}", file=out)
    print(f"longest round a survivor saw: {longest:.1f} s (bound {BOUND_S:.0f} s)", file=out)
    print("victims died: " + ", ".join(f"{m} {n}" for m, n in moments.items()), file=out)
    print(
        f"survivors' memory: {min(rss_first) / 1024:.0f}-{max(rss_first) / 1024:.0f} MiB after "
        f"the first round, growth {min(growth):+.1f} to {max(growth):+.1f} MiB "
        f"({per_100:+.1f} MiB per 100 rounds at most)",
        file=out,
    )
    for failure in failures:
        print(f"  {failure}", file=out)
    return {
        "rounds": rounds,
        "survived": survived,
        "left_out": left_out,
        "wrong": wrong,
        "longest": longest,
        "failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--peers", type=int, default=5)
    parser.add_argument("--numel", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--check-values", action="store_true")
    parser.add_argument(
        "--coordinator",
        action="store_true",
        help="instead: the coordinator's storage failing and hostile volunteers "
        "(bench/chaos_coordinator.py)",
    )
    args = parser.parse_args()
    if args.coordinator:
        from bench.chaos_coordinator import run as coordinator_chaos

        coordinator_chaos(sys.stdout)
        return
    if args.peers < 3:
        parser.error("--peers must be at least 3 (two survivors and a victim)")
    result = run(args.rounds, args.peers, args.numel, args.seed)
    if args.check and result["survived"] != result["rounds"]:
        raise SystemExit(1)
    if args.check_values and result["wrong"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
