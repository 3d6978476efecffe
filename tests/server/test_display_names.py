"""A display name is one volunteer's in a run, compared without case, whichever way they join:
the invite page (tests/server/test_pages.py) or ``swarmgrad join --name`` with an invite."""

from __future__ import annotations

from typing import Any

from peer.formats.identity import Identity
from tests.server.conftest import ADMIN_TOKEN, Api


async def test_joining_with_a_taken_name_is_refused_and_spends_nothing(
    api: Api, run: dict[str, Any]
) -> None:
    invite = await api.create_join_token(run["id"], max_uses=5)
    ada = Identity()
    await api.join(run["id"], invite["token"], ada, display_name="Ada")
    taken = await api.join(run["id"], invite["token"], display_name="ADA", expect=409)
    assert taken.body["detail"] == (
        "The display name “ADA” is already taken in this run; choose another."
    )
    # The holder of the name rejoins under it; nameless joiners share the default name.
    await api.join(run["id"], invite["token"], ada, display_name="Ada")
    await api.join(run["id"], invite["token"])
    await api.join(run["id"], invite["token"])
    tokens = (
        await api.client.get(
            f"/api/v1/runs/{run['id']}/tokens", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
    ).json()["tokens"]
    assert next(t["uses"] for t in tokens if t["id"] == invite["id"]) == 3
    # Nor can a volunteer rename itself to another's name.
    await api.join(run["id"], invite["token"], ada, display_name="anonymous VOLUNTEER", expect=409)
