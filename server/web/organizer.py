"""The organizer's forms: pause, resume and finish a run (finishing asks first), hold it until
enough volunteers are online, create and revoke invites, ban a volunteer (then offer to
revoke the invites it came through), pin, unpin and delete checkpoints, and download the one
served. Each needs a signed-in organizer
and the form's CSRF token, and answers with a redirect back to the page (POST/redirect/GET),
carrying what happened in the query string only when it is no secret."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from server.api.deps import SessionDep, SettingsDep
from server.exceptions import CoordinatorError, NotFound
from server.models import Run, RunStatus, Token, Volunteer
from server.schemas import RunUpdate, TokenCreate
from server.services import checkpoints as checkpoint_service
from server.services import dashboard as dashboard_service
from server.services import runs as run_service
from server.services import tokens as token_service
from server.services import volunteers as volunteer_service
from server.web.rendering import (
    CsrfField,
    Organizer,
    PageError,
    check_csrf,
    find_run,
    render,
    require_organizer,
)

router = APIRouter(include_in_schema=False)


def organizer_form(request: Request, organizer: Organizer, csrf: CsrfField = None) -> str:
    """A form sent from this site (its CSRF token checked first) by a signed-in organizer."""
    check_csrf(request, csrf)
    return require_organizer(organizer)


OrganizerForm = Annotated[str, Depends(organizer_form)]


@dataclass(frozen=True, slots=True)
class Action:
    status: RunStatus
    allowed_from: frozenset[RunStatus]
    done: str


ACTIONS = {
    "pause": Action(RunStatus.paused, frozenset({RunStatus.running}), "paused"),
    "resume": Action(RunStatus.running, frozenset({RunStatus.paused}), "resumed"),
    "finish": Action(
        RunStatus.finished, frozenset({RunStatus.running, RunStatus.paused}), "finished"
    ),
}


@router.get("/runs/{run_id}/finish", response_class=HTMLResponse)
def finish_page(
    request: Request, run_id: str, session: SessionDep, organizer: Organizer
) -> HTMLResponse:
    """Finishing cannot be undone: the organizer confirms it on this page first."""
    require_organizer(organizer)
    run = find_run(session, run_id)
    if run.status not in ACTIONS["finish"].allowed_from:
        raise PageError(409, f"The run is {run.status.value}: it cannot be finished.")
    return render(request, "finish.html", {"run": run}, organizer=organizer)


@router.post("/runs/{run_id}/actions/{action}")
def run_action(
    run_id: str,
    action: str,
    session: SessionDep,
    organizer: OrganizerForm,
    confirm: Annotated[str, Form()] = "",
) -> Response:
    if action not in ACTIONS:
        raise PageError(404, "There is no such action.")
    run = find_run(session, run_id)
    if run.status not in ACTIONS[action].allowed_from:
        raise PageError(409, f"The run is {run.status.value}: it cannot be {ACTIONS[action].done}.")
    if action == "finish" and confirm != "yes":  # only from the confirmation page
        return RedirectResponse(f"/runs/{run.id}/finish", status_code=303)
    try:
        run_service.update_run(session, run, RunUpdate(status=ACTIONS[action].status))
    except CoordinatorError as exc:
        raise PageError(exc.status_code, exc.detail) from None
    session.commit()
    return RedirectResponse(f"/runs/{run.id}", status_code=303)


@router.post("/runs/{run_id}/wait")
def wait_for_volunteers(
    run_id: str,
    session: SessionDep,
    settings: SettingsDep,
    organizer: OrganizerForm,
    min_volunteers: Annotated[str, Form()] = "",
) -> Response:
    """Hold the run until this many volunteers are online (it starts at once if they are)."""
    run = find_run(session, run_id)
    try:
        body = RunUpdate(min_volunteers=int(min_volunteers))
    except ValueError:
        raise PageError(
            422, "The number of volunteers must be a whole number of at least 1."
        ) from None
    try:
        run_service.update_run(session, run, body, online_ttl_s=settings.peer_online_ttl_s)
    except CoordinatorError as exc:
        raise PageError(exc.status_code, exc.detail) from None
    session.commit()
    return RedirectResponse(f"/runs/{run.id}", status_code=303)


@router.post("/runs/{run_id}/invites")
def create_invite(
    run_id: str,
    session: SessionDep,
    settings: SettingsDep,
    organizer: OrganizerForm,
    uses: Annotated[str, Form()] = "",
    expires_hours: Annotated[str, Form()] = "",
    label: Annotated[str, Form()] = "",
) -> Response:
    run = find_run(session, run_id)
    try:
        body = TokenCreate(
            max_uses=int(uses) if uses.strip() else None,
            expires_in_s=float(expires_hours) * 3600 if expires_hours.strip() else None,
            label=label.strip() or None,
        )
    except ValueError:
        raise PageError(
            422, "Uses must be a whole number of at least 1 and hours a positive number."
        ) from None
    _, plaintext = token_service.create_join_token(
        session,
        run,
        body,
        settings.join_token_default_ttl_s,
        settings.join_token_default_max_uses,
    )
    session.commit()
    # The new link is shown once, on the page this redirects to; it is a secret in the URL of
    # the organizer's own browser only (the access log redacts /join/ paths, not this one).
    return RedirectResponse(
        f"/runs/{run.id}?invite={quote(plaintext)}#invite-link", status_code=303
    )


@router.post("/runs/{run_id}/invites/{token_id}/revoke")
def revoke_invite(
    run_id: str,
    token_id: str,
    session: SessionDep,
    organizer: OrganizerForm,
) -> Response:
    run = find_run(session, run_id)
    token = token_service.get_join_token(session, run, token_id[:32])
    if token is None:
        raise PageError(404, "This run has no such invite.")
    token_service.revoke(session, token)
    session.commit()
    return RedirectResponse(f"/runs/{run.id}#invites", status_code=303)


@router.post("/runs/{run_id}/volunteers/{volunteer_id}/ban")
def ban_volunteer(
    run_id: str,
    volunteer_id: int,
    session: SessionDep,
    organizer: OrganizerForm,
) -> Response:
    run = find_run(session, run_id)
    if not 1 <= volunteer_id <= dashboard_service.MAX_ID:
        raise PageError(404, "This run has no such volunteer.")
    try:
        volunteer_service.ban(session, run, volunteer_id)
    except NotFound:
        raise PageError(404, "This run has no such volunteer.") from None
    session.commit()
    # The run page then offers to revoke the invites the volunteer came through.
    return RedirectResponse(f"/runs/{run.id}?banned={volunteer_id}#ban-offer", status_code=303)


@dataclass(frozen=True)
class BanOffer:
    volunteer: Volunteer
    invites: list[Token]  # the unrevoked invites it came through


def ban_offer_for(session: SessionDep, run: Run, banned: str) -> BanOffer | None:
    """After a ban (``banned``, from the query string): the banned volunteer and the invites
    it came through that are still valid, for the run page to offer revoking."""
    if not banned.isdigit() or not 1 <= int(banned) <= dashboard_service.MAX_ID:
        return None
    try:
        volunteer = volunteer_service.get_volunteer(session, run, int(banned))
    except NotFound:
        return None
    if volunteer.banned_at is None:
        return None
    invites = [
        t for t in volunteer_service.invites_used(session, volunteer) if t.revoked_at is None
    ]
    return BanOffer(volunteer, invites)


@router.post("/runs/{run_id}/checkpoints/{epoch}/{action}")
def checkpoint_action(
    request: Request,
    run_id: str,
    epoch: int,
    action: str,
    session: SessionDep,
    organizer: OrganizerForm,
) -> Response:
    """Pin, unpin or delete one of the run's checkpoints."""
    run = find_run(session, run_id)
    try:
        if action == "pin":
            checkpoint_service.pin(session, run.id, epoch)
            session.commit()
        elif action == "unpin":
            checkpoint_service.unpin(session, run.id)
            session.commit()
        elif action == "delete":
            checkpoint_service.delete_checkpoint(
                session, request.app.state.checkpoint_store, run.id, epoch
            )
        else:
            raise PageError(404, "No such action on a checkpoint.")
    except NotFound as exc:
        raise PageError(404, str(exc)) from None
    return RedirectResponse(f"/runs/{run.id}#checkpoints", status_code=303)


@router.get("/runs/{run_id}/checkpoint.pt")
def download_checkpoint(
    request: Request, run_id: str, session: SessionDep, organizer: Organizer
) -> Response:
    require_organizer(organizer)
    run = find_run(session, run_id)
    try:
        checkpoint, path = checkpoint_service.served_file(
            session, request.app.state.checkpoint_store, run.id
        )
    except NotFound:
        raise PageError(404, "This run has no checkpoint yet.") from None
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=f"{run.name}-epoch{checkpoint.epoch}.pt",
    )
