"""A run in the NAT lab: a coordinator and a relay on the public side, ``swarmgrad join`` behind
home routers, exactly as volunteers run it.

:class:`NatRun` builds a :class:`~swarmlab.natlab.NatLab` with two public hosts: the
coordinator (``swarmlab/natrun_public.py``, which also creates the run and an invite) on
the first, ``swarmgrad relay`` on the second, named to volunteers by the coordinator
(``SWARMGRAD_RELAYS``). :meth:`NatRun.join` starts ``swarmgrad join URL --token T`` in a
volunteer's namespace (``--verbose``: its log says how it reached each peer);
:meth:`NatRun.connections` reads, for each pair of volunteers, how they linked. ::

    with NatRun([RouterKind.EIM, RouterKind.SYMMETRIC], tmp_path, config=["epochs=5"]) as run:
        run.join_all()
        ...
        print(run.connections())
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swarmlab.natlab import Link, NatLab, RouterKind
from swarmlab.node_process import wait_until

__all__ = ["LabVolunteer", "NatRun", "epoch_groups"]

PUBLIC_SCRIPT = Path(__file__).with_name("natrun_public.py")
RELAY_PORT = 4100
_EPOCH = re.compile(r"^epoch (\d+) \|.*\| group ([-\d]+) \|")
_PUNCHED = re.compile(r"direct link to peer ([a-z2-7]{32}) through its NAT")
_RELAYED = re.compile(r"linked to peer ([a-z2-7]{32}) through a relay")
_DIALED = re.compile(r"direct link to public peer ([a-z2-7]{32})")  # peer.node.punching
_MAPPED = "the router forwards it, by UPnP"  # the join line of peer.coordinator.joining
_PUBLIC = "reachable at "  # the same line for any volunteer the coordinator could reach
_WAITING = "the run is paused; waiting for the organizer"  # model and optimizer loaded


def epoch_groups(lines: Sequence[str]) -> dict[int, int | None]:
    """A volunteer's epoch lines as ``{epoch: group size}`` (None: no group that epoch)."""
    groups: dict[int, int | None] = {}
    for line in lines:
        match = _EPOCH.match(line)
        if match:
            size = match.group(2)
            groups[int(match.group(1))] = None if size == "-" else int(size)
    return groups


