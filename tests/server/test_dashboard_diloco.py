"""A DiLoCo run's dashboard counts outer rounds, and says so: its data names the run's
algorithm and the run page labels the epoch "Outer round" (a collaborative run's, "Epoch")."""

from __future__ import annotations

import re

import httpx

from tests.server.conftest import Api


def epoch_label(page: str) -> str:
    found = re.search(r'<dt>([^<]*)</dt><dd data-metric="epoch">', page)
    assert found, "the run page shows the epoch"
    return found.group(1)


async def test_a_diloco_runs_epoch_is_labelled_as_an_outer_round(
    client: httpx.AsyncClient, api: Api
) -> None:
    diloco = await api.create_run(name="outer", config={"algorithm": "diloco", "inner_steps": 5})
    plain = await api.create_run(name="plain", config={"algorithm": "collaborative"})
    default = await api.create_run(name="default")
    for run, algorithm, label in (
        (diloco, "diloco", "Outer round"),
        (plain, "collaborative", "Epoch"),
        (default, "collaborative", "Epoch"),
    ):
        document = (await client.get(f"/api/v1/runs/{run['id']}/dashboard")).json()
        assert document["run"]["algorithm"] == algorithm, run["name"]
        page = await client.get(f"/runs/{run['id']}")
        assert page.status_code == 200, page.text
        assert epoch_label(page.text) == label, run["name"]
