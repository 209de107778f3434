"""The pure part of a search, request in, numbers out, no I/O: which texts a request embeds, the vectors
it searches (terms, fusion of expansions), the result list (reciprocal-rank fusion, paging) and the
consistency report. ``SearchEngine`` runs these between its encoder and index stages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paraseek.core.encoder import l2_normalize
from paraseek.core.query_vectors import close_to_query, mean_fusion
from paraseek.core.rank_metrics import average_overlap, jaccard_at_k
from paraseek.index.metadata_fields import servable_fields
from paraseek.paraphrase.expansions import EXPANSIONS, ConfidentLead, HubCorrection, KeepFirst, RewriteExpansion, VectorExpansion
from paraseek.service.errors import RequestError
from paraseek.service.schemas import ConsistencyReport, ParaphraseReport, SearchRequest

RRF_K = 60  # the usual reciprocal-rank-fusion constant


@dataclass
class QueryTexts:
    """Every text of one request, in the order they are embedded together."""

    query: str | None
    expansions: list[str]
    paraphrases: list[str]
    terms: list[str]

    def all(self) -> list[str]:
        return ([self.query] if self.query is not None else []) + self.expansions + self.paraphrases + self.terms


@dataclass
class QueryVectors:
    query: np.ndarray | None
    expansions: np.ndarray
    paraphrases: np.ndarray
    terms: np.ndarray
    # the paraphrases before a vector expansion moved them (set where one did: ``keep_first`` needs them)
    plain_paraphrases: np.ndarray | None = None
    # ``lead_margin``: the first-answer tower's vectors of the query and of the paraphrases
    lead_query: np.ndarray | None = None
    lead_paraphrases: np.ndarray | None = None

    @classmethod
    def split(cls, texts: QueryTexts, vectors: np.ndarray) -> QueryVectors:
        q = 1 if texts.query is not None else 0
        e, p = q + len(texts.expansions), q + len(texts.expansions) + len(texts.paraphrases)
        return cls(vectors[0] if q else None, vectors[q:e], vectors[e:p], vectors[p:])


@dataclass
class QueryRows:
    """The vectors searched in one index call and where each part of the request sits among them."""

    matrix: np.ndarray
    fused: int  # rows [0, fused) are fused into the result list (1 unless rrf)
    plain_query: int  # the plain query's row (consistency compares it with the paraphrases)
    first_paraphrase: int  # the first paraphrase's row
    keep: KeepFirst = KeepFirst()  # ``keep_first``: the plain query's first results lead the list
    first_plain_paraphrase: int | None = None  # keep with expanded paraphrases: where their kept rows start
    keep_query: int = 0  # the row whose first results keep_first keeps (the plain query's, or keep_blend's own)
    lead: ConfidentLead = ConfidentLead()  # ``lead_margin``: the first-answer tower's sure answer on top
    lead_query: int | None = None  # its row of the query
    first_lead_paraphrase: int | None = None  # and where its rows of the (expanded, so served) paraphrases start

    def lead_rows(self) -> list[int]:
        """The rows of the first-answer tower (the others are the served tower's): ``plan_rows`` puts them last."""
        return list(range(self.lead_query, len(self.matrix))) if self.lead_query is not None else []

    def served(self, ids: np.ndarray, scores: np.ndarray, row: int, plain_row: int, lead_row: int | None = None) -> list[int]:
        """The list served for ``row`` (searched as expanded; ``plain_row`` the row whose first results it keeps,
        its unexpanded twin or that moved ``keep_blend`` of the way; ``lead_row`` the first-answer tower's)."""
        if self.keep and plain_row != row:
            listed = self.keep.serve(ids[plain_row], ids[row])
        else:
            listed = [int(i) for i in ids[row] if i >= 0]
        if self.lead and lead_row is not None:
            listed = self.lead.serve(listed, ids[lead_row], scores[lead_row])
        return listed


def vector_expansion(req: SearchRequest) -> VectorExpansion | None:
    """The request's vector expansion (bank, prf, ...), if it asks for one."""
    method = EXPANSIONS.get(req.expansion.method) if req.expansion is not None else None
    return method if isinstance(method, VectorExpansion) else None


def rewrite_expansion(req: SearchRequest) -> RewriteExpansion | None:
    """The request's text-rewrite expansion (wordnet, ppdb, llm, ...), if it asks for one."""
    method = EXPANSIONS.get(req.expansion.method) if req.expansion is not None else None
    return method if isinstance(method, RewriteExpansion) else None


def query_vectors(req: SearchRequest, texts: QueryTexts, embedded: np.ndarray) -> QueryVectors:
    """The request's vectors by role; expansions too far from the query (``min_cos``) are dropped,
    from ``texts`` as well."""
    vectors = QueryVectors.split(texts, embedded)
    if req.expansion is not None and req.expansion.min_cos > -1 and len(vectors.expansions):
        assert vectors.query is not None
        keep = close_to_query(vectors.query, vectors.expansions, req.expansion.min_cos)
        vectors.expansions = vectors.expansions[keep]
        texts.expansions = [t for t, k in zip(texts.expansions, keep) if k]
    return vectors


def keep_of(req: SearchRequest) -> KeepFirst:
    """The request's ``keep_first`` (none without an expansion)."""
    e = req.expansion
    return KeepFirst(e.keep_first, e.keep_within, e.keep_blend) if e is not None and e.method != "none" else KeepFirst()


def lead_of(req: SearchRequest) -> ConfidentLead:
    """The request's ``lead_margin`` (none without an expansion, or for weighted terms: lists of no one query)."""
    e = req.expansion
    if e is None or e.method == "none" or req.query is None or req.terms:
        return ConfidentLead()
    return ConfidentLead(e.lead_margin)


def hub_of(req: SearchRequest) -> HubCorrection:
    """The request's ``hub_weight`` (with any method, ``none`` too: the correction without an expansion)."""
    e = req.expansion
    return HubCorrection(e.hub_weight) if e is not None else HubCorrection()


def plan_rows(req: SearchRequest, v: QueryVectors, expanded: np.ndarray | None = None,
          compare_expanded: bool = False) -> QueryRows:
    """Stage 2: the vectors to search. Terms: their weighted sum (+ the query); a vector expansion
    (bank, prf) as computed; text expansion with mean fusion: Cheng et al. eq. 5; rrf: the query
    and each expansion searched separately."""
    if req.terms:
        combined = sum((t.weight * vec for t, vec in zip(req.terms, v.terms)), np.zeros_like(v.terms[0]))
        if v.query is not None:
            combined = combined + v.query
        if np.linalg.norm(combined) < 1e-6:
            raise RequestError("terms", "the weighted terms cancel out (zero vector)")
        main = l2_normalize(combined)
    elif expanded is not None:
        main = expanded
    elif len(v.expansions) and req.expansion is not None and req.expansion.fusion == "mean":
        assert v.query is not None
        main = mean_fusion(v.query, v.expansions)
    else:
        assert v.query is not None
        main = v.query
    rows = [main]
    rrf = len(v.expansions) > 0 and req.expansion is not None and req.expansion.fusion == "rrf" and not req.terms
    if rrf:
        rows.extend(v.expansions)
    fused = len(rows)
    # keep_first applies where an expansion moved the list (rrf: row 0, the plain query, leads)
    moved = (main is not v.query or rrf) and not req.terms
    keep = keep_of(req) if moved else KeepFirst()
    plain_query = 0
    reports_plain = len(v.paraphrases) > 0 and not compare_expanded  # the report reads the plain query's own list
    if main is not v.query and ((keep and not keep.blend) or reports_plain):
        assert v.query is not None
        plain_query = len(rows)
        rows.append(v.query)  # consistency compares the plain query with its paraphrases; keep_first leads with it
    keep_query = plain_query
    if keep.blend and main is not v.query:  # keep_blend: the kept first results are the moved query's
        assert v.query is not None
        keep_query = len(rows)
        rows.append(keep.query(v.query, main))
    first_paraphrase = len(rows)
    rows.extend(v.paraphrases)
    first_plain_paraphrase = None
    if keep and compare_expanded and len(v.paraphrases) and v.plain_paraphrases is not None:
        first_plain_paraphrase = len(rows)  # only keep reads these: with keep_blend, moved as the query's is
        rows.extend(keep.query(v.plain_paraphrases, v.paraphrases))
    lead = lead_of(req) if v.lead_query is not None else ConfidentLead()
    lead_query = first_lead_paraphrase = None
    if lead:
        assert v.lead_query is not None
        lead_query = len(rows)
        rows.append(v.lead_query)
        # the report compares served lists only where the expansion moved the paraphrases too
        if compare_expanded and len(v.paraphrases) and v.lead_paraphrases is not None:
            first_lead_paraphrase = len(rows)
            rows.extend(v.lead_paraphrases)
    return QueryRows(np.vstack(rows), fused, plain_query, first_paraphrase, keep, first_plain_paraphrase, keep_query,
                     lead, lead_query, first_lead_paraphrase)


def ranked_page(k: int, offset: int, scores: np.ndarray, ids: np.ndarray, rows: QueryRows) -> list[tuple[int, float, int]]:
    """The result list, ranks offset+1 .. offset+k; several fused rows are combined by reciprocal rank,
    ``keep_first`` puts the plain query's first results ahead of them and ``lead_margin`` the first-answer
    tower's sure answer ahead of all (each shown with the score of the row that placed it)."""
    if rows.fused > 1:
        ranks: dict[int, float] = {}
        for row in ids[: rows.fused]:
            for rank, i in enumerate(row[row >= 0]):
                ranks[int(i)] = ranks.get(int(i), 0.0) + 1.0 / (RRF_K + rank + 1)
        ranked = sorted(ranks.items(), key=lambda kv: -kv[1])
        listed, listed_scores = [i for i, _ in ranked], [s for _, s in ranked]
    else:
        listed, listed_scores = ids[0], scores[0]
    led = rows.lead and rows.lead_query is not None
    if not rows.keep and not led:
        return page(listed, listed_scores, k, offset)
    score_of = {int(i): float(s) for i, s in zip(listed, listed_scores)}
    served = [int(i) for i in listed if i >= 0]
    if rows.keep:
        plain = rows.keep_query
        score_of.update({int(i): float(s) for i, s in zip(ids[plain][: rows.keep.n], scores[plain][: rows.keep.n])})
        served = rows.keep.serve(ids[plain], listed)
    if led:
        lead_ids, lead_scores = ids[rows.lead_query], scores[rows.lead_query]
        if rows.lead.leads(lead_ids, lead_scores):
            score_of[int(lead_ids[0])] = float(lead_scores[0])
        served = rows.lead.serve(served, lead_ids, lead_scores)
    return page(served, [score_of[i] for i in served], k, offset)


def page(ids, scores, k: int, offset: int, exclude: int | None = None) -> list[tuple[int, float, int]]:
    """(id, score, rank) of ranks offset+1 .. offset+k."""
    kept = [(int(i), float(s)) for i, s in zip(ids, scores) if i >= 0 and i != exclude]
    return [(i, s, offset + r + 1) for r, (i, s) in enumerate(kept[offset : offset + k])]


def result_of(rows: dict[int, dict], image_id: int, score: float, rank: int) -> dict:
    """A ``Result``'s fields from the image's metadata row, for the response to validate together."""
    row = servable_fields(rows.get(int(image_id), {}))
    return {"id": int(image_id), "score": float(score), "rank": rank, "path": row.get("path"),
            "url": row.get("url") or row.get("coco_url") or row.get("flickr_url"), "captions": row.get("captions", []),
            "licence": row.get("license")}


def consistency_report(req: SearchRequest, paraphrases: list[str], scores: np.ndarray, ids: np.ndarray, rows: QueryRows,
                       threshold: float) -> ConsistencyReport:
    """AO@k and JS@k of each paraphrase's list against the plain query's."""
    assert req.consistency is not None
    kc = req.consistency.k
    led = rows.first_lead_paraphrase is not None  # the lists compared are the served ones, lead included
    # the served list where the paraphrases' are compared as served (kept rows of their own), else the plain query's
    served_lists = rows.first_plain_paraphrase is not None
    query_row = 0 if served_lists else rows.plain_query
    qlist = rows.served(ids, scores, query_row, rows.keep_query if served_lists else query_row,
                        rows.lead_query if led else None)[:kc]
    reports = []
    for j, text in enumerate(paraphrases):
        row = rows.first_paraphrase + j
        plain_row = row if rows.first_plain_paraphrase is None else rows.first_plain_paraphrase + j
        lead_row = rows.first_lead_paraphrase + j if rows.first_lead_paraphrase is not None else None
        plist = rows.served(ids, scores, row, plain_row, lead_row)[:kc]
        reports.append(ParaphraseReport(text=text, ids=plist, ao=average_overlap(qlist, plist, kc),
                                        js=jaccard_at_k(qlist, plist, kc)))
    mean_ao = float(np.mean([r.ao for r in reports]))
    c = req.consistency
    requested = len(c.paraphrases) if c.paraphrases else (c.auto or 0)
    compared_under = req.expansion.method if vector_expansion(req) is not None and req.expansion else None
    return ConsistencyReport(k=kc, ids=qlist, requested=requested, produced=len(reports), expansion=compared_under,
                             paraphrases=reports, mean_ao=mean_ao, mean_js=float(np.mean([r.js for r in reports])),
                             stable=mean_ao >= threshold, threshold=threshold)
