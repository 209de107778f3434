"""Request and response bodies. Unknown fields are rejected (422 naming the field)."""

from __future__ import annotations

import unicodedata
from typing import Annotated, Callable, Iterable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictInt, ValidationInfo, field_validator, model_validator

from paraseek.index.faiss_index import IndexType
from paraseek.index.filters import SearchFilter
from paraseek.index.versions import VERSION_TEXT
from paraseek.paraphrase.expansions import EXPANSIONS, ExpansionParams, expansion_method
from paraseek.paraphrase.factory import SOURCES
from paraseek.service.job_states import JobState


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# characters that show nothing: controls (NUL included), format (zero-width, BOM), separators,
# surrogates, private use and unassigned code points
_INVISIBLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp"}


def _search_text(v: str) -> str:
    """Every text field of a search: encodable as UTF-8 and with at least one visible character."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode text (a lone surrogate at position {exc.start})") from None
    if all(unicodedata.category(ch) in _INVISIBLE for ch in v):
        raise ValueError("must contain visible text (not only whitespace, control or zero-width characters)")
    return v


def _server_path(v: str) -> str:
    if "\x00" in v:
        raise ValueError("must not contain a NUL character")
    return v


SearchText = Annotated[str, AfterValidator(_search_text)]
ServerPath = Annotated[str, AfterValidator(_server_path)]


MAX_RANK = 1000


def _enum_of(names: Callable[[], Iterable[str]]) -> Callable[[dict], None]:
    """A field's JSON-schema enum read from a registry when the schema is generated (so a method
    registered after this module was imported is listed too)."""

    def extra(schema: dict) -> None:
        schema["enum"] = list(names())

    return extra


def _expansion_method(name: str) -> str:
    if name != "none":
        expansion_method(name)  # ValueError naming the registered ones
    return name


def _paraphrase_method(name: str) -> str:
    if name not in SOURCES:
        raise ValueError(f"unknown paraphrase method {name!r} (one of {', '.join(SOURCES)})")
    return name


class Expansion(StrictModel):
    method: Annotated[str, AfterValidator(_expansion_method)] = Field(
        description="text rewrites (wordnet, ppdb, generator, llm); bank: nearest captions of the caption bank; "
        "head: the caption bank's query head (its mean shift learnt; no lookup), then `rounds` bank rounds; "
        "prf: pseudo-relevance feedback from the top images (Rocchio); none: no expansion, even when the "
        "server applies one by default", json_schema_extra=_enum_of(lambda: [*EXPANSIONS, "none"]))
    n: StrictInt = Field(3, ge=1, le=128, description="text rewrites (at most 16; from an LLM source, "
                         "at most 24 endpoint calls a request: 2 a generator rewrite, 1 an llm one, plus 2), or bank "
                         "neighbours (at most 128)")
    fusion: Literal["mean", "rrf", "weighted"] = Field(
        "mean", description="mean: mean of normalised embeddings (Cheng et al. eq. 5); rrf: reciprocal-rank fusion "
        "(text rewrites); weighted: similarity-weighted mean (bank)")
    min_cos: Annotated[float, Strict()] = Field(
        -1.0, ge=-1, le=1, description="text rewrites: drop those whose embedding has a lower cosine to the query's "
        "(the guard that keeps a wrong synonym from moving the query)")
    m: StrictInt = Field(5, ge=1, le=100, description="prf: how many top images feed back")
    alpha: Annotated[float, Strict()] = Field(1.0, ge=0, le=10, description="prf: weight of the query")
    beta: Annotated[float, Strict()] = Field(1.0, ge=0, le=10, description="prf: weight of the mean of the top images")
    rounds: StrictInt | None = Field(
        None, ge=0, le=4, description="bank: how many times the query moves to the mean of its neighbours (default 1); "
        "each round looks up the moved query's neighbours (a mean shift: rephrasings end nearer each other); head: "
        "the bank rounds after the head (default 0: no lookup)")
    blend: Annotated[float, Strict()] = Field(
        1.0, gt=0, le=1, description="head: the share of the head's move the query takes (1: all of it; less keeps "
        "more of the precise first answer and less stability)")
    keep_first: StrictInt = Field(
        0, ge=0, le=10, description="the unexpanded query's first results that stay first; the expansion orders the "
        "rest (expansion steadies the list under rephrasing and blurs the first answer: keep_first 1 keeps both)")
    keep_within: StrictInt = Field(
        0, ge=0, le=100, description="keep_first keeps only those of the query's first results that the expanded "
        "list ranks within its first keep_within (0: always)")
    keep_blend: Annotated[float, Strict()] = Field(
        0.0, ge=0, lt=1, description="keep_first keeps the first results of the query moved this share of the way to "
        "its expanded vector (0: the unexpanded query's own): a little of the move steadies the kept first answer "
        "under rephrasing before it blurs it")
    lead_margin: Annotated[float, Strict(), Field(ge=0, le=2)] | None = Field(
        None, description="the server's first-answer tower (PARASEEK_FIRST_ANSWER_BUNDLE, a plainer and more precise "
        "one) puts its first answer on top where it is sure of it: its first image's score above its second's by more "
        "than this (a rephrasing keeps such answers, so the first answer gains and the list stays steady); null: never")
    hub_weight: Annotated[float, Strict()] = Field(
        0.0, ge=0, le=2, description="the first 100 results ordered again by score less this times the image's "
        "hubness against the caption bank (how strongly its best-matching bank captions match it, whatever they "
        "say): images that score high for every query stop taking first answers; the scores shown are the corrected "
        "ones. Any method, none too (the correction alone). 0: off")

    @field_validator("n")
    @classmethod
    def _n_fits(cls, n: int, info: ValidationInfo) -> int:
        method = EXPANSIONS.get(info.data.get("method", ""))
        if method is not None and n > method.max_n:
            raise ValueError(f"at most {method.max_n} for {method.name} (text rewrites are generated one by one; "
                             "bank neighbours are a cheap lookup)")
        return n

    @model_validator(mode="after")
    def _fits_method(self):
        if self.method != "none":
            method = expansion_method(self.method)
            if self.rounds is None:  # the method's own default, stated in the request as served
                self.rounds = method.default_rounds
            method.check(self.params())
        if self.keep_blend and not self.keep_first:
            raise ValueError("keep_blend moves the query whose first results keep_first keeps: set keep_first too")
        if self.keep_blend and self.fusion == "rrf":
            raise ValueError("keep_blend moves the query toward its one expanded vector; rrf fuses lists instead "
                             "(use fusion mean)")
        return self

    def params(self) -> ExpansionParams:
        return ExpansionParams(n=self.n, fusion=self.fusion, min_cos=self.min_cos, m=self.m, alpha=self.alpha, beta=self.beta,
                               rounds=1 if self.rounds is None else self.rounds, blend=self.blend)


class Consistency(StrictModel):
    paraphrases: list[SearchText] | None = Field(None, min_length=1, max_length=16)
    auto: StrictInt | None = Field(None, ge=1, le=16, description="generate this many paraphrases")
    method: Annotated[str, AfterValidator(_paraphrase_method)] = Field(
        "wordnet", description="the paraphrase source of 'auto'", json_schema_extra=_enum_of(lambda: SOURCES))
    k: StrictInt = Field(10, ge=1, le=1000)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.paraphrases is None) == (self.auto is None):
            raise ValueError("give either 'paraphrases' or 'auto'")
        return self


class Term(StrictModel):
    text: SearchText = Field(min_length=1)
    weight: Annotated[float, Strict()] = Field(1.0, ge=-10, le=10)


class SearchRequest(BaseModel):
    # "query or terms" (or both), stated in the schema as well as checked below
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [{"required": ["query"]}, {"required": ["terms"]}]})

    query: SearchText | None = Field(None, min_length=1)
    k: StrictInt = Field(10, ge=1, le=1000)
    offset: StrictInt = Field(0, ge=0, le=999, description="skip this many results (paging); offset + k <= 1000")
    expansion: Expansion | None = None
    consistency: Consistency | None = None
    terms: list[Term] | None = Field(None, min_length=1, max_length=16)
    filter: SearchFilter | None = Field(None, description="search only images whose metadata match (the top k among "
                                        "them, not the top k filtered afterwards); consistency and expansion too")

    @model_validator(mode="after")
    def _has_text(self):
        if self.query is None and not self.terms:
            raise ValueError("give 'query' or 'terms'")
        if self.query is None and (self.expansion or self.consistency):
            raise ValueError("'expansion' and 'consistency' need 'query'")
        _check_page(self.k, self.offset)
        return self


def _check_page(k: int, offset: int) -> None:
    if k + offset > MAX_RANK:
        raise ValueError(f"offset + k must be at most {MAX_RANK} (results are ranked up to {MAX_RANK})")


class BatchSearchRequest(StrictModel):
    requests: list[SearchRequest] = Field(min_length=1)


class Licence(BaseModel):
    id: int | None = None
    name: str | None = None
    url: str | None = None


class Result(BaseModel):
    id: int
    score: float
    rank: int
    url: str | None = None
    path: str | None = Field(None, description="relative to the indexed folder; absent for precomputed vectors without one")
    captions: list[str] = []
    licence: Licence | None = None


class ParaphraseReport(BaseModel):
    text: str
    ids: list[int]
    ao: float
    js: float


class ConsistencyReport(BaseModel):
    k: int
    ids: list[int] = Field(description="the query's top-k list that each paraphrase's list is compared with")
    requested: int = Field(description="paraphrases asked for (given, or `auto`)")
    produced: int = Field(description="paraphrases compared; fewer than requested when the source ran out")
    expansion: str | None = Field(None, description="the vector expansion (bank, prf) applied to the query and every "
                                  "paraphrase alike before their lists were compared; None: plain lists")
    paraphrases: list[ParaphraseReport]
    mean_ao: float
    mean_js: float
    stable: bool
    threshold: float


class Timings(BaseModel):
    encode_ms: float
    search_ms: float
    total_ms: float


class SearchResponse(BaseModel):
    results: list[Result]
    bundle: str
    bundle_version: str
    snapshot_version: str
    timings: Timings
    cache: Literal["hit", "miss", "off"]
    truncated: bool = Field(False, description="the query was longer than the model's context")
    expansions: list[str] | None = None
    consistency: ConsistencyReport | None = None


class ImageSearchRequest(StrictModel):
    """An image query sent as JSON; the same fields also come as form fields of a multipart upload."""

    image: str = Field(min_length=1, description="the image file, base64 (a data: URL is accepted too)")
    k: StrictInt = Field(10, ge=1, le=MAX_RANK)
    offset: StrictInt = Field(0, ge=0, le=MAX_RANK - 1)
    filter: SearchFilter | None = None

    @model_validator(mode="after")
    def _page(self):
        _check_page(self.k, self.offset)
        return self


class SimilarSearchRequest(StrictModel):
    """"More like this": search with the stored vector of an indexed image."""

    id: StrictInt = Field(ge=0, le=2**63 - 1, description="an indexed image id")
    k: StrictInt = Field(10, ge=1, le=MAX_RANK)
    offset: StrictInt = Field(0, ge=0, le=MAX_RANK - 1)
    include_self: bool = Field(False, description="keep the query image itself in the results")
    filter: SearchFilter | None = None

    @model_validator(mode="after")
    def _page(self):
        _check_page(self.k, self.offset)
        return self


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request. Token arrays are not accepted: the served tokenizer is not OpenAI's."""

    model_config = ConfigDict(extra="forbid")

    input: list[SearchText] = Field(description="a text or a list of texts (a single text is read as a list of one)")
    model: str = Field(min_length=1, description="a text tower's name (GET /v1/models): the served bundle, or "
                                                 "the first-answer bundle where the server has one")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each vector, base64-encoded")
    dimensions: StrictInt | None = Field(None, ge=1, description="must equal the bundle's dimension if given")
    user: str | None = Field(None, max_length=256, description="accepted for compatibility; not stored")

    @field_validator("input", mode="before")
    @classmethod
    def _texts_only(cls, v):
        if isinstance(v, str):
            return [v]
        if isinstance(v, list):
            if not v:
                raise ValueError("give at least one text")
            if all(isinstance(x, int) for x in v) or all(isinstance(x, list) for x in v):
                raise ValueError("token arrays are not supported: send the text (this service tokenizes with its own model)")
        return v


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


