"""CoordinatorClient over httpx.MockTransport: requests, answers, and every way a call fails."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from peer.coordinator import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorFailed,
    CoordinatorUnreachable,
    Forbidden,
    JoinChallenge,
    NotACoordinator,
    NotFound,
    RateLimited,
    RequestRejected,
    RunNotAccepting,
    Unauthorized,
)
from peer.coordinator.connection import KEEPALIVE_EXPIRY_S
from peer.coordinator.reports import clean_report
from peer.formats.identity import Identity, join_proof_payload, verify_signature
from peer.formats.payloads import CheckpointPublic, RunPublic, RunStatus
from peer.formats.requests import ReportCreate
from tests.peer.coordinator.answers import progress_body, run_body

URL = "http://coord.example:8000"
TOKEN = "sgj_" + "t0k3n" * 8
HEADER = {"X-Swarmgrad-Coordinator": "1"}
Handler = Callable[[httpx.Request], httpx.Response]


def answer(status: int = 200, body: Any = None, **headers: str) -> httpx.Response:
    return httpx.Response(status, json=body, headers={**HEADER, **headers})


def client_with(handler: Handler, url: str = URL) -> CoordinatorClient:
    return CoordinatorClient(url, transport=httpx.MockTransport(handler))


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


CHALLENGE = {
    "run_id": "run123",
    "run_name": "mnist",
    "task": "digits",
    "status": "running",
    "challenge": "Ym9keQ.dGFn",
    "expires_at": "2030-01-01T00:02:00Z",
}


CHECKPOINT = {
    "epoch": 3,
    "size": 10,
    "sha256": "00",
    "created_at": "2030-01-01T00:00:00Z",
    "peer_id": "a" * 32,
    "pinned": False,
}


def join_body(run_public_key: bytes) -> dict[str, Any]:
    return {
        "run_id": "run123",
        "peer_id": "p" * 32,
        "peer_token": "sgp_secret",
        "certificate": b64(b"cert"),
        "certificate_expires_at": "2030-01-02T00:00:00+00:00",
        "run_public_key": b64(run_public_key),
        "run_name": "mnist",
        "status": "running",
        "task": "digits",
        "config": {"lr": 0.1},
        "bootstrap": [
            {"peer_id": "a" * 32, "addresses": ["ws://10.0.0.1:4000", "ws://h:1"]},
            {"peer_id": "b" * 32, "addresses": ["ws://10.0.0.1:4000"]},
        ],
        "checkpoint": CHECKPOINT,
    }


# --------------------------------------------------------------------------- volunteer calls


def test_join_challenge_then_join_signs_a_proof_the_coordinator_can_verify() -> None:
    identity = Identity()
    authority = Identity()
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        if request.url.path == "/api/v1/join/challenge":
            return answer(200, CHALLENGE)
        assert request.url.path == "/api/v1/runs/run123/join"
        return answer(200, join_body(authority.public_key))

    with client_with(handler) as client:
        challenge = client.join_challenge(TOKEN)
        assert challenge == JoinChallenge(
            "run123", "mnist", "digits", "running", "Ym9keQ.dGFn", 1893456120.0
        )
        joined = client.join(TOKEN, challenge, identity, display_name="ada")

    body = json.loads(seen[1].content)
    assert set(body) == {"public_key", "challenge", "signature", "client_mode", "display_name"}
    assert base64.urlsafe_b64decode(body["public_key"]) == identity.public_key
    assert body["challenge"] == challenge.challenge and body["client_mode"] is False
    payload = join_proof_payload("run123", challenge.challenge, identity.public_key)
    signature = base64.urlsafe_b64decode(body["signature"])
    assert verify_signature(identity.public_key, signature, payload)
    assert not verify_signature(Identity().public_key, signature, payload)

    assert joined.run_public_key == authority.public_key
    assert joined.bootstrap == ("ws://10.0.0.1:4000", "ws://h:1")  # flattened, no repeats
    assert joined.certificate_expires_at == 1893542400.0
    assert joined.checkpoint is not None and joined.checkpoint.epoch == 3
    assert dict(joined.config) == {"lr": 0.1}
    assert "sgp_secret" not in repr(joined) and b64(b"cert") not in repr(joined)


def test_reachability_bootstrap_renewal_and_reports() -> None:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        path = request.url.path.removeprefix("/api/v1/runs/r1")
        if path == "/reachability":
            return answer(
                200,
                {
                    "reachable": True,
                    "address": "ws://1.2.3.4:4000",
                    "host": "1.2.3.4",
                    "port": 4000,
                    "bulk_port": None,
                    "detail": "reachable",
                },
            )
        if path == "/bootstrap":
            return answer(200, {"peers": [{"peer_id": "x", "addresses": ["ws://a:1", "ws://b:2"]}]})
        if path == "/certificate":
            return answer(
                200, {"certificate": "Y2VydA==", "certificate_expires_at": "2030-01-01T00:00:00"}
            )
        assert path == "/reports"
        return answer(202, {"status": "accepted"})

    with client_with(handler) as client:
        reach = client.check_reachability("sgp_x", "r1", 4000, None)
        assert reach.reachable and reach.address == "ws://1.2.3.4:4000" and reach.bulk_port is None
        assert client.bootstrap("sgp_x", "r1") == ["ws://a:1", "ws://b:2"]
        assert client.renew_certificate("sgp_x", "r1") == ("Y2VydA==", 1893456000.0)
        fields = {"epoch": 1, "samples": 5, "samples_per_second": 0.5, "loss": None}
        client.report("sgp_x", "r1", clean_report(fields | {"rounds_done": 2}))
    assert json.loads(requests[0].content) == {"port": 4000, "bulk_port": None}
    # what the report sets, without what is unset or None
    assert json.loads(requests[-1].content) == {
        "epoch": 1,
        "samples": 5,
        "samples_per_second": 0.5,
        "rounds_done": 2,
    }
    assert requests[-1].headers["Content-Type"] == "application/json"
    assert all(r.headers["Authorization"] == "Bearer sgp_x" for r in requests)


def test_leave_posts_with_the_peer_token_and_a_refusal_is_an_error() -> None:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if request.headers["Authorization"] != "Bearer sgp_x":
            return answer(401, {"detail": "invalid token"})
        return httpx.Response(204, headers=HEADER)

    with client_with(handler) as client:
        client.leave("sgp_x", "r1", timeout=1.0)
        with pytest.raises(Unauthorized, match="invalid token"):
            client.leave("sgp_y", "r1")
    assert [(r.method, r.url.path) for r in requests] == [("POST", "/api/v1/runs/r1/leave")] * 2
    assert requests[0].content == b""


def test_checkpoints_up_and_down() -> None:
    data = b"PK\x03\x04" + b"x" * 100
    digest = hashlib.sha256(data).hexdigest()
    stored: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            stored["body"] = request.content
            stored["type"] = request.headers["Content-Type"]
            stored["epoch"] = request.url.params["epoch"]
            checkpoint = {"epoch": 4, "size": len(data), "sha256": digest, "peer_id": "p" * 32}
            return answer(201, checkpoint | {"created_at": "2030-01-01T00:00:00Z"})
        if "body" not in stored:
            return answer(404, {"detail": "run r1 has no checkpoint yet"})
        sha = "0" * 64 if stored.get("damage") else digest
        return httpx.Response(
            200,
            content=stored["body"],
            headers={**HEADER, "X-Checkpoint-Epoch": "4", "X-Checkpoint-SHA256": sha},
        )

    with client_with(handler) as client:
        assert client.download_checkpoint("sgp_x", "r1") is None
        uploaded = client.upload_checkpoint("sgp_x", "r1", 4, data)
        assert isinstance(uploaded, CheckpointPublic) and uploaded.sha256 == digest
        assert stored == {"body": data, "type": "application/octet-stream", "epoch": "4"}
        assert client.download_checkpoint("sgp_x", "r1") == (data, 4)
        stored["damage"] = True
        with pytest.raises(CoordinatorFailed, match="damaged"):
            client.download_checkpoint("sgp_x", "r1")


def test_organizer_calls() -> None:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        path = request.url.path
        if path == "/api/v1/runs" and request.method == "GET":
            return answer(200, {"runs": [run_body()]})
        if path.endswith("/checkpoints"):
            return answer(200, {"checkpoints": [CHECKPOINT]})
        if path.endswith("/pin"):
            return answer(200, CHECKPOINT | {"pinned": True})
        if path.endswith("/tokens"):
            invite = {"id": "t1", "token": "sgj_x", "expires_at": None, "max_uses": 3}
            return answer(201, invite | {"label": None})
        if path.endswith("/progress"):
            return answer(200, progress_body(epoch=7, checkpoint=CHECKPOINT))
        return answer(201 if request.method == "POST" else 200, run_body())

    with client_with(handler) as client:
        created = client.create_run("adm", "mnist", "digits", {"lr": 0.1})
        assert isinstance(created, RunPublic)
        # --json prints what came, with what the answer left to its default
        assert created.model_dump(mode="json") == run_body() | {"task_file": None}
        assert client.list_runs() == [RunPublic.model_validate(run_body())]
        client.list_runs(include_archived=True)
        assert client.update_run("adm", "r1", status="paused").status is RunStatus.running
        assert client.create_invite("adm", "r1", max_uses=3).token == "sgj_x"
        (listed_checkpoint,) = client.list_checkpoints("adm", "r1")
        assert listed_checkpoint.model_dump(mode="json") == CHECKPOINT
        assert client.pin_checkpoint("adm", "r1", 3).pinned
        assert client.run("r1").public_key == "k"
        progress = client.progress("r1")
        assert progress.epoch == 7 and progress.checkpoint is not None
        assert progress.checkpoint.epoch == 3 and progress.status is RunStatus.running
    create, listed, archived, update, invite = requests[:5]
    assert json.loads(create.content) == {"name": "mnist", "task": "digits", "config": {"lr": 0.1}}
    assert "Authorization" not in listed.headers
    assert archived.url.params["include_archived"] == "true"
    assert update.method == "PATCH" and json.loads(update.content) == {"status": "paused"}
    assert json.loads(invite.content) == {"max_uses": 3}
    assert invite.url.path == "/api/v1/runs/r1/tokens"
    assert requests[-1].url.path == "/api/v1/runs/r1/progress"


def test_path_prefix_is_kept_and_run_ids_are_quoted() -> None:
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.raw_path.decode())
        return answer(200, run_body())

    with client_with(handler, "https://host.example/swarm/") as client:
        client.run("a/b?c")
    assert paths == ["/swarm/api/v1/runs/a%2Fb%3Fc"]


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, RequestRejected),
        (401, Unauthorized),
        (403, Forbidden),
        (404, NotFound),
        (409, RunNotAccepting),
        (413, RequestRejected),
        (422, RequestRejected),
        (429, RateLimited),
        (500, CoordinatorFailed),
        (503, CoordinatorFailed),
        (507, CoordinatorFailed),
    ],
)
def test_status_codes_become_exception_classes_with_the_detail(
    status: int, kind: type[CoordinatorError]
) -> None:
    detail = f"run r1 says no\n(status {status})"

    def handler(request: httpx.Request) -> httpx.Response:
        return answer(status, {"detail": detail}, **{"Retry-After": "7"})

    with client_with(handler) as client, pytest.raises(kind) as caught:
        client.bootstrap(TOKEN, "r1")
    assert type(caught.value) is kind
    assert str(caught.value) == f"run r1 says no (status {status})"  # one line
    assert caught.value.status_code == status
    if kind is RateLimited:
        assert caught.value.retry_after == 7.0  # type: ignore[attr-defined]
    if kind is RunNotAccepting:
        assert caught.value.detail == f"run r1 says no (status {status})"


def test_validation_errors_read_as_one_line() -> None:
    detail = [
        {"loc": ["body", "port"], "msg": "Input should be less than or equal to 65535"},
        {"loc": ["query", "epoch"], "msg": "Field required"},
    ]
    with (
        client_with(lambda request: answer(422, {"detail": detail})) as client,
        pytest.raises(RequestRejected) as caught,
    ):
        client.check_reachability(TOKEN, "r1", 7000, None)
    assert str(caught.value) == (
        "port: Input should be less than or equal to 65535; epoch: Field required"
    )
    # a port no coordinator would take is the caller's mistake, refused before sending
    with client_with(lambda request: answer(500, None)) as client, pytest.raises(ValueError):
        client.check_reachability(TOKEN, "r1", 70000, None)


def test_an_error_without_a_detail_names_the_status() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(418, content=b"", headers=HEADER)

    with client_with(handler) as client, pytest.raises(RequestRejected, match="HTTP 418"):
        client.run("r1")


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(200, json={"status": "running"}),  # JSON, but no coordinator header
        httpx.Response(200, text="<html>Welcome to the hotel wifi</html>"),
        httpx.Response(404, text="not found"),
        httpx.Response(200, text="<html>", headers=HEADER),  # the header, but not JSON
        httpx.Response(200, json=["a", "list"], headers=HEADER),
    ],
)
def test_something_else_answering_is_not_a_coordinator(response: httpx.Response) -> None:
    with client_with(lambda request: response) as client, pytest.raises(NotACoordinator) as caught:
        client.run("r1")
    assert str(caught.value).startswith(
        "coord.example:8000 answered but is not a Swarmgrad coordinator"
    )


def test_an_answer_missing_fields_is_not_this_coordinator() -> None:
    with (
        client_with(lambda request: answer(200, {"run_id": "r"})) as client,
        pytest.raises(NotACoordinator, match="no 'run_name'"),
    ):
        client.join_challenge(TOKEN)
    wrong = run_body() | {"status": "sleeping", "created_at": "yesterday"}
    with (
        client_with(lambda request: answer(200, wrong)) as client,
        pytest.raises(NotACoordinator, match="a malformed 'status'"),
    ):
        client.run("r1")
    checkpoint_without_digest = {**CHECKPOINT, "sha256": None}
    body = join_body(b"k" * 32) | {"checkpoint": checkpoint_without_digest}
    with (
        client_with(lambda request: answer(200, body)) as client,
        pytest.raises(NotACoordinator, match=r"a malformed 'checkpoint\.sha256'"),
    ):
        client.join(TOKEN, _challenge(), Identity())


def test_the_organizers_answers_are_checked_as_closely_as_the_volunteers() -> None:
    """The progress, a checkpoint list, a pin: each of another shape is not this coordinator,
    naming the field, down to a history point's time."""
    history = [{"t": "not a time", "epoch": 0, "samples": 0, "samples_per_second": 0.0}]
    cases: list[tuple[dict[str, Any], Callable[[CoordinatorClient], Any], str]] = [
        ({"epoch": 7}, lambda c: c.progress("r1"), "no 'run_id'"),
        (
            progress_body() | {"history": [{**history[0], "loss": None, "peers_online": 0}]},
            lambda c: c.progress("r1"),
            r"a malformed 'history\.0\.t'",
        ),
        ({"checkpoints": [{"epoch": 1}]}, lambda c: c.list_checkpoints("adm", "r1"), "no "),
        ({"pinned": True}, lambda c: c.pin_checkpoint("adm", "r1", 1), "no 'epoch'"),
        ({"tokens": None}, lambda c: c.list_organizer_tokens("adm"), "a malformed 'tokens'"),
    ]
    for body, call, message in cases:
        with (
            client_with(lambda request, body=body: answer(200, body)) as client,
            pytest.raises(NotACoordinator, match=message),
        ):
            call(client)


