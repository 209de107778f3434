"""Training a caption bank's query head (``paraseek.paraphrase.query_head``): the bank's mean shift of a
query (``rounds`` moves to the mean of its ``neighbours`` nearest bank captions), learnt as a function of
the query so that serving needs no lookup.

The training inputs are the bank's own vectors (captions are what queries look like), each one's target
its mean shift through the bank with itself left out of its neighbours at every round: a query is never
in the bank, and a caption that finds itself first would teach the head to stay put. The head is
residual, ``normalise(q + MLP(q))``, its last layer starting at zero (the head starts as the identity),
and the loss is the mean cosine distance to the targets. 2 % of the rows are held out to report the
fit on captions the head never saw.

A head may instead learn a *teacher's* retrieval vector (``teacher_targets``): a bundle of the same image
space embeds the bank's captions and its own bank's head moves them. Such a head depends on the two
towers only, not on the bank, so a tower left as it was for sentence similarity (the plain starter's
STS) ranks like the robust one through its head.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Callable

import numpy as np

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import torch

from paraseek.core.encoder import Encoder, l2_normalize
from paraseek.core.query_vectors import mean_fusion
from paraseek.paraphrase.query_head import HeadTraining, QueryHead

log = logging.getLogger(__name__)


def mean_shift_targets(vectors: np.ndarray, neighbours: int, rounds: int, rows: np.ndarray | None = None,
                       block: int = 2048) -> np.ndarray:
    """Each row of ``vectors`` (normalised; or only ``rows`` of them) moved ``rounds`` times to the mean of
    itself and its ``neighbours`` nearest other rows; the row itself never counts as its own neighbour."""
    vectors = np.asarray(vectors, np.float32)
    n = min(neighbours, len(vectors) - 1)
    if n < 1:
        raise ValueError("a mean shift through the bank needs at least two captions")
    which = np.arange(len(vectors)) if rows is None else np.asarray(rows)
    out = np.empty((len(which), vectors.shape[1]), np.float32)
    for start in range(0, len(which), block):
        own = which[start:start + block]
        moved = vectors[own]
        for _ in range(rounds):
            sims = moved @ vectors.T
            sims[np.arange(len(moved)), own] = -np.inf
            nearest = np.argpartition(-sims, n - 1, axis=1)[:, :n]
            moved = mean_fusion(moved, vectors[nearest])
        out[start:start + len(moved)] = moved
    return l2_normalize(out)


def teacher_targets(texts: list[str], teacher: Encoder, head: QueryHead | None = None, blend: float = 1.0) -> np.ndarray:
    """What ``teacher`` ranks ``texts`` with: its vectors, moved ``blend`` of the way by its bank's ``head``
    where one is given."""
    vectors = l2_normalize(teacher.encode_text(texts, batch_size=256))
    return vectors if head is None else head(vectors, blend)


def rewritten_captions(texts: list[str], copies: int, seed: int = 0) -> list[list[str]]:
    """``copies`` lists of ``texts`` rewritten: WordNet synonyms for a fifth of each text's content words,
    then 15 % of its words dropped (each copy its own draw). More inputs near the captions for a teacher's
    head, whose targets need no bank: on the starter two copies lift AO@10 by about 0.005
    (loadtests/results/robust_starter.md, "The robust ranking on the plain tower")."""
    from paraseek.evaluation.perturb import make_synonym, perturb_all, word_delete
    from paraseek.paraphrase.wordnet import WordNetSource

    synonym = make_synonym(WordNetSource())
    return [perturb_all(texts, lambda t, rng: word_delete(synonym(t, rng, rate=0.2), rng, rate=0.15), seed=seed + 1 + c)
            for c in range(copies)]


def teacher_data(texts: list[str], student: Encoder, teacher: Encoder, head: QueryHead | None = None,
                 blend: float = 1.0, copies: int = 0, seed: int = 0
                 ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """What ``train_query_head`` needs to learn ``teacher``'s retrieval vectors from ``student``'s: the
    targets of the bank's ``texts``, and ``copies`` rewritten copies of them (student's vectors, targets,
    the bank row each rewrites), or None without copies."""
    targets = teacher_targets(texts, teacher, head, blend)
    if not copies:
        return targets, None
    rewritten = [t for copy in rewritten_captions(texts, copies, seed) for t in copy]
    return targets, (l2_normalize(student.encode_text(rewritten, batch_size=256)),
                     teacher_targets(rewritten, teacher, head, blend), np.tile(np.arange(len(texts)), copies))


def held_out_split(rows: int, cfg: HeadTraining) -> tuple[np.ndarray, np.ndarray]:
    """(held-out rows, training rows) of a bank of ``rows`` captions, as ``train_query_head`` splits them."""
    order = np.random.default_rng(cfg.seed).permutation(rows)
    held = int(rows * cfg.held_out)
    return order[:held], order[held:]


def _mlp(dim: int, cfg: HeadTraining) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    width = dim
    for _ in range(cfg.layers):
        layers += [torch.nn.Linear(width, cfg.hidden), torch.nn.GELU(approximate="tanh")]
        width = cfg.hidden
    last = torch.nn.Linear(width, dim)
    torch.nn.init.zeros_(last.weight)  # the head starts as the identity
    torch.nn.init.zeros_(last.bias)
    return torch.nn.Sequential(*layers, last)


def _cosine_distance(mlp: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    moved = torch.nn.functional.normalize(x + mlp(x), dim=-1)
    return (1 - (moved * target).sum(-1)).mean()


def train_query_head(vectors: np.ndarray, cfg: HeadTraining = HeadTraining(),
                     progress: Callable[[int, float], None] | None = None,
                     targets: np.ndarray | None = None, teacher: str | None = None,
                     rewrites: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> QueryHead:
    """A head trained to output the mean shift of ``vectors`` (a bank's, normalised) through themselves, or
    a teacher's ``targets`` (one per row, ``teacher_targets``; ``teacher`` names them in the head's config).
    A mean-shift head fits the bank it learnt from; a teacher's head fits any bank of the same bundle.
    ``rewrites``: (vectors, targets, the bank row each rewrites) of rewritten captions, trained on beside
    the bank's own; those of held-out rows are left out, so the held-out fit stays a fit to unseen text."""
    started = time.perf_counter()
    vectors = np.asarray(vectors, np.float32)
    if targets is None:
        targets, teacher = mean_shift_targets(vectors, cfg.neighbours, cfg.rounds), None
    elif np.shape(targets) != vectors.shape:
        raise ValueError(f"targets {np.shape(targets)} do not match the vectors {vectors.shape}")
    else:
        targets, teacher = np.asarray(targets, np.float32), teacher or "given targets"
    bank_rows, rewrite_rows = len(vectors), 0
    held, train = held_out_split(bank_rows, cfg)
    if rewrites is not None:
        if teacher is None:
            raise ValueError("rewrites need a teacher's targets: the mean shift is defined on the bank's rows")
        r_vectors, r_targets, sources = (np.asarray(a) for a in rewrites)
        kept = ~np.isin(sources, held)
        train = np.concatenate([train, bank_rows + np.flatnonzero(kept)])
        vectors = np.concatenate([vectors, r_vectors.astype(np.float32)])
        targets = np.concatenate([targets, r_targets.astype(np.float32)])
        rewrite_rows = int(kept.sum())
    torch.manual_seed(cfg.seed)
    x, t = torch.from_numpy(vectors), torch.from_numpy(targets)
    mlp = _mlp(vectors.shape[1], cfg)
    opt = torch.optim.AdamW(mlp.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.steps)
    train_rows = torch.from_numpy(train)
    generator = torch.Generator().manual_seed(cfg.seed)
    first_loss = loss_value = 0.0
    for step in range(cfg.steps):
        batch = train_rows[torch.randint(0, len(train_rows), (cfg.batch,), generator=generator)]
        loss = _cosine_distance(mlp, x[batch], t[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        loss_value = loss.item()
        first_loss = first_loss or loss_value
        if progress is not None and (step + 1) % 500 == 0:
            progress(step + 1, loss_value)
    mlp.eval()
    with torch.no_grad():
        held_loss = float(_cosine_distance(mlp, x[held], t[held])) if len(held) else None
        start_loss = float((1 - (x[held] * t[held]).sum(-1)).mean()) if len(held) else None
    linears = [m for m in mlp if isinstance(m, torch.nn.Linear)]
    config = asdict(cfg) | {
        "teacher": teacher,  # None: the bank's mean shift, which fits only this bank's vectors
        "bank_rows": bank_rows, "rewrite_rows": rewrite_rows,
        "first_loss": round(first_loss, 5), "last_loss": round(loss_value, 5),
        # the held-out captions' cosine distance to their targets: before the head (the query itself) and after
        "held_out_rows": len(held), "held_out_identity_loss": start_loss, "held_out_loss": held_loss,
        "activation": "gelu_tanh", "train_s": round(time.perf_counter() - started, 1)}
    log.info("query head: loss %.4f -> %.4f, held out %s (identity %s)", first_loss, loss_value, held_loss, start_loss)
    return QueryHead([m.weight.detach().numpy().copy() for m in linears],
                     [m.bias.detach().numpy().copy() for m in linears], config)
