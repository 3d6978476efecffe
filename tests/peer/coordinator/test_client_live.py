"""CoordinatorClient and CoordinatorSession against the real coordinator, served by uvicorn
on a loopback port (SQLite): what the mock tests assume about the API, checked end to end."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peer.coordinator import (
    CoordinatorClient,
    CoordinatorSession,
    Forbidden,
    JoinAnswer,
    JoinChallenge,
    NotFound,
    RateLimited,
    RequestRejected,
    RunNotAccepting,
    SessionTimings,
    Unauthorized,
)
from peer.exceptions import SwarmgradError
from peer.formats.identity import Certificate, CertificateVerifier, Identity
from peer.formats.payloads import CheckpointPublic, RunPublic
from peer.formats.requests import ReportCreate
from swarmlab.node_process import wait_until
from tests.conftest import scaled, served

uvicorn = pytest.importorskip("uvicorn")
server_fixtures = pytest.importorskip("tests.server.conftest")
ADMIN = server_fixtures.ADMIN_TOKEN


@pytest.fixture(scope="module")
def coordinator_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A coordinator on a free 127.0.0.1 port for this module's tests."""
    from server.app import create_app

    directory: Path = tmp_path_factory.mktemp("coordinator")
    settings = server_fixtures.make_settings(
        f"sqlite:///{directory / 'coordinator.db'}",
        checkpoint_dir=directory / "checkpoints",
        report_flush_interval_s=0,
        certificate_ttl_s=3600,
    )
    with served(create_app(settings)) as url:
        yield url


@pytest.fixture
def client(coordinator_url: str) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(coordinator_url) as c:
        yield c


@pytest.fixture
def run(client: CoordinatorClient) -> RunPublic:
    return client.create_run(ADMIN, f"live-{time.monotonic_ns()}", "digits", {"lr": 0.1})


def invite(client: CoordinatorClient, run: RunPublic, **options: Any) -> str:
    return client.create_invite(ADMIN, run.id, **options).token


def join(client: CoordinatorClient, token: str, identity: Identity | None = None) -> JoinAnswer:
    # Display names are unique per run: each joining identity is a volunteer of its own.
    identity = identity or Identity()
    challenge = client.join_challenge(token)
    return client.join(token, challenge, identity, display_name=f"live-{identity.peer_id[:8]}")


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port something listens on, for the coordinator's reachability probe."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_join_gives_a_certificate_the_swarm_accepts_and_renewal_gives_another(
    client: CoordinatorClient, run: RunPublic
) -> None:
    identity = Identity()
    token = invite(client, run, max_uses=1)
    challenge = client.join_challenge(token)
    assert (challenge.run_id, challenge.task, challenge.status) == (run.id, "digits", "running")
    assert challenge.expires_at > time.time()
    answer = client.join(token, challenge, identity, display_name="ada")
    assert (answer.run_id, answer.peer_id, answer.status) == (
        run.id,
        identity.peer_id,
        "running",
    )
    assert answer.config == {"lr": 0.1} and answer.checkpoint is None
    verify = CertificateVerifier(answer.run_public_key, run.id)
    verify(Certificate.from_base64(answer.certificate).to_bytes(), identity.public_key)
    assert answer.certificate_expires_at == pytest.approx(time.time() + 3600, abs=60)

    certificate, expires_at = client.renew_certificate(answer.peer_token, run.id)
    verify(Certificate.from_base64(certificate).to_bytes(), identity.public_key)
    assert expires_at >= answer.certificate_expires_at

    # the same key joins again without using up the single-use invite; a new key cannot
    again = join(client, token, identity)
    assert again.peer_id == identity.peer_id
    with pytest.raises(Unauthorized):
        join(client, token, Identity())


def test_a_join_proof_for_another_challenge_is_refused(
    client: CoordinatorClient, run: RunPublic
) -> None:
    token = invite(client, run)
    challenge = client.join_challenge(token)
    other_run = client.create_run(ADMIN, f"other-{time.monotonic_ns()}", "digits", {})
    elsewhere = client.join_challenge(invite(client, other_run))
    forged = JoinChallenge(
        run.id, "x", "digits", "running", elsewhere.challenge, challenge.expires_at
    )
    with pytest.raises(Forbidden) as caught:
        client.join(token, forged, Identity())
    assert "\n" not in str(caught.value) and str(caught.value)