def test_no_call_returns_an_untyped_dict() -> None:
    """Every answer comes as its payload type; only a run's config is free-form JSON."""
    import inspect

    for name, method in inspect.getmembers(CoordinatorClient, inspect.isfunction):
        if name.startswith("_"):
            continue
        returns = str(inspect.signature(method).return_annotation)
        assert "dict" not in returns and "Any" not in returns, (name, returns)


def test_a_status_that_is_none_of_a_runs_is_refused_before_sending() -> None:
    sent: list[httpx.Request] = []
    with client_with(lambda request: sent.append(request) or answer(200, run_body())) as client:
        with pytest.raises(ValueError, match="sleeping"):
            client.update_run("adm", "r1", status="sleeping")
        client.update_run("adm", "r1", status=RunStatus.finished, name="m2")
    assert [json.loads(r.content) for r in sent] == [{"name": "m2", "status": "finished"}]


def test_a_config_with_nan_is_refused_before_sending_not_sent_as_null() -> None:
    sent: list[httpx.Request] = []
    with client_with(lambda request: sent.append(request) or answer(200, run_body())) as client:
        with pytest.raises(ValueError, match="NaN"):
            client.create_run("adm", "r", "digits", {"lr": float("nan")})
        with pytest.raises(ValueError, match="NaN"):
            client.update_run("adm", "r1", config={"lr": float("inf")})
    assert sent == []


