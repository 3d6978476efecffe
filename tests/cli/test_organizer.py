"""The organizer's commands against a real coordinator: ``runs ...`` and ``invite``, for people
(tables) and for scripts (``--json``), and each way they can fail."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peer.formats.requests import ReportCreate
from swarmlab.node_process import wait_until
from tests.cli.conftest import Coordinator, Result
from tests.conftest import free_port, scaled
from tests.peer.coordinator.answers import progress_body, run_body


@pytest.fixture
def organizer(cli: Any, coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``organizer(*args)``: ``cli`` with the coordinator's URL and admin token in the
    environment, as an organizer sets them once per shell."""
    monkeypatch.setenv("SWARMGRAD_URL", coordinator.url)
    monkeypatch.setenv("SWARMGRAD_TOKEN", coordinator.admin_token)
    return cli


def as_json(result: Result) -> Any:
    assert result.code == 0, (result.out, result.err)
    assert result.err == ""
    return json.loads(result.out)


def test_create_list_show_and_steer_a_run(organizer: Any) -> None:
    run = as_json(
        organizer(
            "runs",
            "create",
            "mnist",
            "--task",
            "digits",
            "--config",
            "lr=0.05",
            "--config",
            "epochs=40",
            "--config",
            "optimizer=adam",
            "--json",
        )
    )
    assert run["name"] == "mnist" and run["task"] == "digits" and run["status"] == "running"
    assert run["config"] == {"lr": 0.05, "epochs": 40, "optimizer": "adam"}

    listed = as_json(organizer("runs", "list", "--json"))
    assert [r["id"] for r in listed] == [run["id"]]

    shown = as_json(organizer("runs", "show", run["id"], "--json"))
    assert shown["run"]["id"] == run["id"]
    assert shown["progress"]["epoch"] == 0 and shown["progress"]["peers_online"] == 0

    assert as_json(organizer("runs", "pause", run["id"], "--json"))["status"] == "paused"
    assert as_json(organizer("runs", "resume", run["id"], "--json"))["status"] == "running"
    assert as_json(organizer("runs", "finish", run["id"], "--json"))["status"] == "finished"


def test_human_output_names_what_matters(organizer: Any) -> None:
    created = organizer("runs", "create", "first run", "--task", "digits", "--config", "lr=0.1")
    assert created.code == 0 and created.err == ""
    assert "first run" in created.out and "digits" in created.out
    run_id = as_json(organizer("runs", "list", "--json"))[0]["id"]
    assert f"swarmgrad invite {run_id}" in created.out

    listed = organizer("runs", "list")
    assert listed.code == 0 and "first run" in listed.out and "running" in listed.out
    shown = organizer("runs", "show", run_id)
    assert shown.code == 0 and "Progress" in shown.out and "peers online" in shown.out
    paused = organizer("runs", "pause", run_id)
    assert paused.code == 0 and "paused" in paused.out


def test_invite_prints_the_token_and_the_exact_join_command(
    organizer: Any, coordinator: Coordinator
) -> None:
    run = as_json(organizer("runs", "create", "r", "--task", "digits", "--json"))
    invite = as_json(
        organizer(
            "invite", run["id"], "--uses", "3", "--expires", "12h", "--label", "lab", "--json"
        )
    )
    assert invite["max_uses"] == 3 and invite["label"] == "lab" and invite["expires_at"]
    assert invite["command"] == f"swarmgrad join {coordinator.url} --token {invite['token']}"
    assert invite["link"] == f"{coordinator.url}/join/{invite['token']}"
    with coordinator.client() as client:  # the token works: it gets a join challenge
        assert client.join_challenge(invite["token"]).run_id == run["id"]

    human = organizer("invite", run["id"])
    assert human.code == 0
    command = next(line.strip() for line in human.out.splitlines() if "swarmgrad join" in line)
    token = command.split("--token ")[1]
    assert command == f"swarmgrad join {coordinator.url} --token {token}"
    assert f"Invite token: {token}" in human.out
    assert f"{coordinator.url}/join/{token}" in human.out


