"""``swarmgrad relay``: usage errors are one line, the run keys come from the coordinator,
and the relay runs until SIGTERM, writing what it carried."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from peer.formats.identity import Identity
from swarmgrad.relay import CoordinatorRunKeys
from swarmlab.node_process import wait_until
from tests.cli.conftest import Coordinator, child_env
from tests.conftest import scaled

KEY = base64.urlsafe_b64encode(Identity().public_key).decode()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((), "say which runs to serve"),
        (("--run", "run"), "--run takes RUN_ID=PUBLIC_KEY"),
        (("--run", "run=c2hvcnQ="), "--run takes RUN_ID=PUBLIC_KEY"),
        (("--run", f"run={KEY}", "--public-address", "ws://h:1"), "--public-address is relay"),
        (("--run", f"run={KEY}", "--rate-mib", "0"), "relay limits"),
        (("--run", f"run={KEY}", "--max-circuits", "0"), "relay limits"),
    ],
)
def test_usage_errors_are_one_line(cli: Any, args: tuple[str, ...], match: str) -> None:
    line = cli("relay", *args).assert_one_error_line(code=2)
    assert match in line


def test_a_taken_port_is_one_line(cli: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("relay", "--run", f"run={KEY}", "--host", "127.0.0.1", "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in result.assert_one_error_line(code=1)


def test_run_keys_come_from_the_coordinator(coordinator: Coordinator) -> None:
    with coordinator.client() as client:
        run = client.create_run(coordinator.admin_token, "r", "digits", {})
    keys = CoordinatorRunKeys(coordinator.url)
    try:
        assert asyncio.run(keys(run.id)) == base64.urlsafe_b64decode(run.public_key)
        assert asyncio.run(keys("no-such-run")) is None
        assert "no-such-run" in keys._misses  # not asked again for a while
    finally:
        keys.close()


@pytest.mark.slow
def test_the_relay_serves_until_sigterm_and_writes_its_stats(tmp_path: Path) -> None:
    stats = tmp_path / "relay.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad", "relay", "--run", f"run={KEY}", "--host",
         "127.0.0.1", "--port", "0", "--stats-file", str(stats), "--stats-every", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("relay listening at relay://127.0.0.1:"), line
        assert "4 MiB/s, 4 GiB per hour, 16 circuits" in line
        assert wait_until(stats.exists, scaled(10))
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=scaled(30))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "Traceback" not in out + err
    written = json.loads(stats.read_text())
    assert written["bytes_carried"] == 0 and written["peers"] == 0


def _compose_relay(domain: str) -> dict[str, Any]:
    """deploy/compose.yaml's relay service, its variables filled as Compose would."""
    text = (Path(__file__).resolve().parents[2] / "deploy" / "compose.yaml").read_text()
    text = re.sub(r"\$\{SWARMGRAD_DOMAIN:\?[^}]*\}", domain, text)
    text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)
    service: dict[str, Any] = yaml.safe_load(text)["services"]["relay"]
    return service


@pytest.mark.slow
def test_the_compose_files_relay_starts_with_its_command_and_settings(tmp_path: Path) -> None:
    service = _compose_relay("relay.example")
    command = [*service["command"], "--stats-file", str(tmp_path / "s.json")]
    assert command[0] == "relay" and "4100:4100" in service["ports"]
    port = command.index("--port") + 1
    command[port] = "0"  # the file's own port may be taken here
    env = child_env(**{k: str(v) for k, v in service["environment"].items()})
    process = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(
            "relay listening at relay://relay.example:4100: per volunteer 4 MiB/s"
        ), line
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=scaled(30))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
