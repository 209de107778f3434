from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, StreamingResponse

from paraseek.core.images import FileRange, image_media_type
from paraseek.index.image_sources import open_within
from paraseek.index.store import SearchableSnapshot
from paraseek.service.deps import get_engine
from paraseek.service.engine import SearchEngine
from paraseek.service.schemas import error_responses

router = APIRouter(prefix="/v1", tags=["images"])

INT64_MAX = 2**63 - 1
CHUNK_BYTES = 256 << 10  # what one image response holds in memory at a time
# an image is shown, never run: no scripts, no sub-resources, even if a browser were to sniff it as a page
IMAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; sandbox"}

# ids are plain decimal digits: int() alone would also take "+377575" or "3_7_7_5_7_5"
ImageId = Annotated[str, PathParam(pattern=r"^[0-9]{1,19}$", description="image id (decimal digits)")]


@router.get("/images/{image_id}", response_class=FileResponse,
            responses={200: {"content": {"image/*": {}}, "description": "the image file"}, **error_responses(404, 422, 503)})
async def get_image(image_id: ImageId, engine: SearchEngine = Depends(get_engine)):
    """The image file of an indexed id."""
    snap = engine.require_active().snapshot
    number = int(image_id)
    if number > INT64_MAX:  # 19 digits can exceed the int64 ids are stored as: no image has it
        raise HTTPException(404, f"no image with id {image_id} in snapshot {snap.version}")
    # a Milvus snapshot looks the row up in the database, and the file is opened and sniffed: off the event loop
    file, offset, size, media_type = await run_in_threadpool(_open_image, snap, number)
    return StreamingResponse(_chunks(file, offset, size), media_type=media_type,
                             headers={"Content-Length": str(size), **IMAGE_HEADERS})


def _open_image(snap: SearchableSnapshot, image_id: int) -> tuple[io.FileIO, int, int, str]:
    """The image's file opened once (see ``open_within``), with the byte range and media type to serve
    from that same descriptor: a file swapped after the checks is never the one served."""
    path = snap.image_path(image_id)
    if path is None:  # no path, or one outside the snapshot's image roots: the same answer for both
        raise HTTPException(404, f"no image with id {image_id} in snapshot {snap.version}")
    fd = open_within(path, snap.image_roots)
    if fd is None:
        raise HTTPException(404, f"image {image_id} is indexed but its file is gone")
    file = io.FileIO(fd, "rb")  # closes the descriptor when dropped, whatever happens to the response
    offset, size = 0, os.fstat(fd).st_size
    member = snap.image_member(image_id)
    if member is not None:  # an image inside a webdataset tar shard: its bytes only, never the shard
        _, offset, length = member
        if offset + length > size:
            file.close()
            raise HTTPException(404, f"image {image_id} is indexed but its tar shard is truncated")
        size = length
    # only what decodes as an image is served, typed by its content rather than its name
    media_type = image_media_type(io.BufferedReader(FileRange(fd, offset, size)))
    if media_type is None:
        file.close()
        raise HTTPException(404, f"image {image_id} is indexed but its {'bytes are' if member else 'file is'} not an image")
    return file, offset, size, media_type


def _chunks(file: io.FileIO, offset: int, size: int) -> Iterator[bytes]:
    with file:
        end = offset + size
        while offset < end:
            data = os.pread(file.fileno(), min(CHUNK_BYTES, end - offset), offset)
            if not data:  # truncated while being served: the response ends short, the client sees it
                return
            offset += len(data)
            yield data
