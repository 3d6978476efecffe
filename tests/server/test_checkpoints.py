"""Checkpoints: peers upload zip archives (what torch.save writes) streamed to disk, at an
epoch the other volunteers have reached, from the designated uploader or agreed by
volunteers of two invites; the newest few are kept, and the directory stays under its byte
bound; peers and organizers download the pinned one or the newest."""

from __future__ import annotations

import asyncio
import errno
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import update

from peer.formats.identity import Identity
from server.app import MAX_BODY_BYTES, create_app
from server.clock import now_ms
from server.config import Settings
from server.models import Peer
from server.services import checkpoint_admission as admission
from server.services import checkpoints as checkpoint_service
from server.services import volunteers as volunteer_service
from swarmlab.node_process import wait_until_async
from tests.server.conftest import (
    ORGANIZER,
    Api,
    JoinedPeer,
    bearer,
    client_for,
    make_settings,
    running,
)


def archive(epoch: int, size: int = 1000) -> bytes:
    """Bytes that start like a zip archive; the coordinator looks no further."""
    return b"PK\x03\x04" + bytes([epoch % 256]) * (size - 4)


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def settings(database_url: str, checkpoint_dir: Path) -> Settings:
    return make_settings(
        database_url,
        checkpoint_dir=checkpoint_dir,
        checkpoint_keep=2,
        checkpoint_max_bytes=2 * MAX_BODY_BYTES,
    )


@pytest.fixture
async def peer(api: Api, run: dict[str, Any], join_token: str) -> JoinedPeer:
    return await api.join(run["id"], join_token)


def url(run: dict[str, Any], epoch: int | None = None) -> str:
    base = f"/api/v1/runs/{run['id']}/checkpoint"
    return base if epoch is None else f"{base}?epoch={epoch}"


async def upload(
    client: httpx.AsyncClient, run: dict[str, Any], peer: JoinedPeer, epoch: int, data: Any
) -> httpx.Response:
    return await client.put(
        url(run, epoch),
        content=data,
        headers={**peer.headers, "Content-Type": "application/octet-stream"},
    )


def files(directory: Path) -> list[str]:
    """Every file left in the checkpoint directory, temporary ones included."""
    return sorted(p.name for p in directory.rglob("*") if p.is_file())


def contents(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


async def test_upload_then_download_the_newest(
    api: Api,
    client: httpx.AsyncClient,
    run: dict[str, Any],
    peer: JoinedPeer,
    join_token: str,
    checkpoint_dir: Path,
) -> None:
    assert (await client.get(url(run), headers=peer.headers)).status_code == 404
    data = archive(3, size=MAX_BODY_BYTES + 5000)  # over the 1 MiB limit of other routes
    response = await upload(client, run, peer, 3, data)
    assert response.status_code == 201, response.text
    created = response.json()
    assert set(created) == {"epoch", "size", "sha256", "created_at", "peer_id", "pinned"}
    assert created["epoch"] == 3 and created["size"] == len(data)
    assert created["sha256"] == hashlib.sha256(data).hexdigest()
    assert created["peer_id"] == peer.body["peer_id"]
    [name] = files(checkpoint_dir)
    assert (checkpoint_dir / run["id"] / name).read_bytes() == data

    newcomer = await api.join(run["id"], join_token)
    for headers in (peer.headers, ORGANIZER, newcomer.headers):
        download = await client.get(url(run), headers=headers)
        assert download.status_code == 200
        assert download.content == data
        assert download.headers["X-Checkpoint-Epoch"] == "3"
        assert download.headers["X-Checkpoint-SHA256"] == created["sha256"]
        assert download.headers["content-type"] == "application/octet-stream"
        assert download.headers["X-Swarmgrad-Coordinator"] == "1"
    assert newcomer.body["checkpoint"] == created
    progress = (await client.get(f"/api/v1/runs/{run['id']}/progress")).json()
    assert progress["checkpoint"] == created


async def test_who_may_upload_and_download(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], peer: JoinedPeer, join_token: str
) -> None:
    other_run = await api.create_run("other")
    stranger = await api.join(
        other_run["id"], (await api.create_join_token(other_run["id"]))["token"]
    )
    assert (await upload(client, run, peer, 1, archive(1))).status_code == 201
    assert (await client.get(url(run))).status_code == 401
    assert (await client.get(url(run), headers=bearer(join_token))).status_code == 403
    refused = await client.get(url(run), headers=stranger.headers)
    assert refused.status_code == 403 and "another run" in refused.json()["detail"]
    for headers in (ORGANIZER, bearer(join_token), stranger.headers):
        response = await client.put(url(run, 2), content=archive(2), headers=headers)
        assert response.status_code == 403
    listing = await client.get(f"/api/v1/runs/{run['id']}/checkpoints", headers=peer.headers)
    assert listing.status_code == 403