def _challenge() -> JoinChallenge:
    return JoinChallenge("run123", "mnist", "digits", "running", "Ym9keQ.dGFn", 1893456120.0)


def test_the_client_reads_the_answers_into_the_types_the_server_validates_them_with() -> None:
    """One description of the protocol: the server's routes declare these very classes."""
    import server.schemas
    from peer.formats import payloads

    for name in payloads.__all__:
        assert getattr(server.schemas, name) is getattr(payloads, name), name


def test_the_client_sends_the_requests_the_server_validates() -> None:
    """The requests are the server's own classes (its JoinRequest adds a check of display
    names), and what each call sends is a body the server's model takes as it was meant."""
    import server.schemas
    from peer.formats import requests

    models = [n for n in requests.__all__ if isinstance(getattr(requests, n), type)]
    assert {"JoinRequest", "RunCreate", "RunUpdate", "TokenCreate", "ReportCreate"} <= set(models)
    for name in models:
        served = getattr(server.schemas, name)
        assert served is getattr(requests, name) or name == "JoinRequest", name
    assert issubclass(server.schemas.JoinRequest, requests.JoinRequest)

    sent: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content)))
        if request.url.path.endswith("/join"):
            return answer(200, join_body(b"k" * 32))
        if request.url.path.endswith("/tokens"):
            invite = {"id": "t1", "token": "sgj_x", "expires_at": None, "max_uses": 3}
            return answer(201, invite | {"label": "lab"})
        return answer(200, run_body())

    task_file = {"filename": "my_task.py", "content": b64(b"x = 1\n"), "requirements": ["numpy"]}
    with client_with(handler) as client:
        client.create_run(
            "adm", "r", "my_task:make", {"lr": 0.5}, min_volunteers=2, task_file=task_file
        )
        client.update_run("adm", "r1", status="finished", min_volunteers=3)
        client.create_invite("adm", "r1", max_uses=3, expires_in_s=60.0, label="lab")
        client.join(TOKEN, _challenge(), Identity(), client_mode=True, display_name="ada")
    create, update, invite, join = (body for _, body in sent)
    run = server.schemas.RunCreate.model_validate(create)
    assert (run.task, run.config, run.min_volunteers) == ("my_task:make", {"lr": 0.5}, 2)
    assert run.task_file is not None and run.task_file.data() == b"x = 1\n"
    assert server.schemas.RunUpdate.model_validate(update).status is RunStatus.finished
    assert server.schemas.TokenCreate.model_validate(invite).expires_in_s == 60.0
    joined = server.schemas.JoinRequest.model_validate(join)
    assert joined.display_name == "ada" and joined.client_mode and joined.addresses == []


