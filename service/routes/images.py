from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import FileResponse

from service.deps import get_engine
from service.engine import SearchEngine

router = APIRouter(prefix="/v1", tags=["images"])


@router.get("/images/{image_id}", response_class=FileResponse)
async def get_image(image_id: int, engine: SearchEngine = Depends(get_engine)):
    """The image file of an indexed id."""
    snap = engine.require_active().snapshot
    path = snap.image_path(image_id)
    if path is None:
        raise HTTPException(404, f"no image with id {image_id} in snapshot {snap.version}")
    if not path.is_file():
        raise HTTPException(404, f"image {image_id} is indexed but its file is gone")
    return FileResponse(path)