async def test_older_or_equal_epochs_are_409(
    client: httpx.AsyncClient, run: dict[str, Any], peer: JoinedPeer, checkpoint_dir: Path
) -> None:
    assert (await upload(client, run, peer, 5, archive(5))).status_code == 201
    for epoch in (5, 4, 0):
        response = await upload(client, run, peer, epoch, archive(epoch))
        assert response.status_code == 409
        assert "epoch 5" in response.json()["detail"] and "newer" in response.json()["detail"]
    assert len(files(checkpoint_dir)) == 1
    assert (await upload(client, run, peer, 6, archive(6))).status_code == 201


async def test_the_newest_are_kept(
    client: httpx.AsyncClient, run: dict[str, Any], peer: JoinedPeer, checkpoint_dir: Path
) -> None:
    for epoch in (1, 2, 4, 7):
        assert (await upload(client, run, peer, epoch, archive(epoch))).status_code == 201
    listing = await client.get(f"/api/v1/runs/{run['id']}/checkpoints", headers=ORGANIZER)
    assert [c["epoch"] for c in listing.json()["checkpoints"]] == [7, 4]  # checkpoint_keep=2
    assert len(files(checkpoint_dir)) == 2
    download = await client.get(url(run), headers=ORGANIZER)
    assert download.content == archive(7) and download.headers["X-Checkpoint-Epoch"] == "7"


