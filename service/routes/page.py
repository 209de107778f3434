"""The search page: one HTML file and its script and style, all served from the package (no CDN, no
build step)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# the page runs its own script and style only; images come from the service or an indexed http(s) url
# (data: for the empty favicon, blob: for the preview of a photo being uploaded)
PAGE_POLICY = ("default-src 'self'; img-src 'self' http: https: data: blob:; object-src 'none'; base-uri 'none'; "
               "form-action 'self'; frame-ancestors 'none'")

router = APIRouter(include_in_schema=False)


@router.get("/")
async def page() -> FileResponse:
    # no-cache: a redeployed service serves its own page, never a stale one kept by the browser
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache", "Content-Security-Policy": PAGE_POLICY})
