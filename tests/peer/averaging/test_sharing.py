"""StateSharing on its own: it is handed the node, the state and the locks, so a stand-in
core that records what it is told to declare is enough to test it, with no network."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from peer.averaging.protocol import STATE_BEGIN, STATE_CHUNK, STATE_DIGEST, STATE_HASH
from peer.averaging.sharing.download import state_key
from peer.averaging.sharing.state_sharing import StateSharing
from peer.compression import NoCompression
from peer.wire import Frame
from tests.conftest import scaled


class _Core:
    """What StateSharing uses of a node's core: its id, clock and gossip store."""

    peer_id = "me"

    def __init__(self) -> None:
        self.stored: asyncio.Queue[tuple[str, Any, Any]] = asyncio.Queue()

    def now(self) -> float:
        return 1000.0

    async def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        await self.stored.put((key, value, subkey))
        return True


class _Node:
    """What StateSharing uses of the node as training code holds it: its loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()


@contextlib.asynccontextmanager
async def _locked() -> AsyncIterator[None]:
    yield


@contextlib.contextmanager
def _hold() -> Iterator[None]:
    yield


def _sharing(allow: bool, client_mode: bool = False) -> StateSharing:
    tensors = [torch.arange(6.0)]
    return StateSharing(
        _Node(),  # type: ignore[arg-type]
        "p",
        get_state=lambda: ({"epoch": 3}, tensors),
        locked=_locked,
        hold=_hold,
        compression=NoCompression(),
        chunk_bytes=8,
        request_timeout=1.0,
        chunk_timeout=1.0,
        declare_period=3600.0,  # only a change of settings declares again within a test
        allow=allow,
        client_mode=client_mode,
    )


async def _next(core: _Core) -> tuple[str, Any, Any]:
    return await asyncio.wait_for(core.stored.get(), scaled(5))


async def test_a_donor_declares_its_priority_again_when_it_changes_and_retracts_on_stop() -> None:
    sharing, core = _sharing(allow=True), _Core()
    sharing.start(core)  # type: ignore[arg-type]
    try:
        assert await _next(core) == (state_key("p"), 0.0, "me")
        sharing.priority = 7.0
        assert await _next(core) == (state_key("p"), 7.0, "me")
        sharing.allow = False
        assert await _next(core) == (state_key("p"), None, "me")  # retracted at once
    finally:
        await sharing.stop()
    assert await _next(core) == (state_key("p"), None, "me")


async def test_a_peer_that_does_not_share_serves_nothing_but_a_transfer_it_began() -> None:
    sharing = _sharing(allow=True)
    sharing.start(_Core())  # type: ignore[arg-type]
    try:
        digest = await sharing.serve(None, Frame(STATE_DIGEST, {"p": "p"}))  # type: ignore[arg-type]
        assert digest.type == STATE_HASH and digest.fields["e"] == 0.0
        info = await sharing.serve(None, Frame(STATE_BEGIN, {"p": "p"}))  # type: ignore[arg-type]
        assert info.fields["n"] == 3  # 24 bytes in chunks of 8
        sharing.allow = False
        for kind in (STATE_BEGIN, STATE_DIGEST):
            with pytest.raises(ValueError, match="does not share"):
                await sharing.serve(None, Frame(kind, {"p": "p"}))  # type: ignore[arg-type]
        chunk = Frame(STATE_CHUNK, {"p": "p", "t": info.fields["t"], "i": 0})
        data = await sharing.serve(None, chunk)  # type: ignore[arg-type]
        assert bytes(data.payload) == torch.arange(6.0).numpy().tobytes()[:8]
    finally:
        await sharing.stop()


def test_a_client_mode_peer_cannot_share() -> None:
    async def make(allow: bool) -> StateSharing:
        return _sharing(allow=allow, client_mode=True)

    with pytest.raises(ValueError, match="client-mode"):
        asyncio.run(make(True))
    sharing = asyncio.run(make(False))
    with pytest.raises(ValueError, match="client-mode"):
        sharing.allow = True