class BatchSearchResponse(BaseModel):
    responses: list[SearchResponse]


class ReindexRequest(StrictModel):
    source: ServerPath = Field(min_length=1, description="image folder or COCO JSON, on the server")
    images: ServerPath | None = Field(None, description="image folder of a COCO JSON")
    bundle: ServerPath | None = Field(None, description="bundle directory (default: the serving bundle)")
    index_type: IndexType = "auto"
    index_params: dict = Field(default_factory=dict)
    reuse: bool = Field(True, description="take the serving version's vectors of files unchanged since it indexed them "
                        "(same path, size and modification time, or the same bytes elsewhere; same image tower), "
                        "and keep serving the current version when nothing changed at all (the job's report says "
                        "unchanged); false encodes every file into a new version")
    checksum: bool = Field(False, description="with reuse: compare photos by their bytes instead of size and "
                           "modification time (every photo is read and hashed first), so a file replaced by another of "
                           "the same size and time is encoded again")
    dry_run: bool = Field(False, description="only say what this reindex would do, with nothing encoded, written or "
                          "swapped: the job's report is the plan (unchanged, or how many photos it would reuse and encode)")

    @field_validator("checksum")
    @classmethod
    def _checksum_with_reuse(cls, checksum: bool, info: ValidationInfo) -> bool:
        if checksum and info.data.get("reuse") is False:
            raise ValueError("checksum compares photos for reuse: it goes with reuse true")
        return checksum