def test_refusals_carry_the_coordinators_words(client: CoordinatorClient, run: RunPublic) -> None:
    with pytest.raises(Unauthorized) as caught:
        client.join_challenge("sgj_" + "x" * 40)
    assert str(caught.value) and "sgj_" not in str(caught.value)
    token = invite(client, run)
    client.update_run(ADMIN, run.id, status="paused")
    assert client.join_challenge(token).status == "paused"  # its peers join and wait
    client.update_run(ADMIN, run.id, status="finished")
    with pytest.raises(RunNotAccepting, match="finished"):
        client.join_challenge(token)
    with pytest.raises(NotFound):
        client.run("no-such-run")


def test_reachability_bootstrap_and_reports(
    client: CoordinatorClient, run: RunPublic, listening_port: int
) -> None:
    token = invite(client, run)
    first, second = join(client, token), join(client, token)
    reach = client.check_reachability(first.peer_token, run.id, listening_port, None)
    assert reach.reachable and reach.address == f"ws://127.0.0.1:{listening_port}"
    with pytest.raises(RateLimited) as caught:
        client.check_reachability(first.peer_token, run.id, listening_port, None)
    assert caught.value.retry_after >= 1
    assert client.bootstrap(second.peer_token, run.id) == [reach.address]
    assert client.bootstrap(first.peer_token, run.id) == []  # never itself

    client.report(
        first.peer_token,
        run.id,
        ReportCreate(
            epoch=2,
            samples=640,
            samples_per_second=50.0,
            loss=0.5,
            rounds_done=3,
            rounds_failed=1,
            failure="AllreduceTimeout",
            eval_metric=0.9,
            group_size=None,
        ),
    )
    progress = client.progress(run.id)
    assert (progress.rounds_done, progress.rounds_failed) == (3, 1)
    assert progress.eval_metric == 0.9 and progress.epoch == 2
    # a report the model refuses, built without its checks: the coordinator refuses it too
    hostile = ReportCreate.model_construct(epoch=-1, samples=0, samples_per_second=0.0)
    with pytest.raises(RequestRejected, match="epoch"):
        client.report(first.peer_token, run.id, hostile)


def test_checkpoints_round_trip(client: CoordinatorClient, run: RunPublic) -> None:
    answer = join(client, invite(client, run))
    data = b"PK\x03\x04" + bytes(range(256)) * 40
    assert client.download_checkpoint(answer.peer_token, run.id) is None
    described = client.upload_checkpoint(answer.peer_token, run.id, 1, data)
    assert isinstance(described, CheckpointPublic)
    assert (described.epoch, described.size) == (1, len(data))
    with pytest.raises(RunNotAccepting):
        client.upload_checkpoint(answer.peer_token, run.id, 1, data)
    with pytest.raises(RequestRejected):
        client.upload_checkpoint(answer.peer_token, run.id, 2, b"not a zip")
    assert client.download_checkpoint(answer.peer_token, run.id) == (data, 1)
    assert client.download_checkpoint(ADMIN, run.id) == (data, 1)
    assert [c.epoch for c in client.list_checkpoints(ADMIN, run.id)] == [1]
    assert join(client, invite(client, run)).checkpoint is not None


