"""Metadata filters of a search: the request schema, and its two translations.

A filter restricts a search to matching images before ranking, so a filtered search returns the top k
among the matching images, never the top k of everything with the non-matching ones dropped. FAISS
snapshots turn it into a set of ids (``FilterColumns.mask``: an exact scan of the matching vectors when
they are few, else a ``faiss.IDSelector``); Milvus into a boolean expression (``milvus_expression``).
Both read the same metadata: licence id, the captions (case-insensitive substring), the image id and
user fields (the ``fields`` of precomputed-vector metadata).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from typing import Annotated, Protocol, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

from paraseek.core.errors import UserError

FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# refused in filter texts: no caption or field value a filter means holds them, and a Milvus expression
# cannot carry them (its parser fails, which would read as the index being down)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
FILTERED_EF_MAX = 1_024  # an HNSW search's beam under a filter, at most (widened_ef)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
FieldValue = Union[StrictBool, Int64, StrictFloat, StrictStr]


class FilterError(UserError):
    """A filter that cannot be applied to this snapshot (-> 4xx naming ``field``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class IdRange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gte: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    gt: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    lte: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    lt: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)

    @model_validator(mode="after")
    def _one_bound(self) -> IdRange:
        if all(v is None for v in (self.gte, self.gt, self.lte, self.lt)):
            raise ValueError("give at least one of gte, gt, lte, lt")
        if self.gte is not None and self.gt is not None:
            raise ValueError("give gte or gt, not both")
        if self.lte is not None and self.lt is not None:
            raise ValueError("give lte or lt, not both")
        return self


class SearchFilter(BaseModel):
    """Every condition given must hold (AND)."""

    model_config = ConfigDict(extra="forbid")

    licence: list[Int64] | None = Field(None, min_length=1, max_length=100,
                                            description="licence ids (COCO's `license` ids): the image's is one of them")
    caption_contains: StrictStr | None = Field(None, min_length=1, max_length=200,
                                               description="one of the image's captions contains this text (case-insensitive)")
    id_range: IdRange | None = Field(None, description="image ids within these bounds")
    fields: dict[str, FieldValue] | None = Field(None, min_length=1, max_length=16,
                                                 description="user metadata fields equal to these values")

    @field_validator("fields")
    @classmethod
    def _names(cls, value: dict | None) -> dict | None:
        for name, item in (value or {}).items():
            if not FIELD_NAME.match(name):
                raise ValueError(f"field name {name!r} must match {FIELD_NAME.pattern}")
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"field {name!r}: {item} is not a finite number")
            if isinstance(item, str) and len(item) > 1000:
                raise ValueError(f"field {name!r}: values are at most 1000 characters")
            if isinstance(item, str) and CONTROL.search(item):
                raise ValueError(f"field {name!r}: control characters (newlines, tabs ...) are not allowed")
        return value

    @field_validator("caption_contains")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("caption_contains is blank")
        if value is not None and CONTROL.search(value):
            raise ValueError("control characters (newlines, tabs ...) are not allowed")
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> SearchFilter:
        if self.licence is None and self.caption_contains is None and self.id_range is None and self.fields is None:
            raise ValueError("an empty filter: give licence, caption_contains, id_range or fields")
        return self

    def key(self) -> str:
        """Canonical text: equal filters, equal keys (caches and merged searches use it)."""
        return json.dumps(self.model_dump(exclude_none=True), sort_keys=True)


def widened_nprobe(nprobe: int, nlist: int, share: float) -> int:
    """The IVF lists a search under a filter keeping ``share`` of the vectors probes: nprobe / share, at
    most all of them. nprobe is tuned on unfiltered searches, where every vector of a probed list is a
    candidate; under a filter only ``share`` of them is, and the lists added are mostly vectors the
    filter skips. With a filter keeping 1 %, a Milvus server's IVF_FLAT found 0.8 of the filtered top
    10 with the tuned nprobe at 100K, and all of them widened (bench_backends); FAISS' IVF-PQ at 1M,
    tuned to 0.95, found 0.962 under a 10 % filter and 0.994 widened, for 3.9 instead of 2.1 ms a
    query (bench_filters)."""
    if not 0 < share < 1:
        return nprobe
    return max(nprobe, min(nlist, math.ceil(nprobe / share)))


def widened_ef(ef: int, share: float) -> int:
    """An HNSW search's beam under a filter keeping ``share`` of the vectors: ef / share, at most
    FILTERED_EF_MAX, never narrower than ``ef``. On a Milvus 2.3.5 server at 100K, a filter keeping
    10 % took recall@10 from 0.964 (unfiltered, ef 128) to 0.888; ef 512 / 1024 brought it back to
    0.923 / 0.929, for 4.3 / 6.1 ms a query instead of 3.1."""
    if not 0 < share < 1:
        return ef
    return max(ef, min(FILTERED_EF_MAX, math.ceil(ef / share)))


def check_fields(flt: SearchFilter, user_fields: set[str] | list[str]) -> None:
    """User fields must exist in the snapshot: a misspelt name would silently match nothing."""
    known = set(user_fields)
    for name in flt.fields or {}:
        if name not in known:
            hint = f"it has {sorted(known)[:20]}" if known else "it has none"
            raise FilterError(f"filter.fields.{name}", f"the snapshot has no user field {name!r} ({hint})")


