"""The organizer's calls of the coordinator's REST API: runs, invites, organizer tokens and the
checkpoints kept, each with an organizer token. What ``swarmgrad runs``, ``invite`` and
``tokens`` use, through :class:`~peer.coordinator.client.CoordinatorClient`.

Each call sends its request of :mod:`peer.formats.requests` and returns its answer of
:mod:`peer.formats.payloads`. The requests are built as given, not checked here: the
coordinator checks them with its own version of those rules, and its refusal
(:class:`~peer.coordinator.exceptions.RequestRejected`, naming the field) is what the caller
hears.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote

from peer.coordinator.connection import API_PREFIX, CoordinatorConnection, run_path
from peer.formats.open_types import ConfigValues
from peer.formats.payloads import (
    CheckpointPublic,
    CheckpointsPublic,
    OrganizerTokenCreated,
    OrganizerTokenPublic,
    OrganizerTokensPublic,
    ProgressPublic,
    RunPublic,
    RunsPublic,
    RunStatus,
    TokenCreated,
)
from peer.formats.requests import (
    OrganizerTokenCreate,
    RunCreate,
    RunUpdate,
    TaskFileCreate,
    TokenCreate,
)

__all__ = ["OrganizerCalls"]


class OrganizerCalls(CoordinatorConnection):
    """The calls an organizer makes (``token``: an organizer token of the coordinator)."""

    def create_run(
        self,
        token: str,
        name: str,
        task: str,
        config: ConfigValues | None = None,
        *,
        min_volunteers: int | None = None,
        task_file: TaskFileCreate | Mapping[str, object] | None = None,
    ) -> RunPublic:
        """Create a run with ``config``, the hyper-parameters its peers read (free-form JSON):
        running, or with ``min_volunteers`` paused until that many volunteers are online (it
        then starts by itself); ``task_file`` ships a Python file with it (``filename``,
        ``content`` base64, ``requirements``: :func:`peer.tasks.shipped.task_file_body`).
        Returns it."""
        fields: dict[str, object] = {"name": name, "task": task, "config": dict(config or {})}
        if min_volunteers is not None:
            fields["min_volunteers"] = min_volunteers
        if task_file is not None:
            fields["task_file"] = (
                task_file
                if isinstance(task_file, TaskFileCreate)
                else TaskFileCreate.model_construct(set(task_file), **task_file)
            )
        request = RunCreate.model_construct(set(fields), **fields)
        body = self._json("POST", f"{API_PREFIX}/runs", token=token, body=request)
        return self._parse(RunPublic, body)

    def list_runs(self, *, include_archived: bool = False) -> list[RunPublic]:
        """Runs, newest first (public)."""
        params = {"include_archived": "true"} if include_archived else None
        return self._parse(RunsPublic, self._json("GET", f"{API_PREFIX}/runs", params=params)).runs

    def progress(self, run_id: str) -> ProgressPublic:
        """The run's progress as the dashboard shows it (public, no token)."""
        return self._parse(ProgressPublic, self._json("GET", run_path(run_id, "progress")))

    def update_run(
        self,
        token: str,
        run_id: str,
        *,
        name: str | None = None,
        status: RunStatus | str | None = None,
        config: ConfigValues | None = None,
        min_volunteers: int | None = None,
    ) -> RunPublic:
        """Change the run's ``name``, ``status`` ("running", "paused", "finished") or
        ``config``, or hold it until ``min_volunteers`` are online (then it starts by
        itself); what is None stays as it is. ``ValueError`` for a status no run has.
        Returns the run as changed."""
        changes = {
            "name": name,
            "status": None if status is None else RunStatus(status),
            "config": None if config is None else dict(config),
            "min_volunteers": min_volunteers,
        }
        request = RunUpdate.model_construct(_given(changes), **changes)
        body = self._json("PATCH", run_path(run_id), token=token, body=request)
        return self._parse(RunPublic, body)

    def create_invite(
        self,
        token: str,
        run_id: str,
        *,
        max_uses: int | None = None,
        expires_in_s: float | None = None,
        label: str | None = None,
    ) -> TokenCreated:
        """A join token for volunteers, with its limits (those None: the coordinator's
        defaults). The token is shown only in this answer."""
        limits = {"max_uses": max_uses, "expires_in_s": expires_in_s, "label": label}
        request = TokenCreate.model_construct(_given(limits), **limits)
        body = self._json("POST", run_path(run_id, "tokens"), token=token, body=request)
        return self._parse(TokenCreated, body)

    def list_organizer_tokens(self, token: str) -> list[OrganizerTokenPublic]:
        """The coordinator's organizer tokens, oldest first, without secrets (``current``
        marks the caller's)."""
        return self._parse(
            OrganizerTokensPublic, self._json("GET", f"{API_PREFIX}/tokens", token=token)
        ).tokens

    def create_organizer_token(
        self, token: str, *, label: str | None = None, expires_in_s: float | None = None
    ) -> OrganizerTokenCreated:
        """A new organizer token, shown only in this answer."""
        fields = {"label": label, "expires_in_s": expires_in_s}
        request = OrganizerTokenCreate.model_construct(_given(fields), **fields)
        answer = self._json("POST", f"{API_PREFIX}/tokens", token=token, body=request)
        return self._parse(OrganizerTokenCreated, answer)

    def revoke_organizer_token(self, token: str, token_id: str) -> None:
        """Revoke an organizer token. :class:`RequestRejected` (409) for the caller's own
        token while it is the coordinator's last one."""
        self._request("DELETE", f"{API_PREFIX}/tokens/{quote(token_id, safe='')}", token=token)

    def list_checkpoints(self, token: str, run_id: str) -> list[CheckpointPublic]:
        """The checkpoints the coordinator keeps for the run, newest first."""
        return self._parse(
            CheckpointsPublic, self._json("GET", run_path(run_id, "checkpoints"), token=token)
        ).checkpoints

    def pin_checkpoint(self, token: str, run_id: str, epoch: int) -> CheckpointPublic:
        """Serve the checkpoint of ``epoch`` (downloads, joining peers) instead of the newest,
        until unpinned; returns it. :class:`NotFound` when the run has none of that epoch."""
        return self._parse(
            CheckpointPublic,
            self._json("POST", run_path(run_id, f"checkpoints/{int(epoch)}/pin"), token=token),
        )

    def unpin_checkpoint(self, token: str, run_id: str) -> None:
        """Serve the run's newest checkpoint again."""
        self._request("DELETE", run_path(run_id, "checkpoints/pin"), token=token)

    def delete_checkpoint(self, token: str, run_id: str, epoch: int) -> None:
        """Remove the checkpoint of ``epoch``; :class:`NotFound` when there is none."""
        self._request("DELETE", run_path(run_id, f"checkpoints/{int(epoch)}"), token=token)


def _given(values: Mapping[str, object]) -> set[str]:
    """The names of the values that are not None: the fields a request sets (and sends)."""
    return {name for name, value in values.items() if value is not None}
