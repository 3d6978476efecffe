"""bench/chaos.py in a small configuration: a round per way a victim can die; whatever
happens, every survivor ends with a result the protocol allows (its group's exact mean, with
or without the victim, or its own values; a state download gives another donor's state
exactly), and the figures the docs quote are printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import scaled

BENCH = Path(__file__).resolve().parents[3] / "bench" / "chaos.py"


@pytest.mark.slow
def test_survivors_of_rounds_in_which_a_peer_is_killed_end_with_allowed_values() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--rounds",
            "4",
            "--peers",
            "4",
            "--seed",
            "3",
            "--check-values",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^rounds survived: \d/4$", done.stdout, re.M), done.stdout
    assert re.search(r"results no rule allows: 0$", done.stdout, re.M), done.stdout
    assert re.search(
        r"^victims died: matchmaking 1, kill_after_first_part 1, kill_while_reducing 1, "
        r"kill_mid_state 1$",
        done.stdout,
        re.M,
    ), done.stdout
    assert re.search(r"longest round a survivor saw: [\d.]+ s \(bound \d+ s\)", done.stdout)
    assert re.search(r"survivors' memory: \d+-\d+ MiB", done.stdout), done.stdout