def test_a_gateway_in_front_of_a_stopped_coordinator_means_unreachable() -> None:
    with (
        client_with(lambda request: httpx.Response(502, text="Bad Gateway")) as client,
        pytest.raises(CoordinatorUnreachable, match="coordinator behind it is not answering"),
    ):
        client.run("r1")


def raising(exc: Exception) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            httpx.ConnectError("[Errno 111] Connection refused"),
            "cannot reach the coordinator at coord.example:8000: connection refused",
        ),
        (
            httpx.ConnectError("[Errno -2] Name or service not known"),
            "cannot reach the coordinator at coord.example:8000: name or service not known",
        ),
        (
            httpx.ReadTimeout("timed out"),
            "the coordinator at coord.example:8000 did not answer within 10 s",
        ),
        (
            httpx.RemoteProtocolError("Server disconnected without sending a response."),
            "lost the connection to the coordinator at coord.example:8000: "
            "server disconnected without sending a response.",
        ),
    ],
)
def test_network_failures_are_unreachable_and_name_the_host(
    error: httpx.HTTPError, message: str
) -> None:
    with client_with(raising(error)) as client, pytest.raises(CoordinatorUnreachable) as caught:
        client.report(TOKEN, "r1", ReportCreate(epoch=0, samples=0, samples_per_second=0.0))
    assert str(caught.value) == message
    assert caught.value.__cause__ is error
    assert caught.value.status_code is None


