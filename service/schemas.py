"""Request and response bodies. Unknown fields are rejected (422 naming the field)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _not_blank(v: str | None) -> str | None:
    if v is not None and not v.strip():
        raise ValueError("must not be empty or whitespace")
    return v


class Expansion(Strict):
    method: Literal["wordnet", "ppdb", "generator", "llm"]
    n: int = Field(3, ge=1, le=16)
    fusion: Literal["mean", "rrf"] = Field(
        "mean", description="mean: mean of normalised embeddings (Cheng et al. eq. 5); rrf: reciprocal-rank fusion"
    )


class Consistency(Strict):
    paraphrases: list[str] | None = Field(None, min_length=1, max_length=16)
    auto: int | None = Field(None, ge=1, le=16, description="generate this many paraphrases")
    method: Literal["wordnet", "ppdb", "generator", "llm"] = "wordnet"
    k: int = Field(10, ge=1, le=1000)

    @field_validator("paraphrases")
    @classmethod
    def _each_not_blank(cls, v):
        for i, p in enumerate(v or []):
            if not p.strip():
                raise ValueError(f"paraphrase {i} is empty or whitespace")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        if (self.paraphrases is None) == (self.auto is None):
            raise ValueError("give either 'paraphrases' or 'auto'")
        return self


class Term(Strict):
    text: str = Field(min_length=1)
    weight: float = Field(1.0, ge=-10, le=10)

    _check = field_validator("text")(_not_blank)


class SearchRequest(Strict):
    query: str | None = Field(None, min_length=1)
    k: int = Field(10, ge=1, le=1000)
    expansion: Expansion | None = None
    consistency: Consistency | None = None
    terms: list[Term] | None = Field(None, min_length=1, max_length=16)

    _check = field_validator("query")(_not_blank)

    @model_validator(mode="after")
    def _has_text(self):
        if self.query is None and not self.terms:
            raise ValueError("give 'query' or 'terms'")
        if self.query is None and (self.expansion or self.consistency):
            raise ValueError("'expansion' and 'consistency' need 'query'")
        return self


class BatchSearchRequest(Strict):
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
    path: str
    captions: list[str] = []
    licence: Licence | None = None


class ParaphraseReport(BaseModel):
    text: str
    ids: list[int]
    ao: float
    js: float


class ConsistencyReport(BaseModel):
    k: int
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


class BatchSearchResponse(BaseModel):
    responses: list[SearchResponse]


class ReindexRequest(Strict):
    source: str = Field(min_length=1, description="image folder or COCO JSON, on the server")
    images: str | None = Field(None, description="image folder of a COCO JSON")
    bundle: str | None = Field(None, description="bundle directory (default: the serving bundle)")
    index_type: Literal["auto", "flat", "hnsw", "ivf_flat", "ivf_pq"] = "auto"
    index_params: dict = Field(default_factory=dict)


class ReloadRequest(Strict):
    bundle: str = Field(min_length=1)
    precision: Literal["fp32", "int8"] = "fp32"


class Job(BaseModel):
    id: str
    kind: str
    state: Literal["queued", "running", "succeeded", "failed"]
    created_at: str
    finished_at: str | None = None
    progress: dict = {}
    report: dict | None = None
    error: str | None = None
    snapshot_version: str | None = None
