"""Decoding untrusted image bytes or files with a pixel cap, shared by the index builder and the
service's image queries."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import BinaryIO


class ImageDecodeError(ValueError):
    """The bytes are not an image Pillow can decode, or it has more pixels than allowed."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


def decode_image(source: bytes | str | os.PathLike | BinaryIO, max_pixels: int | None = None):
    """A fully decoded PIL image. The header's size is checked against ``max_pixels`` before any pixel
    is decoded, so a small file that declares a huge canvas (a decompression bomb) costs nothing."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, bytes):
        if not source:
            raise ImageDecodeError("is empty")
        source = io.BytesIO(source)
    elif isinstance(source, (str, os.PathLike)):
        source = Path(source)
    try:
        with warnings.catch_warnings():
            # Pillow warns past its own limit and raises past twice that; the explicit cap decides here
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(source)
            width, height = im.size
            if max_pixels is not None and width * height > max_pixels:
                im.close()
                raise ImageDecodeError(f"has {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}",
                                       too_large=True)
            im.load()  # a full decode: truncated files fail here, not later
            return im
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageDecodeError(f"is too large to decode safely: {exc}", too_large=True) from exc
    except UnidentifiedImageError as exc:
        raise ImageDecodeError("is not an image Pillow can read (JPEG, PNG, WebP, GIF, BMP, TIFF ...)") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(f"could not be decoded: {type(exc).__name__}: {exc}") from exc


def image_media_type(source: bytes | str | os.PathLike | BinaryIO) -> str | None:
    """The media type of the image format Pillow identifies from the header (``image/jpeg``), or None
    when the bytes or file are no image it reads. Only the header is read: cheap enough per request."""
    from PIL import Image, UnidentifiedImageError

    stream: BinaryIO | Path = io.BytesIO(source) if isinstance(source, bytes) else \
        Path(source) if isinstance(source, (str, os.PathLike)) else source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # nothing is decoded here
            with Image.open(stream) as im:
                return Image.MIME.get(im.format or "") or None
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError):
        return None


class FileRange(io.RawIOBase):
    """``size`` bytes of an open descriptor from ``offset`` (an image inside a tar shard, or a whole file)
    as a seekable file of its own, read with ``pread``: Pillow sniffs it and a response streams it
    without reading the range whole. ``closefd``: closing it closes the descriptor."""

    def __init__(self, fd: int, offset: int, size: int, closefd: bool = False):
        super().__init__()
        self.fd, self.offset, self.size, self.position, self.closefd = fd, offset, size, 0, closefd

    def close(self) -> None:
        if self.closefd and not self.closed:
            os.close(self.fd)
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + position)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        wanted = min(len(buffer), max(0, self.size - self.position))
        data = os.pread(self.fd, wanted, self.offset + self.position) if wanted else b""
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)
