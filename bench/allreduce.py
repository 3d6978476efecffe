"""All-reduce throughput: Swarmgrad's butterfly all-reduce against torch.distributed (gloo).

    .venv/bin/python bench/allreduce.py [--peers 2 4 8] [--mb 64] [--reps 9] [--encryption on off]
                                        [--rate MBIT]

For each peer count, starts that many worker processes on loopback; each holds ``--mb`` MB of
fp32. In the same processes and the same run:

1. a memory pass: a few ``DecentralizedAverager.step()`` rounds (no compression, one group of
   all peers; the first is also the warm-up), peak extra resident memory per peer being the
   high-water mark during them minus the resident size before the first, so buffers the
   averager keeps between rounds count (gloo does not run in this pass: the buffers it keeps
   would count as ours);
2. ``--reps`` repetitions of: ``torch.distributed.all_reduce`` (gloo) of a copy of the
   tensor, then ``step()``, recording the all-reduce time (first part sent to last average
   written) and the full step time including matchmaking.

Per repetition the slowest peer's time counts (a collective is done when the last peer is);
the table shows medians, the ratio Swarmgrad / gloo (median over repetitions of the ratio
within each, gloo having run just before), the CPU time (user + system, all threads) per
peer and round of each (ours includes matchmaking), and the peak extra memory relative to
the tensor size. Absolute times on a shared machine are noise; the ratios are the figures.

Each peer count runs once per ``--encryption`` setting (both by default: links and lanes
sealed, the default, and in clear as on a trusted network), each against gloo in its own
run; the last column is the encrypted ratio over the clear one.

``--rate`` puts every peer in a network namespace of its own whose link carries that many
Mbit/s each way (tc's token bucket, :mod:`swarmlab.netlab`; needs root), as between machines;
gloo runs over the same links. Without it, everything runs on loopback, where the link
costs nothing and the CPU is the limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


if TYPE_CHECKING:
    from swarmlab.netlab import NetLab

MEMORY_ROUNDS = 3  # rounds of the memory pass (the first one is also the warm-up)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    # writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS (Linux ≥ 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from peer import DecentralizedAverager, Node
    from peer.formats.identity import OpenAuth

    torch.set_num_threads(1)
    # default gossip period; in a lab, on the peer's own address (a bench swarm is open)
    node = Node(
        args.initial_peer,
        host=args.host,
        auth=OpenAuth() if args.host != "127.0.0.1" else None,
        bulk_lanes=not args.no_lanes,
        encryption=not args.clear,
    )
    if args.rank == 0:
        print(json.dumps({"addresses": node.visible_addresses}), flush=True)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_host}:{args.master_port}",
        rank=args.rank,
        world_size=args.world,
    )
    while len(node.members()) < args.world:
        time.sleep(0.05)
    dist.barrier()
    numel = args.mb * (1 << 20) // 4
    tensor = torch.randn(numel)

    gloo: list[float] = []
    gloo_cpu: list[float] = []
    work = tensor.clone()

    def run_gloo(record: bool) -> None:
        dist.barrier()
        cpu, start = time.process_time(), time.perf_counter()
        dist.all_reduce(work)
        if record:
            gloo.append(time.perf_counter() - start)
            gloo_cpu.append(time.process_time() - cpu)

    run_gloo(False)

    averager = DecentralizedAverager(
        [tensor],
        node,
        start=True,
        prefix="bench",
        target_group_size=args.world,
        min_group_size=args.world,
        min_matchmaking_time=0.5,
        request_timeout=3.0,
        part_size_bytes=args.part_size,
        sender_timeout=30.0,
    )
    steps, allreduce, cpu_times = [], [], []
    profiler = None
    if os.environ.get("SWARMGRAD_BENCH_PROFILE") and args.rank == 0:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU time of the node's loop thread

        async def enable() -> None:
            profiler.enable()

        node.run_coroutine(enable())
    # Memory pass first, with no gloo call in between (gloo keeps buffers of its own that
    # would count as ours): the baseline is taken before the first step, so the buffers the
    # averager keeps between rounds count as extra memory.
    baseline = _rss_kib("VmRSS")
    _reset_peak()
    for _ in range(MEMORY_ROUNDS):
        dist.barrier()
        averager.step(timeout=120)
    peak_extra = _rss_kib("VmHWM") - baseline
    # timing pass: gloo right before ours in each repetition
    for _ in range(args.reps):
        run_gloo(True)
        dist.barrier()
        cpu, start = time.process_time(), time.perf_counter()
        averager.step(timeout=120)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        steps.append(elapsed)
        allreduce.append(averager.last_allreduce_seconds)
        cpu_times.append(cpu)
    if profiler is not None:
        import pstats

        async def disable() -> None:
            profiler.disable()

        node.run_coroutine(disable())
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(40)
    dist.barrier()
    averager.shutdown()
    node.shutdown()
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "rank": args.rank,
                "gloo": gloo,
                "gloo_cpu": gloo_cpu,
                "cpu": cpu_times,
                "step": steps,
                "allreduce": allreduce,
                "peak_extra_bytes": peak_extra * 1024,
                "tensor_bytes": numel * 4,
            }
        ),
        flush=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    peers: int, args: argparse.Namespace, encryption: bool, lab: NetLab | None = None
) -> dict[str, float]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if lab is not None:
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # the lab's link, not the namespace's loopback
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # gloo cannot name the lab addresses

    def command(rank: int, *extra: str) -> list[str]:
        argv = [*base, "--rank", str(rank), *extra]
        if lab is None:
            return argv
        return lab.command(rank, [*argv, "--host", lab.address(rank)])

    base = [
        sys.executable,
        __file__,
        "--worker",
        "--world",
        str(peers),
        "--master-port",
        str(port),
        "--master-host",
        lab.address(0) if lab is not None else "127.0.0.1",
        "--mb",
        str(args.mb),
        "--reps",
        str(args.reps),
        "--part-size",
        str(args.part_size),
        *(["--no-lanes"] if args.no_lanes else []),
        *([] if encryption else ["--clear"]),
    ]
    first = subprocess.Popen(command(0), stdout=subprocess.PIPE, text=True, env=env)
    assert first.stdout is not None
    address = json.loads(first.stdout.readline())["addresses"][0]
    procs = [first] + [
        subprocess.Popen(
            command(r, "--initial-peer", address), stdout=subprocess.PIPE, text=True, env=env
        )
        for r in range(1, peers)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode:
            raise RuntimeError(f"a worker failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))

    def slowest(key: str) -> list[float]:
        return [max(r[key][i] for r in results) for i in range(args.reps)]

    gloo_times, our_times = slowest("gloo"), slowest("allreduce")
    gloo = statistics.median(gloo_times)
    ours = statistics.median(our_times)
    # each repetition runs gloo right before ours: the median of the paired ratios is less
    # sensitive to the machine's drifts than the ratio of the medians
    paired = statistics.median(o / g for o, g in zip(our_times, gloo_times, strict=True))
    step = statistics.median(slowest("step"))
    memory = max(r["peak_extra_bytes"] for r in results) / results[0]["tensor_bytes"]

    def mean_cpu(key: str) -> float:
        return statistics.median(statistics.mean(r[key]) for r in results)

    return {
        "cpu": mean_cpu("cpu"),
        "gloo_cpu": mean_cpu("gloo_cpu"),
        "peers": peers,
        "gloo": gloo,
        "swarmgrad": ours,
        "ratio": paired,
        "step": step,
        "memory": memory,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--part-size", type=int, default=2**19)
    parser.add_argument(
        "--no-lanes", action="store_true", help="tensor frames over WebSocket links, no lanes"
    )
    parser.add_argument(
        "--encryption",
        nargs="+",
        choices=["on", "off"],
        default=["on", "off"],
        help="links and lanes sealed (on, the default of a node) or in clear (off)",
    )
    parser.add_argument(
        "--rate", type=float, help="Mbit/s each way per peer, in network namespaces (root)"
    )
    parser.add_argument("--clear", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--master-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--master-port", type=int, default=0)
    parser.add_argument("--initial-peer", action="append", default=[])
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.rate is not None:
        from swarmlab.netlab import unavailable

        reason = unavailable()
        if reason is not None:
            raise SystemExit(f"--rate shapes links in network namespaces: {reason}")
        if not args.rate > 0:
            raise SystemExit("--rate must be a positive number of Mbit/s")
    where = f"links of {args.rate:g} Mbit/s each way" if args.rate else "loopback"
    print(
        f"{args.mb} MB fp32 per peer, no compression, parts of {args.part_size} bytes, "
        f"{'WebSocket links' if args.no_lanes else 'bulk lanes'}, {where}, "
        f"median of {args.reps} (slowest peer per repetition)"
    )
    print(
        f"{'peers':>5} {'encrypted':>9} {'gloo s':>8} {'swarmgrad s':>12} {'ratio':>6} "
        f"{'step() s':>9} {'cpu gloo/ours s':>16} {'peak extra mem':>15} {'on/off':>7}"
    )
    for peers in args.peers:
        ratios: dict[str, float] = {}
        for setting in args.encryption:
            with contextlib.ExitStack() as stack:
                lab = None
                if args.rate is not None:
                    from swarmlab.netlab import NetLab

                    lab = stack.enter_context(NetLab(peers, rate_mbit=args.rate))
                r = run(peers, args, encryption=setting == "on", lab=lab)
            ratios[setting] = r["ratio"]
            relative = f"{ratios['on'] / ratios['off']:>7.2f}" if len(ratios) == 2 else f"{'':>7}"
            print(
                f"{r['peers']:>5} {setting:>9} {r['gloo']:>8.3f} {r['swarmgrad']:>12.3f} "
                f"{r['ratio']:>6.2f} {r['step']:>9.3f} {r['gloo_cpu']:>7.3f}/{r['cpu']:<8.3f} "
                f"{r['memory']:>14.2f}x {relative}",
                flush=True,
            )


if __name__ == "__main__":
    main()
