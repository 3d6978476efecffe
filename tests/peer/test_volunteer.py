"""The volunteer's identity key, device choice and how training ends when its credentials
do (the join flow itself runs in tests/e2e)."""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from peer.coordinator import Unauthorized
from peer.exceptions import SwarmgradError
from peer.trainer import Trainer
from peer.volunteer import (
    DeviceError,
    JoinOptions,
    Volunteer,
    VolunteerStatus,
    load_identity,
    resolve_device,
)


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


def test_training_ends_with_one_line_once_the_coordinator_refuses_the_peer_token(
    tmp_path: Path,
) -> None:
    line = "the coordinator no longer accepts this peer's token (expired); join again"
    updates: list[VolunteerStatus] = []
    volunteer = Volunteer(
        JoinOptions("http://c", "sgj_x", data_dir=tmp_path), on_update=updates.append
    )
    steps: list[object] = []
    task = SimpleNamespace(train_batches=lambda config, peer_id: iter([object()]))
    session = SimpleNamespace(credentials_lost=None, status="running")
    trainer = Trainer(
        volunteer, None, SimpleNamespace(peer_id="p"), session, task, None, None, None
    )
    trainer._step = steps.append  # type: ignore[method-assign]
    try:
        session.credentials_lost = line
        with pytest.raises(Unauthorized) as refused:
            trainer.run()
    finally:
        trainer.close()
    assert str(refused.value) == line and steps == []
    assert updates[-1].state == "stopped" and updates[-1].message is None