def test_a_read_the_server_dropped_unanswered_is_sent_again_once_a_write_never() -> None:
    """A kept-alive connection the server closes just as a request goes out on it: a read is
    sent again on a fresh one; a write may have been acted on, so it fails instead."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) % 2:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return answer(body=run_body())

    with client_with(handler) as client:
        assert client.run("r1").id == run_body()["id"]
        assert calls == ["GET", "GET"]
        calls.clear()
        with pytest.raises(CoordinatorUnreachable, match="lost the connection"):
            client.report(TOKEN, "r1", ReportCreate(epoch=0, samples=0, samples_per_second=0.0))
        assert calls == ["POST"]


def test_idle_connections_are_dropped_before_the_coordinator_times_them_out() -> None:
    """The client's keep-alive expiry stays under the coordinator's idle timeout: otherwise a
    request after an idle spell of that length races the server's close."""
    from server.config import Settings

    assert Settings.model_fields["http_keep_alive_s"].default > KEEPALIVE_EXPIRY_S


def test_a_closed_port_is_unreachable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        with (
            CoordinatorClient(f"http://127.0.0.1:{port}", timeout=5) as client,
            pytest.raises(CoordinatorUnreachable, match=f"at 127.0.0.1:{port}: "),
        ):
            client.run("r1")


