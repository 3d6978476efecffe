"""A run's shared settings are checked where runs are made: a bad value is a 422 and no run."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from peer.formats.run_config import BASE_DEFAULTS, FIELD_CHECKS, check_run_settings
from tests.server.conftest import ORGANIZER, Api

# One bad value per shared setting: the wrong type or out of its range.
BAD_VALUES: dict[str, Any] = {
    "target_batch_size": 0,
    "batch_size": 2.5,
    "optimizer": "lbfgs",
    "lr": -0.1,
    "momentum": 1.0,
    "weight_decay": -1,
    "epochs": 0,
    "checkpoint_every": -1,
    "seed": 2**63,
    "matchmaking_time": 0,
    "averaging_timeout": "long",
    "max_machines": 10_001,
    "aggregator": "bogus",
    "relative_weight_bound": 0.5,
    "group_size": 1,
    "algorithm": "fedavg",
    "inner_steps": 0,
    "outer_lr": 0,
    "outer_momentum": -0.5,
    "fragments": 1025,
    "compression": "zip",
    "overlap": "yes",
    "local_buffers": "no",
    "recompute_statistics": -1,
    "accumulation": 0,
    "precision": "fp8",
    "max_grad_norm": 0,
    "lr_schedule": "exponential",
    "warmup_epochs": -1,
}


def test_every_shared_setting_has_a_bad_value_here() -> None:
    assert set(BAD_VALUES) == set(FIELD_CHECKS) == set(BASE_DEFAULTS)


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
async def test_a_bad_value_of_a_shared_setting_is_refused_and_makes_no_run(
    key: str, client: httpx.AsyncClient
) -> None:
    body = {"name": "r", "task": "digits", "config": {key: BAD_VALUES[key]}}
    response = await client.post("/api/v1/runs", json=body, headers=ORGANIZER)
    assert response.status_code == 422, response.text
    assert f"{key}:" in str(response.json()["detail"])
    assert (await client.get("/api/v1/runs")).json()["runs"] == []


async def test_a_change_of_config_is_checked_too(api: Api, client: httpx.AsyncClient) -> None:
    run = await api.create_run()
    url = f"/api/v1/runs/{run['id']}"
    response = await client.patch(url, json={"config": {"aggregator": "bogus"}}, headers=ORGANIZER)
    assert response.status_code == 422 and "aggregator" in response.text
    assert (await client.get(url)).json()["config"] == run["config"]


async def test_settings_that_depend_on_each_other_are_checked_together(
    client: httpx.AsyncClient,
) -> None:
    body = {"name": "r", "task": "digits", "config": {"inner_steps": 4, "fragments": 8}}
    response = await client.post("/api/v1/runs", json=body, headers=ORGANIZER)
    assert response.status_code == 422 and "fragments: at most inner_steps (4)" in response.text
    body["config"] = {"fragments": 8}  # inner_steps' default (100) fills in
    assert (await client.post("/api/v1/runs", json=body, headers=ORGANIZER)).status_code == 201


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"lr_schedule": "cosine"}, "lr_schedule: cosine decays to the run's last epoch"),
        ({"epochs": 5, "warmup_epochs": 5}, "warmup_epochs: less than epochs (5)"),
    ],
)
async def test_a_schedule_is_checked_against_the_runs_epochs(
    config: dict[str, Any], refusal: str, client: httpx.AsyncClient
) -> None:
    body = {"name": "r", "task": "mine:task", "config": config}
    response = await client.post("/api/v1/runs", json=body, headers=ORGANIZER)
    assert response.status_code == 422 and refusal in response.text, response.text
    body["config"] = {**config, "epochs": 20, "accumulation": 4, "precision": "bf16"}
    response = await client.post("/api/v1/runs", json=body, headers=ORGANIZER)
    assert response.status_code == 201, response.text


async def test_good_values_and_the_tasks_own_keys_pass(client: httpx.AsyncClient) -> None:
    config = {"aggregator": "trimmed_mean", "compression": "bf16", "target_batch_size": 512.0}
    body = {"name": "r", "task": "mine:task", "config": {**config, "hidden": 16}}
    response = await client.post("/api/v1/runs", json=body, headers=ORGANIZER)
    assert response.status_code == 201, response.text
    # JSON's one number type: stored as the integer every peer reads it as
    assert response.json()["config"]["target_batch_size"] == 512
    assert response.json()["config"]["hidden"] == 16


def test_the_coordinators_schema_names_what_the_peer_library_implements() -> None:
    """The schema is torch-free, so it lists the names; they must match the registries."""
    from peer.averaging.allreduce.robust import AGGREGATORS
    from peer.compression import LEAF_CODECS, compression_from_name
    from peer.formats import run_config

    assert set(run_config.AGGREGATORS) == set(AGGREGATORS)
    assert set(run_config.COMPRESSIONS) == set(LEAF_CODECS)
    for alias, name in run_config.COMPRESSION_ALIASES.items():
        assert compression_from_name(alias).name == name
    for name in run_config.COMPRESSIONS:
        assert check_run_settings({"compression": name}) == {"compression": name}
