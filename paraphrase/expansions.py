"""Query expansion methods, one registry: the request schema (which names and parameters are valid), the
service (how a request is expanded), the evaluation harness (``--expansion SPEC``) and the search page
(``/v1/info`` lists them) all read ``EXPANSIONS``. A new method is one subclass and one ``register``.

Two kinds:
- ``RewriteExpansion``: text rewrites of the query by a paraphrase source (``paraseek.paraphrase.factory``),
  embedded with the query and fused with it (Cheng et al. eq. 5 mean, or reciprocal-rank fusion of the
  lists); ``min_cos`` drops rewrites whose embedding strays from the query's.
- ``VectorExpansion``: the query vector moved by a lookup: the caption bank's nearest captions, the
  bank's query head (the bank's mean shift learnt as a function of the query), or pseudo-relevance
  feedback from the top images (Rocchio). What it may look up is ``Lookups``, which the
  service implements on its batchers and the evaluation harness with direct calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, TypeVar

import numpy as np

from paraseek.core.encoder import l2_normalize
from paraseek.core.query_vectors import rocchio
from paraseek.paraphrase.caption_bank import FUSIONS, CaptionBank, CaptionBankError
from paraseek.paraphrase.query_head import check_blend


@dataclass(frozen=True)
class ExpansionParams:
    """The parameters a request (``expansion``) or an evaluation spec sets; each method reads its own."""

    n: int = 3  # rewrites, or bank neighbours
    fusion: str = "mean"
    min_cos: float = -1.0  # rewrites: the guard
    m: int = 5  # prf: top images fed back
    alpha: float = 1.0  # prf: weight of the query
    beta: float = 1.0  # prf: weight of the feedback
    rounds: int = 1  # bank: how many times the query moves to its neighbours' mean (a mean shift); head: after it
    blend: float = 1.0  # head: the share of the head's move the query takes (1: all of it)


@dataclass(frozen=True)
class KeepFirst:
    """The list an expansion with ``keep_first`` serves: the unexpanded query's first ``n`` results, then
    the expanded query's list without them. Expansion buys stability with the precise first answer (the
    caption bank's mean moves a query toward its neighbours' common meaning); keeping the query's own
    first answers restores them, and the order below them stays the stable one. ``within`` keeps only
    those the expanded list also ranks within its first ``within``: a first answer the expansion pushes
    far down is one that a rephrasing of the query would not share either. ``blend`` takes the kept results
    from the query moved that share of the way to its expanded vector instead: a little of the move steadies
    the first answer under rephrasing before it blurs it (the plain starter's head, blend 0.3: AO@10 0.852 ->
    0.867-0.872 at the same R@1, robust_starter.md, "The kept first answer moved a little")."""

    n: int = 0
    within: int = 0
    blend: float = 0.0

    def __bool__(self) -> bool:
        return self.n > 0

    @property
    def label(self) -> str:
        """``keepN``, ``keepNinW``, then ``@B`` with a blend: the evaluation spec's suffix, its report label's."""
        return f"keep{self.n}" + (f"in{self.within}" if self.within else "") + (f"@{self.blend:g}" if self.blend else "")

    def query(self, plain: np.ndarray, expanded: np.ndarray) -> np.ndarray:
        """The vectors whose first results are kept: ``plain`` itself, or with ``blend`` moved that share of the
        way to ``expanded`` (rows of both, normalised)."""
        if not self.blend:
            return plain
        return l2_normalize(plain + self.blend * (expanded - plain))

    @property
    def depth(self) -> int:
        """How many more expanded results a list of k needs (the kept ones and the ``within`` check)."""
        return max(self.n, self.within)

    def serve(self, plain: Sequence[int], expanded: Sequence[int]) -> list[int]:
        look = {int(i) for i in expanded[: self.within]} if self.within else None
        head = [int(i) for i in plain[: self.n] if i >= 0 and (look is None or int(i) in look)]
        taken = set(head)
        return head + [int(i) for i in expanded if i >= 0 and int(i) not in taken]


@dataclass(frozen=True)
class ConfidentLead:
    """The list a request with ``lead_margin`` serves: the list as it would be, with the first answer of a
    second text tower of the same image space (the server's first-answer bundle) moved to the top where
    that tower is sure of it, its first image's score above its second's by more than ``margin``. A
    stable ranking (the robust tower with bank rounds) loses first answers that a plainer, more precise
    tower gets right; where that tower's margin is large, a rephrasing keeps its answer too, so it comes
    back at little cost in stability. Robust default under the plain starter's lead at margin 0.035, dev
    pairs: AO@10 0.901, T2I R@1 31.7 against 0.903, 30.6 (loadtests/results/robust_starter.md, "A
    confident first answer"); ``HubCorrection`` now wins more first answers without the second tower."""

    margin: float | None = None

    def __bool__(self) -> bool:
        return self.margin is not None

    @property
    def label(self) -> str:
        """``leadM``: the evaluation spec's suffix, and its report label's."""
        return f"lead{self.margin:g}" if self.margin is not None else ""

    def leads(self, ids: Sequence[int] | np.ndarray, scores: Sequence[float] | np.ndarray) -> bool:
        """Whether the lead tower's list (``ids``, its ``scores``, best first) is sure of its first answer."""
        if self.margin is None or len(ids) == 0 or ids[0] < 0:
            return False
        return len(ids) < 2 or ids[1] < 0 or float(scores[0]) - float(scores[1]) > self.margin

    def serve(self, served: Sequence[int], ids: Sequence[int] | np.ndarray, scores: Sequence[float] | np.ndarray) -> list[int]:
        if not self.leads(ids, scores):
            return [int(i) for i in served]
        first = int(ids[0])
        return [first] + [int(i) for i in served if int(i) != first]


HUB_SHORTLIST = 100  # results reordered per list: the starter's v3 gallery gives the exact order from 100 (99.4 % at 50)


@dataclass(frozen=True)
class HubCorrection:
    """The list a request with ``hub_weight`` serves: its first ``HUB_SHORTLIST`` results ordered again by
    score less ``weight`` x the image's hubness against the caption bank (``CaptionBank.hub_bias``, computed
    once per image). Some images score high for any caption (the starter's image side describes a photo by
    ImageNet classes; CLIP has hubs too); they take first answers from the images a query describes. The robust
    starter's tower ranks the right photo first 30.9 % of the time alone and 35.1 % at weight 0.55; its default
    (bank rounds, keep 1 within 7) 30.6 and 33.8 %, AO@10 0.903 and 0.901 (robust_starter.md, "Hubs")."""

    weight: float = 0.0

    def __bool__(self) -> bool:
        return self.weight > 0

    @property
    def label(self) -> str:
        """``hubW``: the evaluation spec's suffix, and its report label's."""
        return f"hub{self.weight:g}" if self.weight > 0 else ""

    def depth(self, k: int) -> int:
        """How many results a list of ``k`` is searched for, so the reordered first ``k`` are the right ones."""
        return max(k, HUB_SHORTLIST) if self else k

    def rerank(self, scores: np.ndarray, ids: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's list (``ids`` best first, -1 padding last, ``bias`` of each id) reordered by its corrected
        score, which it is shown with."""
        corrected = np.where(ids >= 0, scores - self.weight * bias, -np.inf).astype(np.float32)
        order = np.argsort(-corrected, axis=1, kind="stable")
        return np.take_along_axis(corrected, order, axis=1), np.take_along_axis(ids, order, axis=1)


def spec_number(args: list[str], at: int, default: float, kind: type = float):
    """Argument ``at`` of an evaluation spec as a number (``default`` when absent)."""
    if len(args) <= at:
        return default
    try:
        return kind(args[at])
    except ValueError:
        raise ValueError(f"{args[at]!r} is not a number") from None


class Lookups(Protocol):
    """What a vector expansion may ask of whoever runs it."""

    async def caption_bank(self) -> CaptionBank: ...

    async def bank_neighbours(self, bank: CaptionBank, queries: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, similarities) of each query's n nearest bank captions."""
        ...

    async def top_images(self, queries: np.ndarray, m: int) -> np.ndarray:
        """Ids (Q, m) of each query's top images (-1 where fewer)."""
        ...

    async def image_vectors(self, ids: np.ndarray) -> list[np.ndarray]:
        """Each query's stored vectors of ``ids`` (missing ids left out, so ragged)."""
        ...


class ExpansionMethod(ABC):
    name: str
    label: str  # what the search page shows
    spec_help: str  # the evaluation harness's --expansion syntax (any spec may end with :keepK[inW], ``KeepFirst``)
    kind: ClassVar[Literal["rewrites", "vectors"]]
    fusions: ClassVar[tuple[str, ...]] = ("mean",)
    max_n: ClassVar[int] = 128  # bank neighbours: one product with the bank whatever n is; fusing 128 costs little
    min_rounds: ClassVar[int] = 1
    max_rounds: ClassVar[int] = 1
    default_rounds: ClassVar[int] = 1  # a request's rounds when it names none
    uses_bank: ClassVar[bool] = False  # the service loads the caption bank ahead when it is the default

    def check(self, p: ExpansionParams) -> None:
        """Raises ``ValueError`` (the request's 422) when ``p`` does not fit this method."""
        if p.fusion not in self.fusions:
            raise ValueError(f"fusion {p.fusion!r} does not apply to {self.name} (use {' or '.join(self.fusions)})")
        if p.n > self.max_n:
            raise ValueError(f"{self.name}: n is at most {self.max_n}")
        if not self.min_rounds <= p.rounds <= self.max_rounds:
            raise ValueError(f"{self.name}: rounds must be 1" if self.max_rounds == 1
                             else f"{self.name}: rounds is {self.min_rounds} to {self.max_rounds}")

    @abstractmethod
    def from_spec(self, args: list[str]) -> ExpansionParams:
        """The parameters of an evaluation spec's arguments (``bank:30:weighted`` -> ["30", "weighted"])."""

    @abstractmethod
    def spec_label(self, p: ExpansionParams) -> str:
        """A short name of this method with ``p`` (a column of the evaluation report)."""


class RewriteExpansion(ExpansionMethod):
    kind = "rewrites"
    fusions = ("mean", "rrf")
    max_n = 16  # rewrites are generated one by one

    def __init__(self, name: str, label: str, source: str | None = None):
        self.name, self.label = name, label
        self.source = source or name  # the paraphrase source (paraseek.paraphrase.factory) that writes them
        self.spec_help = f"{name}:N[:MIN_COS]"

    def from_spec(self, args: list[str]) -> ExpansionParams:
        return ExpansionParams(n=spec_number(args, 0, 3, int), min_cos=spec_number(args, 1, -1.0))

    def spec_label(self, p: ExpansionParams) -> str:
        return f"{self.name}{p.n}" + (f"@cos{p.min_cos:g}" if p.min_cos > -1 else "")


class VectorExpansion(ExpansionMethod):
    kind = "vectors"

    @abstractmethod
    async def expand(self, queries: np.ndarray, p: ExpansionParams, lookups: Lookups) -> tuple[np.ndarray, list[str]]:
        """The expanded vectors of ``queries`` (Q, d), and the texts that moved the first one (shown to
        the user as ``expansions``; empty when no text did)."""


class BankExpansion(VectorExpansion):
    """The query moved to the mean of itself and its n nearest bank captions; with ``rounds`` > 1 the
    moved query looks up its own neighbours and moves again (a mean shift toward the densest nearby
    captions), so two rephrasings of one request end nearer each other. Robust starter, dev pairs, 64
    neighbours, no keep_first: AO@10 0.883 after one round, 0.902 after two, 0.908 after three
    (loadtests/results/eval_keep_first.md)."""

    name = "bank"
    label = "caption bank"
    fusions = FUSIONS
    max_rounds = 4
    uses_bank = True
    spec_help = "bank:N[:mean|weighted[:ROUNDS]]"

    async def expand(self, queries, p, lookups):
        bank = await lookups.caption_bank()
        return await mean_shift(bank, queries, p, lookups)

    def from_spec(self, args):
        return ExpansionParams(n=spec_number(args, 0, 30, int), fusion=args[1] if len(args) > 1 else "mean",
                               rounds=spec_number(args, 2, 1, int))

    def spec_label(self, p):
        return f"bank{p.n}-{p.fusion}" + (f"-x{p.rounds}" if p.rounds > 1 else "")


async def mean_shift(bank: CaptionBank, queries: np.ndarray, p: ExpansionParams,
                     lookups: Lookups) -> tuple[np.ndarray, list[str]]:
    """``p.rounds`` bank rounds from ``queries``: each moves them to the fusion of their ``p.n`` nearest bank
    captions; the texts are the first query's last neighbours."""
    moved, texts = queries, []
    for _ in range(p.rounds):
        rows, sims = await lookups.bank_neighbours(bank, moved, p.n)
        moved, texts = bank.fuse(moved, rows, sims, p.fusion), bank.texts_of(rows[0])
    return moved, texts


class HeadExpansion(VectorExpansion):
    """The caption bank's query head (``paraseek models train-head``): a small MLP trained to output the
    bank's mean shift of a query, so most of the bank's stability costs no lookup; ``rounds`` bank rounds
    of n neighbours may follow it. Robust starter v3, dev pairs, keep 1 within 7: AO@10 0.88 with no
    lookup, 0.90 with one round of 64, where the bank alone needs three; ``blend`` 0.5 (half the head's move,
    no keep rule) 0.856 at R@1 28.0 and R@10 82.9 (loadtests/results/robust_starter.md)."""

    name = "head"
    label = "query head (the caption bank, learnt)"
    min_rounds = default_rounds = 0
    max_rounds = 4
    uses_bank = True
    spec_help = "head[:ROUNDS[:N[:BLEND]]]"

    def check(self, p):
        super().check(p)
        check_blend(p.blend)  # a QueryHeadError is a ValueError: the request's 422, the harness's message

    async def expand(self, queries, p, lookups):
        bank = await lookups.caption_bank()
        if bank.head is None:
            raise CaptionBankError(f"caption bank {bank.path} has no query head: train one with "
                                   "`paraseek models train-head`")
        return await mean_shift(bank, bank.head(queries, p.blend), p, lookups)

    def from_spec(self, args):
        return ExpansionParams(rounds=spec_number(args, 0, self.default_rounds, int), n=spec_number(args, 1, 64, int),
                               blend=spec_number(args, 2, 1.0))

    def spec_label(self, p):
        return ("head" + (f"@{p.blend:g}" if p.blend != 1 else "")
                + (f"+bank{p.n}" + (f"-x{p.rounds}" if p.rounds > 1 else "") if p.rounds else ""))


class FeedbackExpansion(VectorExpansion):
    name = "prf"
    label = "pseudo-relevance feedback"
    spec_help = "prf:M[:ALPHA:BETA]"

    async def expand(self, queries, p, lookups):
        top = await lookups.top_images(queries, p.m)
        return rocchio(queries, await lookups.image_vectors(top), p.alpha, p.beta), []

    def from_spec(self, args):
        return ExpansionParams(m=spec_number(args, 0, 5, int), alpha=spec_number(args, 1, 1.0), beta=spec_number(args, 2, 1.0))

    def spec_label(self, p):
        return f"prf{p.m}-a{p.alpha:g}-b{p.beta:g}"


EXPANSIONS: dict[str, ExpansionMethod] = {}
M = TypeVar("M", bound=ExpansionMethod)


def register(method: M) -> M:
    if method.name in EXPANSIONS or method.name == "none":
        raise ValueError(f"an expansion method named {method.name!r} exists")
    EXPANSIONS[method.name] = method
    return method


def unregister(name: str) -> None:
    EXPANSIONS.pop(name, None)


def expansion_method(name: str) -> ExpansionMethod:
    """The registered method ``name``; ``ValueError`` naming the registered ones otherwise."""
    try:
        return EXPANSIONS[name]
    except KeyError:
        raise ValueError(f"unknown expansion method {name!r} (one of {', '.join(EXPANSIONS)}, or none)") from None


register(BankExpansion())
register(HeadExpansion())
register(RewriteExpansion("wordnet", "WordNet"))
register(RewriteExpansion("ppdb", "PPDB"))
register(FeedbackExpansion())
register(RewriteExpansion("generator", "LLM, two-step generator"))
register(RewriteExpansion("llm", "LLM rewrites"))