def licence_id(row: dict) -> int:
    """The licence id of a metadata row; -1 when it has none (such rows match no licence filter)."""
    lic = row.get("license")
    if isinstance(lic, dict) and isinstance(lic.get("id"), int):
        return int(lic["id"])
    if isinstance(lic, int) and not isinstance(lic, bool):
        return lic
    return -1


def caption_text(row: dict) -> str:
    """The captions as one lower-cased text that a substring filter searches (one caption a line, so a
    match never spans two captions)."""
    return "\n".join(str(c) for c in row.get("captions") or []).lower()


def user_field_names(rows) -> set[str]:
    names: set[str] = set()
    for row in rows:
        names.update((row.get("fields") or {}).keys())
    return names


class RowSource(Protocol):
    """Metadata rows by row number (the snapshot's id order): ``MetadataFile``."""

    def __len__(self) -> int: ...

    def rows(self, begin: int = 0, end: int | None = None) -> Iterator[dict]: ...

    def rows_at(self, numbers: np.ndarray) -> list[dict]: ...


class FilterColumns:
    """The columns a filter reads, one entry per indexed row (in the snapshot's id order). Kept in
    memory: ids, licences once a licence filter asks (8 bytes a row) and captions once a caption
    filter asks; user fields are read from the rows still in play, through ``rows`` (a memory-mapped
    file: rows are not held). A column is built by the first filter that needs it (every row parsed: at
    10M, ~6 s), so an id-range filter parses none. The caller serialises ``mask`` calls."""

    CHUNK = 65_536  # rows parsed at a time by a field filter

    def __init__(self, ids: np.ndarray, rows: RowSource, user_fields: Iterable[str]):
        self.ids = np.asarray(ids, np.int64)
        self._rows = rows
        self._licence: np.ndarray | None = None
        self._captions: list[str] | None = None
        self.user_fields = set(user_fields)

    @property
    def licence(self) -> np.ndarray:
        if self._licence is None:
            self._licence = np.fromiter((licence_id(r) for r in self._rows.rows()), np.int64, count=len(self._rows))
        return self._licence

    @property
    def captions(self) -> list[str]:
        if self._captions is None:  # built on the first caption filter only
            self._captions = [caption_text(r) for r in self._rows.rows()]
        return self._captions

    def mask(self, flt: SearchFilter) -> np.ndarray:
        """Which rows match (bool, one per row)."""
        check_fields(flt, self.user_fields)
        keep = np.ones(len(self.ids), bool)
        if flt.licence is not None:
            keep &= np.isin(self.licence, np.asarray(flt.licence, np.int64))
        r = flt.id_range
        if r is not None:
            if r.gte is not None:
                keep &= self.ids >= r.gte
            if r.gt is not None:
                keep &= self.ids > r.gt
            if r.lte is not None:
                keep &= self.ids <= r.lte
            if r.lt is not None:
                keep &= self.ids < r.lt
        if flt.caption_contains is not None:
            needle = flt.caption_contains.lower()
            rows = np.flatnonzero(keep)  # only rows still in play are scanned
            keep[rows] = [needle in self.captions[i] for i in rows]
        if flt.fields:
            rows = np.flatnonzero(keep)
            for begin in range(0, len(rows), self.CHUNK):
                part = rows[begin:begin + self.CHUNK]
                keep[part] = [all(_equal((row.get("fields") or {}).get(name, _MISSING), value)
                                  for name, value in flt.fields.items()) for row in self._rows.rows_at(part)]
        return keep


_MISSING = object()


def _equal(stored, wanted) -> bool:
    """Equality as Milvus' JSON comparison sees it: numbers by value (1 == 1.0), but a bool is not a number."""
    if stored is _MISSING or isinstance(stored, bool) != isinstance(wanted, bool):
        return False
    return bool(stored == wanted)


def _like_literal(text: str) -> str:
    """``text`` as the inside of a double-quoted Milvus LIKE pattern that matches it literally."""
    return text.replace("\\", "\\\\\\\\").replace("%", "\\\\%").replace("_", "\\\\_").replace('"', '\\"')


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def milvus_expression(flt: SearchFilter, user_fields: set[str] | list[str]) -> str:
    """The filter as a Milvus boolean expression over a paraseek collection's fields."""
    check_fields(flt, user_fields)
    parts = []
    if flt.licence is not None:
        parts.append(f"licence_id in [{', '.join(str(int(v)) for v in flt.licence)}]")
    if flt.caption_contains is not None:
        parts.append(f'caption_text like "%{_like_literal(flt.caption_contains.lower())}%"')
    r = flt.id_range
    if r is not None:
        for op, bound in ((">=", r.gte), (">", r.gt), ("<=", r.lte), ("<", r.lt)):
            if bound is not None:
                parts.append(f"id {op} {int(bound)}")
    for name, value in (flt.fields or {}).items():
        parts.append(f'meta["fields"]["{name}"] == {_value(value)}')
    return " and ".join(parts)