def test_no_token_or_url_secret_ever_appears_in_a_message() -> None:
    secret_url = "http://organizer:hunter2@coord.example:8000/?token=sgj_leak"
    failures: list[Handler] = [
        raising(httpx.ConnectError("[Errno 111] Connection refused")),
        raising(httpx.ReadTimeout("timed out")),
        lambda request: httpx.Response(200, text="portal"),
        lambda request: answer(401, {"detail": "unknown token"}),
        lambda request: answer(500, None),
    ]
    for handler in failures:
        client = client_with(handler, secret_url)
        assert repr(client) == "CoordinatorClient('coord.example:8000')"
        with client, pytest.raises(CoordinatorError) as caught:
            client.join_challenge(TOKEN)
        text = f"{caught.value} {caught.value!r}"
        for secret in (TOKEN, "hunter2", "organizer", "sgj_leak"):
            assert secret not in text


def test_caller_mistakes_are_value_errors_that_do_not_echo_the_token() -> None:
    for url in ("coord.example:8000", "ftp://coord.example", "http://", "http://h:99999"):
        with pytest.raises(ValueError, match="coordinator URL"):
            CoordinatorClient(url)
    with pytest.raises(TypeError):
        CoordinatorClient(None)  # type: ignore[arg-type]
    with client_with(lambda request: answer(200, CHALLENGE)) as client:
        for token in ("", "   ", "sgj_bad token\n", "sgj_ünïcode"):
            with pytest.raises(ValueError, match="token") as caught:
                client.join_challenge(token)
            assert not token.strip() or token.strip() not in str(caught.value)
        assert client.join_challenge(f"  {TOKEN}\n").run_id == "run123"  # pasted with spaces
        with pytest.raises(ValueError, match="run_id"):
            client.run("")


def test_the_volunteer_side_never_imports_the_coordinator() -> None:
    code = (
        "import sys, peer, peer.coordinator, peer.coordinator.session\n"
        "bad = [m for m in ('server', 'fastapi', 'sqlalchemy', 'starlette') if m in sys.modules]\n"
        "print(bad)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
