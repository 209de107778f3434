"""Paraphrased retrieval: AO@k and JS@k between the top-k image lists of a query and its paraphrase."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.core.rank_metrics import average_overlap, jaccard_at_k
from paraseek.paraphrase.expansions import ConfidentLead, HubCorrection, KeepFirst


@dataclass
class ParaphraseResult:
    k: int
    ao: np.ndarray  # per pair
    js: np.ndarray
    label: str = "plain"
    lists: list[tuple[list[int], list[int]]] = field(default_factory=list)

    def summary(self) -> dict:
        q = lambda x, p: float(np.percentile(x, p))  # noqa: E731
        return {
            "pairs": int(len(self.ao)), "k": self.k,
            f"ao@{self.k}": float(self.ao.mean()), f"js@{self.k}": float(self.js.mean()),
            f"ao@{self.k}_p10": q(self.ao, 10), f"ao@{self.k}_median": q(self.ao, 50), f"ao@{self.k}_p90": q(self.ao, 90),
            f"js@{self.k}_median": q(self.js, 50),
            "identical_top1": float(np.mean([a[:1] == b[:1] for a, b in self.lists])) if self.lists else None,
            "distinct_images": distinct_images(self.lists),
        }


def distinct_images(lists: Sequence[tuple[list[int], list[int]]]) -> int:
    """The collapse guard: how many different images appear in all the top-k lists together
    (stability bought by returning the same few images for every query is not robustness)."""
    return len({i for a, b in lists for i in (*a, *b)})


def hub_search(snapshot, hub: HubCorrection, image_bias: np.ndarray | None) -> Callable:
    """``snapshot.search_ids``, its lists reordered as a request's ``hub_weight`` serves them where ``hub`` is
    set (``image_bias``: each snapshot row's hubness)."""
    if not hub or image_bias is None:
        return snapshot.search_ids

    def search(vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, ids = snapshot.search_ids(vectors, hub.depth(k))
        rows, found = snapshot.metadata.id_rows.lookup(ids)  # padding (-1) is not found
        scores, ids = hub.rerank(scores, ids, np.where(found, image_bias[rows], 0.0))
        return scores[:, :k], ids[:, :k]

    return search


def evaluate_pairs(encoder: Encoder, snapshot, pairs: Sequence[tuple[str, str]], k: int = 10,
                   expand: Callable[[list[str], np.ndarray], np.ndarray] | None = None, label: str = "plain",
                   progress: bool = True, keep: KeepFirst = KeepFirst(), lead: ConfidentLead = ConfidentLead(),
                   lead_encoder: Encoder | None = None, hub: HubCorrection = HubCorrection(),
                   image_bias: np.ndarray | None = None) -> ParaphraseResult:
    """``expand`` maps (texts, their embeddings) to expanded query vectors (``paraseek.evaluation.expansion``);
    ``keep``: each list leads with the unexpanded query's first results, as the service serves it; ``lead``:
    then ``lead_encoder``'s first answer goes on top where that tower is sure of it; ``hub`` (with each snapshot
    row's ``image_bias``): the served tower's lists ordered by hub-corrected scores first."""
    a_texts, b_texts = [a for a, _ in pairs], [b for _, b in pairs]
    qa, qb = encoder.encode_text(a_texts), encoder.encode_text(b_texts)
    search = hub_search(snapshot, hub, image_bias)

    def served(texts: list[str], plain: np.ndarray) -> list[list[int]]:
        if expand is None:
            lists = [[int(x) for x in row if x >= 0] for row in search(plain, k)[1]]
        else:
            moved = expand(texts, plain)
            _, expanded = search(moved, k + keep.depth)
            if keep:
                _, first = search(keep.query(plain, moved), keep.n)
                lists = [keep.serve(f, e) for f, e in zip(first, expanded)]
            else:
                lists = [[int(x) for x in row if x >= 0] for row in expanded]
        if lead and lead_encoder is not None:
            lead_scores, lead_ids = snapshot.search_ids(lead_encoder.encode_text(texts), 2)
            lists = [lead.serve(listed, i, s) for listed, i, s in zip(lists, lead_ids, lead_scores)]
        return [listed[:k] for listed in lists]

    lists = list(zip(served(a_texts, qa), served(b_texts, qb)))
    ao = np.array([average_overlap(a, b, k) for a, b in lists])
    js = np.array([jaccard_at_k(a, b, k) for a, b in lists])
    return ParaphraseResult(k=k, ao=ao, js=js, label=label, lists=lists)


def write_pairs_csv(path: Path, pairs, results: Sequence[ParaphraseResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        header = ["text1", "text2"]
        for r in results:
            header += [f"{r.label}_ao@{r.k}", f"{r.label}_js@{r.k}", f"{r.label}_top{r.k}_1", f"{r.label}_top{r.k}_2"]
        w.writerow(header)
        for i, (a, b) in enumerate(pairs):
            row = [a, b]
            for r in results:
                la, lb = r.lists[i]
                row += [f"{r.ao[i]:.4f}", f"{r.js[i]:.4f}", " ".join(map(str, la)), " ".join(map(str, lb))]
            w.writerow(row)