def test_url_and_token_options_override_the_environment(
    cli: Any, coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARMGRAD_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("SWARMGRAD_TOKEN", "not-a-token")
    run = as_json(
        cli(
            "runs",
            "create",
            "r",
            "--task",
            "digits",
            "--url",
            coordinator.url + "/",
            "--token",
            coordinator.admin_token,
            "--json",
        )
    )
    assert run["name"] == "r"


def test_checkpoint_downloads_the_newest(
    organizer: Any, coordinator: Coordinator, tmp_path: Path
) -> None:
    from peer.formats.identity import Identity

    run = as_json(organizer("runs", "create", "r", "--task", "digits", "--json"))
    missing = organizer("runs", "checkpoint", run["id"], "-o", str(tmp_path / "none.pt"))
    assert "no checkpoint" in missing.assert_one_error_line(code=1)
    assert not (tmp_path / "none.pt").exists()

    invite = as_json(organizer("invite", run["id"], "--json"))
    data = b"PK\x03\x04" + b"weights" * 100
    with coordinator.client() as client:
        challenge = client.join_challenge(invite["token"])
        peer = client.join(invite["token"], challenge, Identity())
        client.upload_checkpoint(peer.peer_token, run["id"], 2, data)

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    out = downloads / "model.pt"
    saved = as_json(organizer("runs", "checkpoint", run["id"], "-o", str(out), "--json"))
    assert out.read_bytes() == data
    assert saved["epoch"] == 2 and saved["size"] == len(data)
    assert saved["sha256"] == hashlib.sha256(data).hexdigest()
    assert [p.name for p in downloads.iterdir()] == ["model.pt"]  # no temporary file left


def test_checkpoints_list_pin_and_delete(organizer: Any, coordinator: Coordinator) -> None:
    from peer.formats.identity import Identity

    run = as_json(organizer("runs", "create", "r", "--task", "digits", "--json"))
    invite = as_json(organizer("invite", run["id"], "--json"))
    with coordinator.client() as client:
        peer = client.join(invite["token"], client.join_challenge(invite["token"]), Identity())
        for epoch in (1, 2):
            client.upload_checkpoint(peer.peer_token, run["id"], epoch, b"PK\x03\x04%d" % epoch)

    listed = organizer("runs", "checkpoints", run["id"])
    assert "epoch 2" in listed.out and "(served)" in listed.out
    pinned = as_json(organizer("runs", "checkpoints", run["id"], "--pin", "1", "--json"))
    assert [(c["epoch"], c["pinned"]) for c in pinned["checkpoints"]] == [(2, False), (1, True)]
    with coordinator.client() as client:
        assert client.download_checkpoint(peer.peer_token, run["id"])[1] == 1
    deleted = as_json(organizer("runs", "checkpoints", run["id"], "--delete", "2", "--json"))
    assert [c["epoch"] for c in deleted["checkpoints"]] == [1]
    missing = organizer("runs", "checkpoints", run["id"], "--pin", "7")
    assert "no checkpoint of epoch 7" in missing.assert_one_error_line(code=1)
    both = organizer("runs", "checkpoints", run["id"], "--pin", "1", "--unpin")
    assert "at most one" in both.assert_one_error_line(code=2)


# ------------------------------------------------------------------------------ failures


def test_unreachable_coordinator(cli: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["runs", "list"], ["runs", "show", "abc"], ["invite", "abc", "--token", "t"]):
        cli(*args, "--url", url).assert_one_error_line(code=1)


def test_a_web_server_that_is_not_a_coordinator(cli: Any, other_server: str) -> None:
    line = cli("runs", "list", "--url", other_server).assert_one_error_line(code=1)
    assert "coordinator" in line
    cli("runs", "pause", "x", "--url", other_server, "--token", "t").assert_one_error_line(code=1)


# A coordinator of another version: it says it is one (the header), and its answers are
# JSON objects, but of shapes this client's payload types do not accept.
_DRIFTED: dict[str, Any] = {
    "/api/v1/runs": {"runs": [run_body() | {"status": "sleeping"}]},
    "/api/v1/runs/r1": run_body(),
    "/api/v1/runs/r1/progress": {k: v for k, v in progress_body().items() if k != "samples"},
    "/api/v1/runs/r1/checkpoints": {"checkpoints": [{"epoch": "one"}]},
    "/api/v1/tokens": {"tokens": [{"id": "t1", "label": None}]},
}


class _DriftedCoordinator(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps(_DRIFTED.get(self.path.split("?")[0], {})).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Swarmgrad-Coordinator", "1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def drifted_coordinator() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DriftedCoordinator)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["runs", "list"], "a malformed 'runs.0.status'"),
        (["runs", "show", "r1"], "no 'samples'"),
        (["runs", "checkpoints", "r1", "--token", "t"], "a malformed 'checkpoints.0.epoch'"),
        (["tokens", "list", "--token", "t"], "no 'tokens.0.created_at'"),
    ],
)
def test_an_answer_the_client_cannot_parse_is_one_error_line(
    cli: Any, drifted_coordinator: str, args: list[str], what: str
) -> None:
    """Both sides hold to one set of payload types: an answer of another shape is said to be
    from another coordinator version, with the field, in one line and with nothing on
    standard output, for people and for scripts alike."""
    host = drifted_coordinator.removeprefix("http://")
    for output in ([], ["--json"]):
        result = cli(*args, *output, "--url", drifted_coordinator)
        line = result.assert_one_error_line(code=1)
        assert line == (
            f"error: {host} sent an answer with {what}; it is not a Swarmgrad coordinator "
            "of this version"
        )
        assert result.out == ""


