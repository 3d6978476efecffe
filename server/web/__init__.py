"""The coordinator's web pages (templates and static files live in the repository's ``web/``).

:func:`install` adds them to an app: the page routes, ``/static``, the security headers of
every page and the access-log filter that keeps invite tokens out of logs."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.web import organizer, pages
from server.web.rendering import WEB_DIR, PageError, not_found_handler, page_error_handler
from server.web.security import PageHeaders, install_log_redaction


def install(app: FastAPI) -> None:
    app.include_router(pages.router)
    app.include_router(organizer.router)
    app.mount("/static", StaticFiles(directory=WEB_DIR / "static"), name="static")
    app.add_exception_handler(PageError, page_error_handler)
    app.add_exception_handler(StarletteHTTPException, not_found_handler)
    app.add_middleware(PageHeaders)
    install_log_redaction()