class LabVolunteer:
    """A ``swarmgrad join`` process; its output (stdout and stderr) read in a thread, and
    copied line by line to ``log`` when given (to read after a failed run)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with contextlib.ExitStack() as stack:
            log = None if self.log is None else stack.enter_context(self.log.open("w"))
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                if log is not None:
                    log.write(line)
                    log.flush()

    def groups(self) -> dict[int, int | None]:
        return epoch_groups(list(self.lines))

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(2)  # Ctrl-C: it leaves the run cleanly
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


class NatRun:
    """See the module's docstring. ``config`` items are ``--config`` values of the run
    (``key=value``); ``relay=False`` runs without a relay."""

    def __init__(
        self,
        kinds: Sequence[RouterKind],
        directory: Path,
        *,
        link: Link = Link(50, 50),
        config: Sequence[str] = (),
        relay: bool = True,
    ) -> None:
        self.kinds = list(kinds)
        self.directory = Path(directory)
        self.config = list(config)
        self.lab = NatLab(self.kinds, publics=2, link=link)
        self.relay = relay
        self.volunteers: list[LabVolunteer | None] = [None] * len(self.kinds)
        self._public: subprocess.Popen[str] | None = None
        self._relay: subprocess.Popen[str] | None = None
        self.url = self.token = self.run_id = ""

    @property
    def relay_address(self) -> str:
        return f"relay://{self.lab.public_address(1)}:{RELAY_PORT}"

    @property
    def relay_stats_path(self) -> Path:
        return self.directory / "relay.json"

    def __enter__(self) -> NatRun:
        self.lab.__enter__()
        try:
            self._start_public()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start_public(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        configs = [part for item in self.config for part in ("--config", item)]
        relays = self.relay_address if self.relay else ""
        argv = [sys.executable, str(PUBLIC_SCRIPT), self.lab.public_address(0)]
        argv += [str(self.directory / "coordinator"), relays, *configs]
        self._public = subprocess.Popen(
            self.lab.public_command(0, argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self._public.stdout is not None
        line = self._public.stdout.readline()
        if not line:
            _, err = self._public.communicate()
            raise RuntimeError(f"the coordinator side did not start: {err.strip()[-2000:]}")
        info = json.loads(line)
        self.url, self.token, self.run_id = info["url"], info["token"], info["run"]
        if not self.relay:
            return
        relay = [sys.executable, "-m", "swarmgrad", "relay", "--coordinator", self.url]
        relay += ["--host", self.lab.public_address(1), "--port", str(RELAY_PORT)]
        relay += ["--stats-file", str(self.relay_stats_path), "--stats-every", "1"]
        self._relay = subprocess.Popen(
            self.lab.public_command(1, relay),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self._relay.stdout is not None
        line = self._relay.stdout.readline()
        if "relay listening at" not in line:
            raise RuntimeError(f"the relay did not start: {line.strip()}")

    def join(self, k: int, *extra: str) -> LabVolunteer:
        """``swarmgrad join URL --token T`` behind router ``k`` (and ``extra`` options),
        with an invite of its own: six people, six invites (the volunteers that one shared
        invite admitted count as one witness of a state, see ``peer.averaging.sharing.witnesses``)."""
        token = str(self._ask("invite")["token"])
        argv = [sys.executable, "-m", "swarmgrad", "join", self.url, "--token", token]
        argv += ["--data-dir", str(self.directory / f"volunteer-{k}"), "--quiet", "--verbose"]
        # the machine's cores shared out, as each volunteer has its own machine (and as
        # ``swarmgrad demo`` does): six processes that each take every core slow one another
        # down by turns, and the one left behind misses rounds
        threads = max(1, (os.cpu_count() or 1) // len(self.kinds))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        log = self.directory / f"volunteer-{k}.log"
        volunteer = LabVolunteer(self.lab.volunteer_command(k, [*argv, *extra]), env, log)
        self.volunteers[k] = volunteer
        return volunteer

    def final_path(self, k: int) -> Path:
        """Where volunteer ``k`` writes its final model when joined with ``save_final``."""
        return self.directory / f"final-{k}.pt"

    def join_all(self, timeout: float = 300.0, *, save_final: bool = False) -> list[LabVolunteer]:
        """Every volunteer joins the run (created paused), and once every pair has linked
        (:meth:`linked`, within ``timeout`` seconds) the organizer starts it: the swarm
        starts together, as an organizer starts one, rather than the first volunteers
        training for several rounds while the last still start (on a small machine that
        takes a while, and a volunteer that falls that far behind has to catch up on a
        state the others agree on). With ``save_final`` each writes its final model to
        :meth:`final_path` (``swarmgrad join --save-final``). ``RuntimeError`` when they
        never link or never get ready.

        Linked is not enough: a volunteer still loading its model and optimizer when the run
        starts leaves the first one ready training alone (nobody else reports progress, so
        it skips the rounds), and on a fast task that one can finish the run before the
        others take a step. So the run starts once every volunteer also waits for the
        organizer (:meth:`ready`)."""
        volunteers = [
            self.join(k, *(("--save-final", str(self.final_path(k))) if save_final else ()))
            for k in range(len(self.kinds))
        ]

        def settled() -> bool:
            return any(v.process.poll() is not None for v in volunteers) or (
                self.linked() and self.ready()
            )

        settled_in_time = wait_until(settled, timeout, interval=0.5)
        gone = [k for k, v in enumerate(volunteers) if v.process.poll() is not None]
        if gone:
            last = volunteers[gone[0]].lines[-1:] or ["(no output)"]
            raise RuntimeError(f"volunteer {gone[0]} exited before the run started: {last[0]}")
        if not settled_in_time:
            unlinked = sorted(p for p, how in self._seen().items() if not how)
            waiting = sorted(set(range(len(self.kinds))) - self._waiting())
            raise RuntimeError(
                f"the volunteers did not all link and get ready: pairs {unlinked} did not "
                f"link, volunteers {waiting} do not wait for the organizer"
            )
        self.start()
        return volunteers

    def start(self) -> None:
        """The organizer starts (resumes) the run."""
        status = self._ask("resume").get("status")
        if status != "running":
            raise RuntimeError(f"the run did not start: its status is {status}")

    def linked(self) -> bool:
        """Whether every pair of volunteers has linked, as their logs say; a volunteer the
        others can dial (its router forwards its ports) is dialed whenever they need it, so
        its pairs count once it said it is reachable."""
        public = self.public()
        return all(how or {a, b} & public for (a, b), how in self._seen().items())

    def ready(self) -> bool:
        """Whether every volunteer has loaded its model and optimizer and waits for the
        organizer to start the run, as its log says."""
        return len(self._waiting()) == len(self.kinds)

    def _waiting(self) -> set[int]:
        return {
            k
            for k, volunteer in enumerate(self.volunteers)
            if volunteer is not None and any(_WAITING in line for line in volunteer.lines)
        }

    def public(self) -> set[int]:
        """The volunteers the coordinator could reach (any router that forwards), by their
        join line."""
        return {
            k
            for k, volunteer in enumerate(self.volunteers)
            if volunteer is not None and any(line.startswith(_PUBLIC) for line in volunteer.lines)
        }

    def _ask(self, command: str) -> Any:
        assert self._public is not None and self._public.stdin is not None
        assert self._public.stdout is not None
        line = ""
        with contextlib.suppress(BrokenPipeError):
            self._public.stdin.write(command + "\n")
            self._public.stdin.flush()
            line = self._public.stdout.readline()
        if not line:
            self._public.wait()
            err = self._public.stderr.read() if self._public.stderr is not None else ""
            raise RuntimeError(f"the coordinator side exited on {command!r}: {err.strip()[-2000:]}")
        return json.loads(line)

    def peers(self) -> list[dict[str, Any]]:
        """The organizer's list of the run's peers."""
        return list(self._ask("peers")["peers"])

    def progress(self) -> dict[str, Any]:
        return dict(self._ask("progress"))

    def relay_stats(self) -> dict[str, Any]:
        """What the relay last wrote of what it carried (empty before it wrote)."""
        try:
            return dict(json.loads(self.relay_stats_path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def volunteer_of(self) -> dict[str, int]:
        """Peer id to volunteer index, by the router address the coordinator saw."""
        routers = {self.lab.router_address(k): k for k in range(len(self.kinds))}
        found = {}
        for peer in self.peers():
            for address in peer["addresses"]:
                host = re.sub(r"^\w+://\[?([^\]/]+?)\]?:\d+.*$", r"\1", address)
                if host in routers:
                    found[peer["peer_id"]] = routers[host]
        return found

    def mapped(self) -> set[int]:
        """The volunteers whose router forwards their ports (UPnP), by their join line."""
        return {
            k
            for k, volunteer in enumerate(self.volunteers)
            if volunteer is not None and any(_MAPPED in line for line in volunteer.lines)
        }

    def connections(self) -> dict[tuple[int, int], str]:
        """For each pair of volunteers (a < b), how they linked, from their logs:
        ``punched``, ``relayed``, ``mapped`` (one of them is dialled through the port its
        router forwards: no punching, no relay) or ``none``."""
        seen = self._seen()
        mapped = self.mapped()
        return {(a, b): _how(how, bool({a, b} & mapped)) for (a, b), how in seen.items()}

    def _seen(self) -> dict[tuple[int, int], set[str]]:
        """For each pair of volunteers (a < b), the kinds of links their logs name."""
        index = self.volunteer_of()
        n = len(self.kinds)
        seen: dict[tuple[int, int], set[str]] = {
            (a, b): set() for a in range(n) for b in range(a + 1, n)
        }
        for k, volunteer in enumerate(self.volunteers):
            for line in volunteer.lines if volunteer is not None else ():
                for pattern, how in (
                    (_PUNCHED, "punched"),
                    (_RELAYED, "relayed"),
                    (_DIALED, "dialed"),
                ):
                    match = pattern.search(line)
                    if match and match.group(1) in index:
                        pair = tuple(sorted((k, index[match.group(1)])))
                        seen[pair].add(how)  # type: ignore[index]
        return seen

    def close(self) -> None:
        for volunteer in self.volunteers:
            if volunteer is not None:
                volunteer.stop()
        if self._relay is not None:
            self._relay.terminate()
            try:
                self._relay.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self._relay.kill()
                self._relay.communicate()
        if self._public is not None and self._public.poll() is None:
            try:
                self._public.communicate("quit\n", timeout=30)
            except subprocess.TimeoutExpired:
                self._public.kill()
                self._public.communicate()
        self.lab.close()


def _how(seen: set[str], mapped: bool) -> str:
    if "punched" in seen:
        return "punched"
    if mapped and "dialed" in seen:  # the mapped one may have found the other by a relay
        return "mapped"
    if "relayed" in seen:
        return "relayed"
    return "mapped" if mapped else "none"
