"""The volunteer's identity key and device choice (the join flow itself runs in tests/e2e)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from peer.exceptions import SwarmgradError
from peer.volunteer import DeviceError, load_identity, resolve_device


def test_the_identity_is_kept_privately_so_a_restart_is_the_same_peer(tmp_path: Path) -> None:
    first = load_identity(tmp_path / "data")
    again = load_identity(tmp_path / "data")
    assert again.peer_id == first.peer_id
    key = tmp_path / "data" / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert load_identity(tmp_path / "other").peer_id != first.peer_id


def test_a_file_that_is_not_a_key_is_refused_not_replaced(tmp_path: Path) -> None:
    key = tmp_path / "identity.key"
    key.write_bytes(b"not a key")
    with pytest.raises(SwarmgradError, match="not a swarmgrad identity key"):
        load_identity(tmp_path)
    assert key.read_bytes() == b"not a key"


def test_devices() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda")
    with pytest.raises(DeviceError, match="unknown device"):
        resolve_device("tpu")
