"""FastAPI dependencies: the engine, the job manager, and the admin guard."""

from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from paraseek.core.settings import Settings
from paraseek.service.engine import SearchEngine
from paraseek.service.jobs import JobManager

_bearer = HTTPBearer(auto_error=False)


# async on purpose: FastAPI runs a plain ``def`` dependency on its thread pool, a thread hop per
# request for a one-line lookup
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def engine_of(app) -> SearchEngine:
    return app.state.engine


async def get_engine(request: Request) -> SearchEngine:
    return engine_of(request.app)


async def get_jobs(request: Request) -> JobManager:
    return request.app.state.jobs


async def require_admin(
    settings: Settings = Depends(get_settings),
    credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),
) -> None:
    """Admin routes need the configured bearer token. With no token configured they are disabled
    (404), never open. The comparison takes the same time whatever the mismatch."""
    if settings.admin_token is None or not settings.admin_token.get_secret_value():
        raise HTTPException(status.HTTP_404_NOT_FOUND, "admin routes are disabled (no PARASEEK_ADMIN_TOKEN)")
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
    expected = settings.admin_token.get_secret_value().encode()
    if not hmac.compare_digest(credentials.credentials.encode(), expected):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "wrong admin token")