def test_a_session_reports_renews_and_sees_the_run_pause(
    client: CoordinatorClient, run: RunPublic
) -> None:
    answer = join(client, invite(client, run))
    renewed: list[float] = []
    statuses: list[str] = []
    session = CoordinatorSession(
        client,
        run_id=answer.run_id,
        peer_token=answer.peer_token,
        certificate_expires_at=time.time() + 0.3,  # due for renewal at once
        on_certificate=lambda cert, expires: renewed.append(expires),
        on_status=statuses.append,
        status=answer.status,
        timings=SessionTimings(poll_interval=0.1, retry_base=0.1, max_backoff=1.0),
    )
    try:
        for epoch in range(1, 4):
            session.submit_report(
                {
                    "epoch": epoch,
                    "samples": 100 * epoch,
                    "samples_per_second": 10.0,
                    "rounds_done": 1,
                }
            )
        assert wait_until(lambda: session.pending_reports == 0, scaled(10))
        assert wait_until(lambda: client.progress(run.id).rounds_done == 3, scaled(10))
        assert wait_until(lambda: renewed, scaled(10))
        assert renewed[0] == pytest.approx(time.time() + 3600, abs=60)
        client.update_run(ADMIN, run.id, status="paused")
        assert wait_until(lambda: statuses == ["paused"], scaled(10))
        assert session.coordinator_reachable
    finally:
        session.close()


def test_a_ban_shuts_the_peer_out_of_the_swarm(
    client: CoordinatorClient, run: RunPublic, coordinator_url: str
) -> None:
    """Three volunteers' nodes joined through the coordinator; the organizer bans one:
    within a status poll the others close its links and forget it, and it cannot link
    back."""
    import httpx

    from peer.coordinator.joining import NodeOptions, join_run

    members = {}
    try:
        for name in ("ada", "bob", "mallory"):
            members[name] = join_run(
                client,
                invite(client, run),
                Identity(),
                node_options=NodeOptions(host="127.0.0.1"),
                display_name=name,
            )
        nodes = {name: m.node for name, m in members.items()}
        assert wait_until(lambda: all(len(n.members()) == 3 for n in nodes.values()), scaled(30))
        mallory = nodes["mallory"].peer_id
        honest = [nodes["ada"], nodes["bob"]]
        assert wait_until(lambda: all(mallory in n.core.pool.by_peer for n in honest), scaled(30))

        organizer = {"Authorization": f"Bearer {ADMIN}"}
        rows = httpx.get(f"{coordinator_url}/api/v1/runs/{run.id}/dashboard").json()
        (volunteer,) = [v for v in rows["volunteers"] if v["display_name"] == "mallory"]
        banned = httpx.post(
            f"{coordinator_url}/api/v1/runs/{run.id}/volunteers/{volunteer['id']}/ban",
            headers=organizer,
        )
        assert banned.status_code == 200, banned.text

        def shut_out() -> bool:
            return all(
                mallory not in n.core.pool.by_peer and mallory not in n.members() for n in honest
            )

        assert wait_until(shut_out, scaled(20))
        assert not any(n.core.trust.revocations is None for n in honest)
        address = nodes["ada"].core.visible_addresses
        try:  # her handshake may complete before ada says no: then ada closes the link
            link = nodes["mallory"].run_coroutine(
                nodes["mallory"].core.link(nodes["ada"].peer_id, address)
            )
        except SwarmgradError:
            refused = True
        else:
            refused = wait_until(lambda: link.closed, scaled(10))
        assert refused
        assert mallory not in nodes["ada"].core.pool.by_peer
    finally:
        for membership in members.values():
            membership.session.close()
            membership.node.shutdown()


def test_a_volunteer_restarted_at_once_waits_out_the_probe_interval(tmp_path: Path) -> None:
    """A crash and an automatic restart: the same key joins again before the coordinator
    would probe its ports again; the join waits the interval out instead of failing."""
    from peer.coordinator.joining import NodeOptions, join_run
    from server.app import create_app

    settings = server_fixtures.make_settings(
        f"sqlite:///{tmp_path / 'coordinator.db'}",
        checkpoint_dir=tmp_path / "checkpoints",
        reachability_interval_s=2.0,
    )
    identity = Identity()
    with served(create_app(settings)) as url, CoordinatorClient(url) as client:
        run = client.create_run(ADMIN, "restart", "digits", {})
        token = client.create_invite(ADMIN, run.id).token
        for _ in range(2):
            membership = join_run(
                client, token, identity, node_options=NodeOptions(host="127.0.0.1")
            )
            try:
                assert membership.answer.run_id == run.id
            finally:
                membership.session.close()
                membership.node.shutdown()
