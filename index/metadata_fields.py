"""The fields of an image's metadata that the API types: ``url``, ``captions`` and ``license``
({id, name, url}), plus ``path``.

Shards, vector metadata and COCO files hand them over untyped (a parquet column of numbers, a
webdataset JSON with a nested licence). A build checks them here, coercing what has one plain reading
(a number where text is expected, digits where an id is) and refusing the rest with the row named, so
a snapshot never holds a row its search responses cannot carry. Rows of snapshots built before these
checks are read through ``servable_fields``, which drops what does not fit instead of failing a search.
"""

from __future__ import annotations

from paraseek.core.errors import UserError


class MetadataFieldError(UserError):
    """A metadata value of a type the snapshot cannot serve; the message names the row and the field."""


class _Unfit(Exception):
    pass


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # a column a reader typed as numbers (a licence named "5")
    raise _Unfit(f"text expected, got {type(value).__name__} {_shown(value)}")


def _id(value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    raise _Unfit(f"an integer id expected, got {type(value).__name__} {_shown(value)}")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _licence(value, strict: bool, where: str) -> dict | None:
    if not isinstance(value, dict):
        return {"name": _text(value)}  # a bare licence name (webdataset's "LICENSE": "CC BY 2.0")
    out = dict(value)
    for key, convert in (("id", _id), ("name", _text), ("url", _text)):
        if out.get(key) is None:
            out.pop(key, None)
            continue
        try:
            out[key] = convert(out[key])
        except _Unfit as exc:
            if strict:
                raise MetadataFieldError(f"{where}: license.{key}: {exc}") from None
            out.pop(key)
    return out or None


def typed_fields(row: dict, where: str, strict: bool = True) -> dict:
    """``row`` with its typed fields of the types the API promises. ``strict``: an unfit value raises
    ``MetadataFieldError`` naming ``where`` and the field; otherwise it is left out of the copy."""
    out = dict(row)

    def unfit(field: str, exc: _Unfit) -> None:
        if strict:
            raise MetadataFieldError(f"{where}: {field}: {exc}") from None
        out.pop(field, None)

    for field in ("url", "path", "coco_url", "flickr_url"):
        if out.get(field) is not None:
            try:
                out[field] = _text(out[field])
            except _Unfit as exc:
                unfit(field, exc)
    if out.get("captions") is not None:
        captions = out["captions"] if isinstance(out["captions"], list) else [out["captions"]]
        try:
            out["captions"] = [_text(c) for c in captions if c is not None]
        except _Unfit as exc:
            unfit("captions", exc)
    if out.get("license") is not None:
        try:
            licence = _licence(out["license"], strict, where)
        except _Unfit as exc:
            unfit("license", exc)
        else:
            if licence is None:
                out.pop("license")
            else:
                out["license"] = licence
    return out


def servable_fields(row: dict) -> dict:
    """What a search response may carry of ``row``: unfit values left out (snapshots built before
    builds checked their metadata)."""
    return typed_fields(row, "", strict=False)

