"""The public side of a run in the NAT lab, as a script inside the coordinator's namespace.

Started by :class:`swarmlab.natrun.NatRun`::

    ip netns exec NS python natrun_public.py HOST DIRECTORY RELAYS [--config K=V ...]

It starts ``swarmgrad coordinator`` on ``HOST:8000`` (relays told at join: ``RELAYS``,
comma-separated, may be empty), creates a run of the digits task with the given configs,
paused (volunteers join and link, and wait), and an invite, prints ``{"url", "token",
"run"}`` as one JSON line, then answers commands on standard input, one JSON line each:
``invite`` (a new invite of one use, ``{"token"}``: each volunteer its own, as an organizer
hands them out), ``resume`` (the organizer starts the run), ``peers`` (the organizer's list
of the run's peers), ``progress``, ``quit``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from swarmgrad.local import LocalCoordinator


def main(argv: list[str]) -> None:
    host, directory, relays, config = argv[0], Path(argv[1]), argv[2], argv[3:]
    env = {
        "SWARMGRAD_SNAPSHOT_INTERVAL_S": "1",
        "SWARMGRAD_REPORT_INTERVAL_S": "1",
        "SWARMGRAD_RELAYS": relays,
    }
    with LocalCoordinator(directory, port=8000, host=host, env=env) as coordinator:
        organizer_env = {
            **os.environ,
            "SWARMGRAD_URL": coordinator.url,
            "SWARMGRAD_TOKEN": coordinator.admin_token,
        }

        def organizer(*args: str) -> dict[str, object]:
            done = subprocess.run(
                [sys.executable, "-m", "swarmgrad", *args, "--json"],
                env=organizer_env,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
            )
            if done.returncode != 0:
                raise SystemExit(f"swarmgrad {' '.join(args)}: {done.stderr.strip()}")
            answer: dict[str, object] = json.loads(done.stdout)
            return answer

        run = organizer("runs", "create", "natlab", "--task", "digits", *config)
        organizer("runs", "pause", str(run["id"]))
        invite = organizer("invite", str(run["id"]), "--uses", "100")
        print(json.dumps({"url": coordinator.url, "token": invite["token"], "run": run["id"]}))
        sys.stdout.flush()
        api = f"{coordinator.url}/api/v1/runs/{run['id']}"
        headers = {"Authorization": f"Bearer {coordinator.admin_token}"}
        with httpx.Client(timeout=30) as http:
            for line in sys.stdin:
                command = line.strip()
                if command == "quit":
                    break
                if command == "resume":
                    resumed = organizer("runs", "resume", str(run["id"]))
                    print(json.dumps({"status": resumed["status"]}), flush=True)
                    continue
                if command == "invite":
                    # the organizer API, as `swarmgrad invite` calls it, without starting a
                    # Python process per volunteer (seconds each on a loaded machine)
                    made = http.post(api + "/tokens", headers=headers, json={"max_uses": 1})
                    made.raise_for_status()
                    print(json.dumps({"token": made.json()["token"]}), flush=True)
                    continue
                path = {"peers": "/peers", "progress": "/progress"}.get(command)
                if path is None:
                    print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)
                    continue
                print(json.dumps(http.get(api + path, headers=headers).json()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
