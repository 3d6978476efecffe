"""Every attack of the standing suite against a fresh coordinator and fresh peers.

``python bench/redteam.py`` runs ``tests/attacks`` (each attack starts its own coordinator
processes on SQLite and, where the test server is up, PostgreSQL, and its own nodes) and
prints one line per attack: what the attacker tried, what happened to it, and what the
honest side saw. It exits non-zero when any attack got through (its test failed) or when
no attack ran. Options after ``--`` go to pytest (``-- -k checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="redteam-") as scratch:
        log = Path(scratch) / "attacks.jsonl"
        env = {**os.environ, "SWARMGRAD_REDTEAM_LOG": str(log)}
        command = [sys.executable, "-m", "pytest", "tests/attacks", "-q", "-p", "no:cacheprovider"]
        done = subprocess.run(
            [*command, *args.pytest_args], cwd=ROOT, env=env, capture_output=True, text=True
        )
        lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    if not lines:
        sys.stdout.write(done.stdout[-4000:] + done.stderr[-2000:])
        print("error: no attack ran", file=sys.stderr)
        return 1
    for line in lines:  # a test run on each database: say which, where the outcome does not
        param = line["test"].rpartition("[")[2].rstrip("]") if line["test"].endswith("]") else ""
        if param and param not in line["outcome"]:
            line["attack"] += f" [{param}]"
    width = max(len(line["attack"]) for line in lines)
    for line in lines:
        verdict = "held" if line["held"] else "GOT THROUGH"
        print(f"{line['attack']:<{width}}  {verdict:<11}  {line['outcome']}  |  {line['effect']}")
    through = [line for line in lines if not line["held"]]
    print(f"{len(lines)} attacks, {len(lines) - len(through)} held, {len(through)} got through")
    if through or done.returncode != 0:
        if done.returncode != 0 and not through:
            sys.stdout.write(done.stdout[-4000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
