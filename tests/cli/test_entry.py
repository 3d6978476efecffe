"""The root command: what it imports, its help, ``swarmgrad coordinator`` loaded only when it
runs, and a calm Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

from tests.cli.conftest import child_env, run_swarmgrad
from tests.conftest import scaled

COORDINATOR_STACK = ("server", "fastapi", "sqlalchemy")


def imported_after(code: str) -> list[str]:
    """The coordinator's modules in ``sys.modules`` after running ``code`` in a fresh
    interpreter (its stdout goes to /dev/null; the answer comes on stderr's last line)."""
    probe = (
        "import json, sys\n"
        f"{code}\n"
        f"sys.stderr.write(json.dumps([m for m in {COORDINATOR_STACK!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    found: list[str] = json.loads(done.stderr.splitlines()[-1])
    return found


def test_volunteer_side_never_imports_the_coordinator() -> None:
    assert imported_after("import peer") == []
    assert imported_after("import peer.volunteer, peer.coordinator") == []
    assert imported_after("import swarmgrad.cli") == []
    for args in (["join", "--help"], ["runs", "list", "--help"], ["--help"]):
        run = f"from swarmgrad.cli import main\ntry:\n    main({args!r})\nexcept SystemExit:\n    pass"
        assert imported_after(run) == [], args


def test_root_help_lists_every_command_with_its_short_help() -> None:
    result = run_swarmgrad("--help")
    assert result.code == 0, result.err
    for command in ("join", "demo", "runs", "invite", "coordinator"):
        assert command in result.out
    assert "Run the coordinator" in result.out


def test_no_arguments_shows_the_help() -> None:
    result = run_swarmgrad()
    assert "join" in result.out + result.err and "Traceback" not in result.err


def test_coordinator_command_is_the_servers() -> None:
    result = run_swarmgrad("coordinator", "--help")
    assert result.code == 0, result.err
    assert "admin-token" in result.out and "--port" in result.out
    assert "swarmgrad coordinator" in result.out


def test_coordinator_errors_are_one_line(tmp_path: object) -> None:
    result = run_swarmgrad("coordinator", "--no-such-option")
    result.assert_one_error_line(code=2)
    # Production without secrets: the server's own one-line refusal.
    env = child_env(SWARMGRAD_ENVIRONMENT="production", SWARMGRAD_DATABASE_URL="sqlite://")
    result = run_swarmgrad("coordinator", "admin-token", env=env)
    assert "SWARMGRAD_SECRET_KEY" in result.assert_one_error_line(code=2)


def test_demo_config_errors_are_one_line() -> None:
    result = run_swarmgrad("demo", "--config", "epochs=3")
    assert "--epochs" in result.assert_one_error_line(code=2)
    result = run_swarmgrad("demo", "--config", "aggregator")
    assert "key=value" in result.assert_one_error_line(code=2)
    # Checked against the task before anything starts, as every volunteer would check it.
    result = run_swarmgrad("demo", "--config", "lr=fast")
    line = result.assert_one_error_line(code=2)
    assert "'--config'" in line and "lr" in line and "coordinator" not in result.out
    # The demo's DiLoCo runs 10 inner steps per round: more fragments than that cannot sync.
    result = run_swarmgrad("demo", "--algorithm", "diloco", "--config", "fragments=20")
    assert "fragments: at most inner_steps (10)" in result.assert_one_error_line(code=2)


@contextlib.contextmanager
def waiting_command() -> Iterator[subprocess.Popen[str]]:
    """``swarmgrad runs list`` against a coordinator that accepts and never answers: the
    command, once it is waiting for its answer (killed on the way out if still running)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(scaled(60))
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        process = subprocess.Popen(
            [sys.executable, "-m", "swarmgrad", "runs", "list", "--url", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        try:
            connection, _ = listener.accept()  # the command is now waiting for an answer
            with connection:
                yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_ctrl_c_is_calm() -> None:
    """Ctrl-C while waiting on a coordinator that never answers: status 130, no traceback."""
    with waiting_command() as process:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=scaled(30))
    assert process.returncode == 130, (out, err)
    assert "Traceback" not in out + err and "error" not in err.lower()


def test_sigusr1_prints_every_threads_stack_and_the_command_goes_on() -> None:
    """A command that seems stuck tells where it is on SIGUSR1, then carries on (here it is
    still waiting for its answer, and Ctrl-C still ends it calmly)."""
    with waiting_command() as process:
        process.send_signal(signal.SIGUSR1)
        assert process.poll() is None
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=scaled(30))
    assert "most recent call first" in err and "swarmgrad/cli.py" in err, err
    assert process.returncode == 130, (out, err)