class ReloadRequest(StrictModel):
    bundle: ServerPath = Field(min_length=1)
    precision: Literal["auto", "fp32", "fp16", "int8"] = "auto"


class ActivateRequest(StrictModel):
    version: str | None = Field(None, pattern=VERSION_TEXT.pattern,
                                description="a published version to serve and make current")
    previous: bool = Field(False, description="roll back: the current version's parent, else the one published before it")

    @model_validator(mode="after")
    def _one_target(self):
        if (self.version is None) == (not self.previous):
            raise ValueError("give version or previous: true (one of the two)")
        return self


class ActivateResponse(BaseModel):
    version: str = Field(description="the version now served and current")
    was: str = Field(description="the version served before")
    count: int
    created_at: str


class PublishedVersion(BaseModel):
    """A published version of the index, as an operator picks a rollback target (no server paths)."""

    version: str
    created_at: str
    parent: str | None = Field(description="the version an update or copy started from")
    count: int = Field(description="images")
    image_space: str
    index: IndexType = Field(description="the index type")
    recall_at_10: float | None = Field(description="against exact search; null for exact indexes")
    current: bool = Field(description="the version the index names current: what replicas that poll serve")
    served: bool = Field(description="the version this server answers from")


class VersionsResponse(BaseModel):
    backend: Literal["faiss", "milvus"]
    versions: list[PublishedVersion] = Field(description="oldest first")