async def test_over_the_limit_is_413_and_leaves_nothing(
    app: FastAPI,
    client: httpx.AsyncClient,
    run: dict[str, Any],
    peer: JoinedPeer,
    checkpoint_dir: Path,
) -> None:
    limit = app.state.settings.checkpoint_max_bytes
    announced = await upload(client, run, peer, 1, archive(1, size=limit + 1))
    assert announced.status_code == 413
    assert str(limit) in announced.json()["detail"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: caught while streaming
        yield archive(1, size=64 * 1024)
        for _ in range(limit // (64 * 1024) + 1):
            yield bytes(64 * 1024)

    streamed = await upload(client, run, peer, 1, chunks())
    assert streamed.status_code == 413
    assert files(checkpoint_dir) == []
    assert (await upload(client, run, peer, 1, archive(1, size=limit))).status_code == 201


@pytest.mark.parametrize(
    "data", [b"", b"PK", b"not a zip archive", b"\x80\x02}q\x00.pickle"], ids=repr
)
async def test_anything_but_a_zip_archive_is_422(
    client: httpx.AsyncClient,
    run: dict[str, Any],
    peer: JoinedPeer,
    checkpoint_dir: Path,
    data: bytes,
) -> None:
    response = await upload(client, run, peer, 1, data)
    assert response.status_code == 422
    assert "zip archive" in response.json()["detail"]
    assert files(checkpoint_dir) == []


async def test_a_full_disk_is_507_and_leaves_nothing(
    client: httpx.AsyncClient,
    run: dict[str, Any],
    peer: JoinedPeer,
    checkpoint_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(file: int, block: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_service, "_write_block", full)
    response = await upload(client, run, peer, 1, archive(1))
    assert response.status_code == 507
    detail = response.json()["detail"]
    assert "No space left on device" in detail and "free disk space" in detail
    assert files(checkpoint_dir) == []
    listing = await client.get(f"/api/v1/runs/{run['id']}/checkpoints", headers=ORGANIZER)
    assert listing.json() == {"checkpoints": []}
    monkeypatch.undo()
    assert (await upload(client, run, peer, 1, archive(1))).status_code == 201


async def test_an_upload_overtaken_while_streaming_is_409(
    client: httpx.AsyncClient, run: dict[str, Any], peer: JoinedPeer, checkpoint_dir: Path
) -> None:
    """Epoch 5 starts first, epoch 6 finishes first: the later check refuses 5."""
    started, release = asyncio.Event(), asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield archive(5)
        started.set()
        await release.wait()
        yield bytes(100)

    older = asyncio.create_task(upload(client, run, peer, 5, slow()))
    await started.wait()
    assert (await upload(client, run, peer, 6, archive(6))).status_code == 201
    release.set()
    response = await older
    assert response.status_code == 409 and "epoch 6" in response.json()["detail"]
    assert len(files(checkpoint_dir)) == 1


async def test_archived_runs_take_no_checkpoints(
    client: httpx.AsyncClient, run: dict[str, Any], peer: JoinedPeer
) -> None:
    await client.delete(f"/api/v1/runs/{run['id']}", headers=ORGANIZER)
    response = await upload(client, run, peer, 1, archive(1))
    assert response.status_code == 409 and "archived" in response.json()["detail"]


async def test_invalid_epochs_are_422(
    client: httpx.AsyncClient, run: dict[str, Any], peer: JoinedPeer
) -> None:
    for query in ("", "?epoch=-1", "?epoch=x", f"?epoch={2**60}"):
        response = await client.put(url(run) + query, content=archive(1), headers=peer.headers)
        assert response.status_code == 422, query


@pytest.fixture
async def bounded(settings: Settings, checkpoint_dir: Path) -> AsyncIterator[FastAPI]:
    """A coordinator keeping 10 checkpoints per run but 5000 bytes in all."""
    bound = settings.model_copy(update={"checkpoint_keep": 10, "checkpoint_dir_max_bytes": 5000})
    async with running(create_app(bound)) as application:
        yield application


async def test_the_directory_bound_removes_the_oldest_but_each_runs_newest(
    bounded: FastAPI, checkpoint_dir: Path
) -> None:
    async with client_for(bounded) as client:
        api = Api(client)
        a, b = await api.create_run("a"), await api.create_run("b")
        peers = {}
        for run in (a, b):
            token = (await api.create_join_token(run["id"]))["token"]
            peers[run["id"]] = await api.join(run["id"], token)

        async def put(run: dict[str, Any], epoch: int, size: int = 1000) -> httpx.Response:
            return await upload(client, run, peers[run["id"]], epoch, archive(epoch, size))

        async def kept() -> dict[str, list[int]]:
            found = {}
            for run in (a, b):
                listing = await client.get(f"/api/v1/runs/{run['id']}/checkpoints",
                                           headers=ORGANIZER)  # fmt: skip
                found[run["name"]] = [c["epoch"] for c in listing.json()["checkpoints"]]
            return found

        for run, epoch in ((a, 1), (a, 2), (b, 1), (a, 3), (b, 2)):
            assert (await put(run, epoch)).status_code == 201
        assert (await put(a, 4)).status_code == 201  # 6000 bytes: a's epoch 1 goes
        assert await kept() == {"a": [4, 3, 2], "b": [2, 1]}
        assert (await put(b, 3, size=2500)).status_code == 201  # then a:2, a:3, b:1
        assert await kept() == {"a": [4], "b": [3, 2]}
        assert len(files(checkpoint_dir)) == 3

        # Fits alone, but not beside b's newest: refused, and nothing removed for it.
        crowded = await put(a, 5, size=4000)
        assert crowded.status_code == 507
        assert "SWARMGRAD_CHECKPOINT_DIR_MAX_BYTES" in crowded.json()["detail"]
        assert await kept() == {"a": [4], "b": [3, 2]}
        assert len(files(checkpoint_dir)) == 3
        download = await client.get(url(a), headers=ORGANIZER)
        assert download.content == archive(4)


async def test_an_upload_alone_over_the_directory_bound_is_413_and_changes_nothing(
    bounded: FastAPI, checkpoint_dir: Path
) -> None:
    async with client_for(bounded) as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        peer = await api.join(run["id"], token)
        assert (await upload(client, run, peer, 1, archive(1, 3000))).status_code == 201
        before = contents(checkpoint_dir)

        announced = await upload(client, run, peer, 2, archive(2, 5001))
        assert announced.status_code == 413
        detail = announced.json()["detail"]
        assert "5000" in detail and "SWARMGRAD_CHECKPOINT_DIR_MAX_BYTES" in detail

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: caught while streaming
            yield archive(2, 4096)
            yield bytes(4096)

        assert (await upload(client, run, peer, 2, chunks())).status_code == 413
        assert contents(checkpoint_dir) == before
        download = await client.get(url(run), headers=ORGANIZER)
        assert download.content == archive(1, 3000)


def _at_epoch(app: FastAPI, peer: JoinedPeer, epoch: int) -> None:
    """Record ``peer`` as online at ``epoch``, as its stored reports would."""
    with app.state.session_factory() as session:
        session.execute(
            update(Peer)
            .where(Peer.peer_id == peer.body["peer_id"])
            .values(epoch=epoch, last_report_ms=now_ms(), last_seen_ms=now_ms())
        )
        session.commit()


async def test_an_epoch_the_swarm_has_not_reached_is_refused_and_logged(
    client: httpx.AsyncClient,
    run: dict[str, Any],
    peer: JoinedPeer,
    checkpoint_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    far = await upload(client, run, peer, 2**53, archive(1))
    assert far.status_code == 422 and "not one the swarm has reached" in far.json()["detail"]
    logged = [r.getMessage() for r in caplog.records if "refused a checkpoint" in r.getMessage()]
    assert logged and "volunteer" in logged[0] and peer.body["peer_id"] in logged[0]
    assert files(checkpoint_dir) == []
    assert (await upload(client, run, peer, 5, archive(5))).status_code == 201


async def test_only_the_designated_uploader_or_two_invites_set_the_checkpoint(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    invites = [
        (await api.create_join_token(run["id"], label=f"lab {i}"))["token"] for i in range(3)
    ]
    peers = sorted(
        [await api.join(run["id"], invite) for invite in invites],
        key=lambda p: p.body["peer_id"],
    )
    low, middle, high = peers
    for p in peers:
        _at_epoch(app, p, 4)
    held = await upload(client, run, high, 5, archive(5))
    assert held.status_code == 202 and "another invite" in held.json()["detail"]
    assert (await client.get(url(run), headers=ORGANIZER)).status_code == 404
    # Another volunteer's upload of the same bytes agrees: taken.
    assert (await upload(client, run, middle, 5, archive(5))).status_code == 201
    # The designated uploader alone is taken at once (one epoch past the others).
    for p in peers:
        _at_epoch(app, p, 5)
    assert (await upload(client, run, low, 6, archive(6))).status_code == 201
    # A different digest from a second volunteer is no agreement.
    for p in peers:
        _at_epoch(app, p, 6)
    assert (await upload(client, run, high, 7, archive(7))).status_code == 202
    assert (await upload(client, run, middle, 7, archive(8))).status_code == 202
    download = await client.get(url(run), headers=ORGANIZER)
    assert download.headers["X-Checkpoint-Epoch"] == "6"


async def test_volunteers_of_one_invite_never_agree(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    """A shared invite mints a volunteer per key: they are one witness, not two."""
    peers = sorted(
        [await api.join(run["id"], join_token) for _ in range(3)],
        key=lambda p: p.body["peer_id"],
    )
    for p in peers:
        _at_epoch(app, p, 4)
    for p in peers[1:]:
        assert (await upload(client, run, p, 5, archive(5))).status_code == 202
    assert (await client.get(url(run), headers=ORGANIZER)).status_code == 404
    assert (await upload(client, run, peers[0], 5, archive(6))).status_code == 201


@pytest.mark.parametrize("ahead", [7, 105])
async def test_an_epoch_past_what_the_others_reached_is_held_and_blocks_nothing(
    app: FastAPI,
    api: Api,
    client: httpx.AsyncClient,
    run: dict[str, Any],
    join_token: str,
    checkpoint_dir: Path,
    ahead: int,
) -> None:
    peers = sorted(
        [await api.join(run["id"], join_token) for _ in range(4)],
        key=lambda p: p.body["peer_id"],
    )
    for p in peers:
        _at_epoch(app, p, 5)
    # Nobody is at 6, so nobody else is designated for 7: only the epoch gate holds it.
    held = await upload(client, run, peers[1], ahead, archive(ahead))
    assert held.status_code == 202 and "more than one past" in held.json()["detail"]
    assert files(checkpoint_dir) == []
    assert (await client.get(url(run), headers=ORGANIZER)).status_code == 404
    # The same bytes from a volunteer of another invite are no agreement either.
    identity = Identity()
    while identity.peer_id <= peers[0].body["peer_id"]:  # peers[0] stays the designated one
        identity = Identity()
    invite = (await api.create_join_token(run["id"]))["token"]
    other = await api.join(run["id"], invite, identity)
    _at_epoch(app, other, 5)
    assert (await upload(client, run, other, ahead, archive(ahead))).status_code == 202
    taken = await upload(client, run, peers[0], 6, archive(6))
    assert taken.status_code == 201, taken.text
    served = await client.get(url(run), headers=ORGANIZER)
    assert served.headers["X-Checkpoint-Epoch"] == "6" and served.content == archive(6)


async def test_a_swarm_ahead_of_its_reports_uploads_at_its_pace(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    """Reports come an interval apart; a swarm that passes several epochs in one counts as
    far as it advanced over the last intervals, so its designated upload is taken."""
    peers = sorted(
        [await api.join(run["id"], join_token) for _ in range(3)],
        key=lambda p: p.body["peer_id"],
    )
    for epoch in (10, 16):
        for p in peers:
            assert (await api.report(run["id"], p, epoch=epoch)).status_code == 202

    def written() -> bool:
        with app.state.session_factory() as session:
            return {p.epoch for p in session.query(Peer)} == {16}

    assert await wait_until_async(written, 10)
    # 16 + 6 (advanced since the previous report) + 1 = 23 is the furthest taken.
    assert (await upload(client, run, peers[0], 24, archive(24))).status_code == 202
    assert (await upload(client, run, peers[0], 23, archive(23))).status_code == 201


async def test_when_the_designated_uploader_went_silent_the_next_one_is_designated(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peers = sorted(
        [await api.join(run["id"], join_token) for _ in range(3)],
        key=lambda p: p.body["peer_id"],
    )
    for p in peers:
        _at_epoch(app, p, 5)
    assert (await upload(client, run, peers[1], 6, archive(6))).status_code == 202
    silent_since = now_ms() - 3600_000  # far past the online TTL
    with app.state.session_factory() as session:
        session.execute(
            update(Peer)
            .where(Peer.peer_id == peers[0].body["peer_id"])
            .values(last_seen_ms=silent_since, last_report_ms=silent_since)
        )
        session.commit()
    taken = await upload(client, run, peers[1], 6, archive(6))
    assert taken.status_code == 201, taken.text
    assert (await client.get(url(run), headers=ORGANIZER)).content == archive(6)


def test_what_the_others_reached_is_the_second_highest_invite() -> None:
    progress = [
        admission.Progress(1, epoch=5, advanced=0, invite_id="a"),
        admission.Progress(2, epoch=5, advanced=2, invite_id="b"),
        admission.Progress(3, epoch=104, advanced=0, invite_id="c"),  # one liar's invite
        admission.Progress(4, epoch=200, advanced=0, invite_id="c"),  # the uploader's own
    ]
    assert admission.reached(progress, 4) == 7
    assert admission.reached(progress[:1] + progress[3:], 4) == 5  # one other: its epoch
    assert admission.reached(progress[3:], 4) is None  # alone online: the swarm
    assert admission.held_ahead(9, 7) and not admission.held_ahead(8, 7)
    assert not admission.held_ahead(10**6, None)


def test_the_volunteers_one_invite_minted_count_as_their_median() -> None:
    def shared(*epochs: int) -> list[admission.Progress]:
        return [admission.Progress(v, e, 0, "shared") for v, e in enumerate(epochs, start=1)]

    # Two liars among three honest volunteers of one invite, and a third uploading.
    assert admission.reached(shared(5, 5, 5, 104, 104, 200), 6) == 5
    # A newcomer still catching up does not hold the others back.
    assert admission.reached(shared(9, 0, 200), 3) == 9
    assert admission.reached(shared(9, 9, 0, 200), 4) == 9
    # Organizer-added volunteers (no invite) count each as their own.
    alone = [admission.Progress(1, 5, 0), admission.Progress(2, 104, 0), *shared(0, 0, 200)[2:]]
    assert admission.reached(alone, 3) == 5


async def test_two_keys_of_one_volunteer_never_agree(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    with app.state.session_factory() as session:
        redeemed = volunteer_service.redeem_invite(session, join_token, "mallory", token_ttl_s=60)
        session.commit()
    keys = [await api.join(run["id"], redeemed.token) for _ in range(2)]
    # An honest volunteer whose id sorts first stays the designated uploader; its key is
    # drawn here, not by joining again and again (each join spends one use of the invite).
    lowest = min(k.body["peer_id"] for k in keys)
    identity = Identity()
    while identity.peer_id >= lowest:
        identity = Identity()
    low = await api.join(run["id"], join_token, identity)
    assert low.body["peer_id"] == identity.peer_id
    for p in (low, *keys):
        _at_epoch(app, p, 4)
    for key in keys:
        assert (await upload(client, run, key, 5, archive(5))).status_code == 202
    assert (await client.get(url(run), headers=ORGANIZER)).status_code == 404


async def test_the_organizer_pins_and_deletes_checkpoints(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], peer: JoinedPeer, join_token: str,
    checkpoint_dir: Path,
) -> None:  # fmt: skip
    base = f"/api/v1/runs/{run['id']}/checkpoints"
    for epoch in (1, 2, 4):
        assert (await upload(client, run, peer, epoch, archive(epoch))).status_code == 201
    assert (await client.post(f"{base}/1/pin", headers=ORGANIZER)).status_code == 404
    assert (await client.post(f"{base}/2/pin", headers=peer.headers)).status_code == 403
    pinned = await client.post(f"{base}/2/pin", headers=ORGANIZER)
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    download = await client.get(url(run), headers=ORGANIZER)
    assert download.content == archive(2) and download.headers["X-Checkpoint-Epoch"] == "2"
    newcomer = await api.join(run["id"], join_token)
    assert newcomer.body["checkpoint"]["epoch"] == 2
    # Kept beyond checkpoint_keep while pinned.
    assert (await upload(client, run, peer, 7, archive(7))).status_code == 201
    listing = (await client.get(base, headers=ORGANIZER)).json()["checkpoints"]
    assert [(c["epoch"], c["pinned"]) for c in listing] == [(7, False), (4, False), (2, True)]
    # Deleting the newest lets uploads after the next newest in again.
    assert (await client.delete(f"{base}/7", headers=ORGANIZER)).status_code == 204
    assert (await client.delete(f"{base}/7", headers=ORGANIZER)).status_code == 404
    assert (await upload(client, run, peer, 5, archive(5))).status_code == 201
    assert (await client.delete(f"{base}/pin", headers=ORGANIZER)).status_code == 204
    assert (await client.get(url(run), headers=ORGANIZER)).content == archive(5)
    assert len(files(checkpoint_dir)) == 3  # 5, 4 and the formerly pinned 2