def test_wrong_token_unknown_run_and_finished_run(organizer: Any, cli: Any) -> None:
    cli("runs", "create", "r", "--task", "digits", "--token", "wrong" * 10).assert_one_error_line(
        code=1
    )
    organizer("runs", "show", "nosuchrun").assert_one_error_line(code=1)
    organizer("runs", "pause", "nosuchrun").assert_one_error_line(code=1)
    run = as_json(organizer("runs", "create", "r", "--task", "digits", "--json"))
    assert organizer("runs", "finish", run["id"]).code == 0
    organizer("runs", "resume", run["id"]).assert_one_error_line(code=1)  # finished is final


def test_missing_token_and_bad_values_are_usage_errors(
    cli: Any, coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWARMGRAD_TOKEN", raising=False)
    url = ["--url", coordinator.url]
    line = cli("runs", "create", "r", "--task", "digits", *url).assert_one_error_line(code=2)
    assert "SWARMGRAD_TOKEN" in line
    cli("invite", "r", *url).assert_one_error_line(code=2)
    token = ["--token", coordinator.admin_token]
    cli("runs", "create", "r", *url, *token).assert_one_error_line(code=2)  # no --task
    line = cli("runs", "create", "r", "--task", "t", "--config", "lr", *url, *token)
    assert "key=value" in line.assert_one_error_line(code=2)
    line = cli("invite", "r", "--expires", "soon", *url, *token).assert_one_error_line(code=2)
    assert "30m" in line
    cli("invite", "r", "--uses", "0", *url, *token).assert_one_error_line(code=2)
    cli("runs", "list", "--url", "localhost:8000").assert_one_error_line(code=2)
    cli("runs", "nosuchcommand").assert_one_error_line(code=2)
    cli("runs", "list", "--nosuchoption").assert_one_error_line(code=2)


def test_a_config_no_volunteer_could_train_creates_no_run(
    organizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task is loaded here and the config checked as every volunteer will check it: a
    mistake is one usage line for the organizer, not one error per volunteer later."""
    for args, expected in [
        (["--config", "lr=fast"], "lr: "),
        (["--config", "optimiser=adam"], "optimiser: not a setting of the task 'digits'"),
        (["--config", "batch_size=0"], "batch_size"),
    ]:
        line = organizer("runs", "create", "r", "--task", "digits", *args)
        line = line.assert_one_error_line(code=2)
        assert "'--config'" in line and expected in line, line
    line = organizer("runs", "create", "r", "--task", "no such task").assert_one_error_line(code=2)
    assert "'--task'" in line and "unknown task" in line
    line = organizer("runs", "create", "r", "--task", "absent_module:task")
    assert "--no-check" in line.assert_one_error_line(code=2)
    assert as_json(organizer("runs", "list", "--json")) == []

    # A task only the volunteers have: created unchecked when asked to.
    run = as_json(
        organizer("runs", "create", "r", "--task", "absent_module:task", "--no-check", "--json")
    )
    assert run["task"] == "absent_module:task"
    # A task of the organizer's own, checked with its own parameters.
    (tmp_path / "organizer_task.py").write_text(
        "from peer.tasks.digits import DigitsTask\n\ndef task():\n    return DigitsTask()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = ["runs", "create", "r", "--task", "organizer_task:task"]
    line = organizer(*mine, "--config", "hidden=wide").assert_one_error_line(code=2)
    assert "hidden" in line
    run = as_json(organizer(*mine, "--config", "hidden=16", "--json"))
    # the task's last epoch written down: the coordinator finishes the run there
    assert run["config"] == {"hidden": 16, "epochs": 40}
    assert len(as_json(organizer("runs", "list", "--json"))) == 2


def test_rejected_values_are_one_line(organizer: Any) -> None:
    result = organizer("runs", "create", "x" * 300, "--task", "digits")  # name too long: 422
    result.assert_one_error_line(code=1)


def test_unwritable_output(organizer: Any, coordinator: Coordinator, tmp_path: Path) -> None:
    from peer.formats.identity import Identity

    run = as_json(organizer("runs", "create", "r", "--task", "digits", "--json"))
    invite = as_json(organizer("invite", run["id"], "--json"))
    with coordinator.client() as client:
        peer = client.join(invite["token"], client.join_challenge(invite["token"]), Identity())
        client.upload_checkpoint(peer.peer_token, run["id"], 1, b"PK\x03\x04data")
    target = tmp_path / "no" / "such" / "dir" / "model.pt"
    organizer("runs", "checkpoint", run["id"], "-o", str(target)).assert_one_error_line(code=1)


def test_organizer_tokens_through_the_api(organizer: Any, cli: Any) -> None:
    created = as_json(organizer("tokens", "create", "--label", "ci", "--expires", "30d", "--json"))
    assert created["token"].startswith("sgo_") and created["label"] == "ci"
    assert created["expires_at"] is not None

    mine = ["--token", created["token"]]
    listed = as_json(cli("tokens", "list", "--json", *mine))
    assert [(t["id"], t["active"], t["current"]) for t in listed] == [(created["id"], True, True)]
    shown = organizer("tokens", "list")
    assert shown.code == 0 and created["id"] in shown.out and "active" in shown.out
    assert created["token"] not in shown.out

    revoked = organizer("tokens", "revoke", created["id"])
    assert revoked.code == 0 and revoked.out.strip() == f"revoked organizer token {created['id']}"
    line = cli("tokens", "list", *mine).assert_one_error_line(code=1)
    assert "revoked" in line and created["token"] not in line
    organizer("tokens", "revoke", "0" * 16).assert_one_error_line(code=1)
    line = organizer("tokens", "create", "--expires", "soon").assert_one_error_line(code=2)
    assert "30m" in line


def test_the_coordinator_refuses_a_bad_shared_setting_the_cli_did_not_check(
    organizer: Any,
) -> None:
    """``--no-check`` skips loading the task here; the coordinator still checks the settings
    every peer shares, and its reason reaches the organizer as one line."""
    create = ["runs", "create", "r", "--task", "digits", "--config", "aggregator=bogus"]
    line = organizer(*create).assert_one_error_line(code=2)  # checked here, with the task
    assert "'--config': aggregator: expected one of" in line and "bogus" in line, line
    line = organizer(*create, "--no-check").assert_one_error_line(code=1)  # by the coordinator
    assert "config: aggregator: expected one of" in line and "bogus" in line, line
    assert as_json(organizer("runs", "list", "--json")) == []


# ------------------------------------------------------------------- waiting for volunteers


def test_a_run_created_with_min_volunteers_waits_and_starts_by_itself(
    organizer: Any, coordinator: Coordinator
) -> None:
    from peer.formats.identity import Identity

    created = organizer("runs", "create", "r", "--task", "digits", "--min-volunteers", "2")
    assert created.code == 0, created.err
    assert "paused: waiting for 2 volunteers (0 online)" in created.out
    assert "starts by itself once 2 volunteers are online" in created.out
    run = as_json(organizer("runs", "list", "--json"))[0]
    assert run["min_volunteers"] == 2
    assert run["config"]["epochs"] == 40  # the task's own last epoch, written down

    with coordinator.client() as client:
        for _ in range(2):
            invite = as_json(organizer("invite", run["id"], "--json"))["token"]
            answer = client.join(invite, client.join_challenge(invite), Identity())
            # ready: its task and model loaded, a waiting volunteer reports
            client.report(
                answer.peer_token,
                run["id"],
                ReportCreate(epoch=0, samples=0, samples_per_second=0.0),
            )

    def started() -> bool:
        shown = organizer("runs", "show", run["id"])
        assert shown.code == 0, shown.err
        return "running" in shown.out and "waiting" not in shown.out

    assert wait_until(started, scaled(20))

    held = organizer("runs", "pause", run["id"], "--min-volunteers", "5")
    assert held.code == 0 and "paused: waiting for 5 volunteers (2 online)" in held.out
    listed = as_json(organizer("runs", "list", "--json"))
    assert listed[0]["status_detail"] == "waiting for 5 volunteers (2 online)"
    assert as_json(organizer("runs", "resume", run["id"], "--json"))["status"] == "running"
    finished = as_json(organizer("runs", "finish", run["id"], "--json"))
    assert finished["status"] == "finished" and finished["status_detail"] is None
    for bad in ("0", "many"):
        organizer("runs", "create", "r", "--task", "digits", "--min-volunteers", bad)
        line = organizer("runs", "pause", run["id"], "--min-volunteers", bad)
        assert "--min-volunteers" in line.assert_one_error_line(code=2)
