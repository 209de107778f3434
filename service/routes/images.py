from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response

from paraseek.core.images import image_media_type
from paraseek.service.deps import get_engine
from paraseek.service.engine import SearchEngine
from paraseek.service.schemas import error_responses

router = APIRouter(prefix="/v1", tags=["images"])


# ids are plain decimal digits: int() alone would also take "+377575" or "3_7_7_5_7_5"
ImageId = Annotated[str, PathParam(pattern=r"^[0-9]{1,19}$", description="image id (decimal digits)")]


@router.get("/images/{image_id}", response_class=FileResponse,
            responses={200: {"content": {"image/*": {}}, "description": "the image file"}, **error_responses(404, 422, 503)})
async def get_image(image_id: ImageId, engine: SearchEngine = Depends(get_engine)):
    """The image file of an indexed id."""
    snap = engine.require_active().snapshot
    # a Milvus snapshot looks the row up in the database: off the event loop
    path, member = await run_in_threadpool(lambda: (snap.image_path(int(image_id)), snap.image_member(int(image_id))))
    if path is None:  # no path, or one outside the snapshot's image roots: the same answer for both
        raise HTTPException(404, f"no image with id {image_id} in snapshot {snap.version}")
    if not path.is_file():
        raise HTTPException(404, f"image {image_id} is indexed but its file is gone")
    if member is not None:  # an image inside a webdataset tar shard: its bytes only, never the shard
        _, offset, size = member
        data = await run_in_threadpool(_read_range, path, offset, size)
        if len(data) != size:
            raise HTTPException(404, f"image {image_id} is indexed but its tar shard is truncated")
        media_type = await run_in_threadpool(image_media_type, data)
        if media_type is None:
            raise HTTPException(404, f"image {image_id} is indexed but its bytes are not an image")
        return Response(data, media_type=media_type)
    # only what decodes as an image is served, typed by its content rather than its name
    media_type = await run_in_threadpool(image_media_type, path)
    if media_type is None:
        raise HTTPException(404, f"image {image_id} is indexed but its file is not an image")
    return FileResponse(path, media_type=media_type)


def _read_range(path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)