class JobProgress(BaseModel):
    """Where a running reindex is: "listing" the source, "hashing" its photos (checksum), "reusing" the
    vectors of unchanged photos, "encoding" the others (reused ones count as done), "indexing" (rows
    added to the index chunk by chunk, then measuring and writing the version at done = total)."""

    # records written before phases were reported counted encoded images only
    phase: Literal["listing", "hashing", "reusing", "encoding", "indexing"] = "encoding"
    done: int = 0
    total: int | None = Field(None, description="null while the source is listed")


class JobsQuery(StrictModel):
    """``GET /v1/admin/jobs``'s query: unknown parameters are refused, as unknown body fields are."""

    state: list[JobState] | None = Field(None, description="only jobs in these states (repeat it: ?state=a&state=b)")


class Job(BaseModel):
    id: str
    kind: str
    state: JobState
    created_at: str
    finished_at: str | None = None
    progress: JobProgress | None = Field(None, description="null until the job starts")
    report: dict | None = None
    error: str | None = None
    snapshot_version: str | None = None

    @field_validator("progress", mode="before")
    @classmethod
    def _no_progress_yet(cls, value):
        return value or None  # records written before progress was typed held {} until the first image


class ErrorDetail(BaseModel):
    loc: list[str | int] = Field(description="where the problem is, e.g. ['body', 'query']")
    msg: str
    type: str


class ErrorResponse(BaseModel):
    detail: list[ErrorDetail] | str


def error_responses(*statuses: int) -> dict:
    """OpenAPI ``responses`` for the error statuses a route can answer."""
    text = {
        400: "the body could not be parsed, or a paraphrase source is not configured",
        401: "missing bearer token", 403: "wrong token, or a path outside the allowed roots",
        404: "not found (an image id, a model name, or admin routes disabled)", 409: "the bundle does not fit the serving snapshot",
        413: "request body too large, or an image with more pixels than allowed",
        408: "the request body stopped arriving", 415: "unsupported content type", 422: "invalid field (``loc`` names it)",
        429: "this client's LLM endpoint calls of the minute are spent", 502: "a paraphrase source failed", 503: "not ready, or overloaded",
    }
    return {s: {"model": ErrorResponse, "description": text[s]} for s in statuses}
