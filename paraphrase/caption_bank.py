"""Caption-bank expansion: the query's nearest neighbours among the embeddings of a bank of human
captions stand in for its paraphrases (offline, no generator needed).

A bank is a folder: ``texts.txt`` (one caption per line), ``vectors.npy`` (float16, normalised, in the
text space of one bundle) and ``manifest.json`` naming that bundle and its image space; loading it
with another bundle is refused. The package ships its default bank's texts (COCO captions of photos
outside every evaluation set, CC BY 4.0: ``paraphrase/data/ATTRIBUTION.md``); their embeddings are
computed once per bundle (``build``), except where the package ships them for that bundle
(``SHIPPED_VECTORS``: the robust starter's, so its first start does not spend half a minute on them).
A bank may also hold a query head (``head.npz``, ``paraseek.paraphrase.query_head``) trained on its
vectors; rewriting the vectors removes it. The package ships one with the robust starter's vectors, and one
for the plain starter learnt from the robust starter's ranking (a teacher's head, which fits any bank of its
bundle).
"""

from __future__ import annotations

import csv
import gzip
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ValidationError

from paraseek.core.bundle import BundleManifest
from paraseek.core.errors import UserError
from paraseek.core.query_vectors import mean_fusion, weighted_fusion
from paraseek.paraphrase.query_head import HEAD_FILE, QueryHead

if TYPE_CHECKING:
    from paraseek.core.encoder import Encoder
    from paraseek.core.settings import Settings

DEFAULT_TEXTS = Path(__file__).resolve().parent / "data" / "coco_train_captions.tsv.gz"
# ``{bank folder name}.bank.npy``: the default texts' vectors (float16, as ``build`` writes them) for the
# bundles the package ships them for (``default_bank``)
SHIPPED_VECTORS = Path(__file__).resolve().parent / "data"
# rows that must agree before shipped vectors stand for an encoder's; float16 rounding of a normalised
# row is below 2.5e-4, while an int8 tower or other weights move them by 1e-2 or more
SHIPPED_CHECK_ROWS = 32
SHIPPED_CHECK_ATOL = 1e-3
# query heads the package shipped once and has since replaced (``QueryHead.digest``): a default bank holding
# one gets the current shipped head at the next start; a head trained by the user is never among them.
# 8bb3...: the plain starter v3's head learnt half the robust starter's move, shipped until 2026-11-28
SUPERSEDED_HEADS = frozenset({"8bb3e21c12fca200165462bb109073184409cdeb0512452957bf5a1551bb5203"})
FUSIONS = ("mean", "weighted")
# hub_bias: near a max over the bank (the image's best-matching captions), soft enough that one odd caption
# does not set it alone (robust starter v3: 0.01-0.05 all lift R@1, loadtests/results/robust_starter.md "Hubs")
HUB_TEMPERATURE = 0.02
HUB_CHUNK = 4096  # bank rows per product: bounds the (images x chunk) score block


class CaptionBankError(UserError):
    """The bank is missing, malformed, or was embedded by another encoder."""


class CaptionBankManifest(BaseModel):
    bundle: str
    bundle_version: str
    image_space: str
    dim: int
    count: int
    texts_source: str


def read_caption_texts(path: str | Path) -> list[str]:
    """Captions from a text file (one per line, optionally .gz) or a TSV with a ``caption`` column;
    blank lines and duplicates are dropped."""
    path = Path(path)
    if not path.is_file():
        raise CaptionBankError(f"caption file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        if path.name.removesuffix(".gz").endswith(".tsv"):
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            if not reader.fieldnames or "caption" not in reader.fieldnames:
                raise CaptionBankError(f"{path}: a TSV bank needs a 'caption' column")
            texts = [row["caption"] or "" for row in reader]
        else:
            texts = f.read().splitlines()
    texts = list(dict.fromkeys(t.strip() for t in texts if t.strip()))
    if not texts:
        raise CaptionBankError(f"{path} holds no captions")
    return texts


@lru_cache(maxsize=1)
def caption_word_counts() -> Counter[str]:
    """How often each word occurs in the shipped captions: which of two wordings COCO captions
    usually use (``kid`` 45 times, ``child`` 172; the rewrites of ``paraseek.paraphrase.ppdb`` prefer the latter)."""
    return Counter(w for text in read_caption_texts(DEFAULT_TEXTS) for w in re.findall(r"[a-z]+", text.lower()))


@dataclass
class CaptionBank:
    path: Path
    manifest: CaptionBankManifest
    texts: list[str]
    vectors: np.ndarray  # (N, D) float32, normalised
    head: QueryHead | None = None  # trained on these vectors (``head.npz``), where one was

    @classmethod
    def build(cls, encoder: Encoder, texts: list[str], out: str | Path, texts_source: str = "") -> CaptionBank:
        return cls.write(encoder, texts, encoder.encode_text(texts, batch_size=128), out, texts_source)

    @classmethod
    def write(cls, encoder: Encoder, texts: list[str], vectors: np.ndarray, out: str | Path,
              texts_source: str = "") -> CaptionBank:
        """The bank of ``texts`` whose ``encoder`` vectors are ``vectors``, written to ``out``."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / HEAD_FILE).unlink(missing_ok=True)  # trained on the vectors being replaced
        manifest = CaptionBankManifest(bundle=encoder.name, bundle_version=encoder.version,
                                       image_space=encoder.image_space, dim=encoder.dim, count=len(texts),
                                       texts_source=texts_source)
        (out / "texts.txt").write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n", encoding="utf-8")
        half = np.asarray(vectors, dtype=np.float16)
        np.save(out / "vectors.npy", half)
        tmp = out / "manifest.json.tmp"
        tmp.write_text(manifest.model_dump_json(indent=2))
        os.replace(tmp, out / "manifest.json")  # written last: a bank without it is incomplete
        return cls(out, manifest, texts, half.astype(np.float32))

    @classmethod
    def in_memory(cls, texts: list[str], vectors: np.ndarray, source: str = "in memory") -> CaptionBank:
        """A bank of vectors embedded elsewhere (training: the frozen tower's), never written to disk."""
        manifest = CaptionBankManifest(bundle=source, bundle_version="", image_space="", dim=int(vectors.shape[1]),
                                       count=len(texts), texts_source=source)
        return cls(Path(), manifest, texts, np.asarray(vectors, np.float32))

    @classmethod
    def read(cls, path: str | Path) -> CaptionBank:
        """A bank as written, checked for completeness but not against a bundle (``load`` does that)."""
        path = Path(path)
        try:
            manifest = CaptionBankManifest.model_validate_json((path / "manifest.json").read_text())
        except OSError as exc:
            raise CaptionBankError(f"caption bank {path}: manifest.json is missing") from exc
        except ValidationError as exc:
            raise CaptionBankError(f"caption bank {path}: manifest.json is malformed: {exc}") from exc
        texts = (path / "texts.txt").read_text(encoding="utf-8").splitlines()
        vectors = np.load(path / "vectors.npy").astype(np.float32)
        if vectors.shape != (manifest.count, manifest.dim) or len(texts) != manifest.count:
            raise CaptionBankError(f"caption bank {path}: texts, vectors and manifest disagree on the size")
        head = QueryHead.read(path) if (path / HEAD_FILE).is_file() else None
        if head is not None and head.dim != manifest.dim:
            raise CaptionBankError(f"caption bank {path}: its query head takes {head.dim} dimensions, the bank has {manifest.dim}")
        return cls(path, manifest, texts, vectors, head)

    def with_head(self, head: QueryHead) -> CaptionBank:
        """This bank with ``head`` written into its folder."""
        if head.dim != self.manifest.dim:
            raise CaptionBankError(f"a query head of {head.dim} dimensions does not fit a bank of {self.manifest.dim}")
        head.write(self.path)
        return CaptionBank(self.path, self.manifest, self.texts, self.vectors, head)

    @classmethod
    def load(cls, path: str | Path, encoder: Encoder | BundleManifest) -> CaptionBank:
        """A bank checked against the tower it expands: an encoder, or its bundle's manifest (no model loaded)."""
        bank = cls.read(path)
        manifest = bank.manifest
        if (manifest.bundle, manifest.bundle_version) != (encoder.name, encoder.version):
            raise CaptionBankError(
                f"caption bank {path} was embedded by bundle {manifest.bundle} v{manifest.bundle_version}, not by "
                f"{encoder.name} v{encoder.version}: rebuild it with this bundle (paraseek models build-bank)")
        if manifest.image_space != encoder.image_space:
            raise CaptionBankError(f"caption bank {path} is in image space {manifest.image_space!r}, the bundle in "
                                   f"{encoder.image_space!r}: rebuild it with this bundle")
        return bank

    def neighbours(self, queries: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, similarities), each (Q, n), most similar first."""
        q = np.atleast_2d(queries).astype(np.float32)
        n = min(n, len(self.texts))
        sims = q @ self.vectors.T
        rows = np.argpartition(-sims, n - 1, axis=1)[:, :n]
        top = np.take_along_axis(sims, rows, axis=1)
        order = np.argsort(-top, axis=1, kind="stable")
        return np.take_along_axis(rows, order, axis=1), np.take_along_axis(top, order, axis=1)

    def hub_bias(self, image_vectors: np.ndarray, temperature: float = HUB_TEMPERATURE) -> np.ndarray:
        """Each image's hubness against this bank: ``temperature`` x log-sum-exp of its cosines to every bank
        caption over ``temperature``, a soft maximum (inverted softmax, QB-Norm's query bank). An image that
        many captions match strongly, whatever they describe, scores high for every query; less a share of
        this, its scores compare with other images' on what the query says (``HubCorrection``)."""
        g = np.atleast_2d(image_vectors).astype(np.float32)
        peak = np.full(len(g), -np.inf, np.float32)
        total = np.zeros(len(g), np.float64)
        for start in range(0, len(self.vectors), HUB_CHUNK):  # a running log-sum-exp, one bank chunk at a time
            sims = (g @ self.vectors[start:start + HUB_CHUNK].T) / temperature
            new_peak = np.maximum(peak, sims.max(axis=1))
            total = total * np.exp(peak - new_peak) + np.exp(sims - new_peak[:, None]).sum(axis=1)
            peak = new_peak
        return (temperature * (peak + np.log(total))).astype(np.float32)

    def expand(self, queries: np.ndarray, n: int, fusion: str = "mean") -> np.ndarray:
        """Query vectors moved toward their n nearest bank captions (eq. 5 mean, or similarity-weighted)."""
        q = np.atleast_2d(queries).astype(np.float32)
        out = self.fuse(q, *self.neighbours(q, n), fusion)
        return out[0] if np.ndim(queries) == 1 else out

    def fuse(self, queries: np.ndarray, rows: np.ndarray, sims: np.ndarray, fusion: str = "mean") -> np.ndarray:
        """Queries (Q, d) fused with the bank rows ``neighbours`` found for them (the service looks the
        neighbours up in its batcher, then fuses here)."""
        if fusion == "mean":
            return mean_fusion(queries, self.vectors[rows])
        if fusion == "weighted":
            return weighted_fusion(queries, self.vectors[rows], sims)
        raise CaptionBankError(f"fusion must be one of {FUSIONS}, not {fusion!r}")

    def texts_of(self, rows) -> list[str]:
        return [self.texts[int(r)] for r in rows]


def bank_name(bundle: BundleManifest) -> str:
    """The default bank's folder name for a bundle (name and version, safe as a file name)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{bundle.name}-v{bundle.version}")


def bank_dir(home: Path, bundle: BundleManifest) -> Path:
    """Where the default bank for a bundle lives under PARASEEK_HOME."""
    return Path(home) / "caption-banks" / bank_name(bundle)


def configured_bank_dir(settings: Settings, bundle: BundleManifest) -> Path:
    """The bank a bundle is expanded with: ``PARASEEK_CAPTION_BANK``, else its default bank under HOME."""
    return settings.caption_bank or bank_dir(settings.home, bundle)


def shipped_vectors_path(bundle: BundleManifest) -> Path:
    """Where the package ships a bundle's default-bank vectors, if it does."""
    return SHIPPED_VECTORS / f"{bank_name(bundle)}.bank.npy"


def shipped_head_path(bundle: BundleManifest) -> Path:
    """Where the package ships the query head trained on a bundle's shipped default-bank vectors."""
    return SHIPPED_VECTORS / f"{bank_name(bundle)}.{HEAD_FILE}"


def shipped_vectors(encoder: Encoder, texts: list[str]) -> np.ndarray | None:
    """The package's vectors of the default ``texts`` for ``encoder``'s bundle, where it ships them and
    ``encoder`` embeds the first ``SHIPPED_CHECK_ROWS`` texts as they say (the same weights at the same
    precision, up to float16 rounding); otherwise None."""
    path = shipped_vectors_path(encoder.manifest)
    if not path.is_file():
        return None
    vectors = np.load(path)
    if vectors.shape != (len(texts), encoder.dim):
        return None
    check = encoder.encode_text(texts[:SHIPPED_CHECK_ROWS])
    if not np.allclose(check, vectors[:SHIPPED_CHECK_ROWS].astype(np.float32), atol=SHIPPED_CHECK_ATOL):
        return None
    return vectors


def default_bank(home: Path, encoder: Encoder) -> CaptionBank:
    """The shipped captions embedded by ``encoder``: on first use, the package's vectors where it ships
    them for this bundle (``shipped_vectors``), else embedded here (about half a minute on 2 cores)."""
    path = bank_dir(home, encoder.manifest)
    if (path / "manifest.json").is_file():
        return with_shipped_head(CaptionBank.load(path, encoder), encoder)
    texts = read_caption_texts(DEFAULT_TEXTS)
    vectors = shipped_vectors(encoder, texts)
    if vectors is None:
        bank = CaptionBank.build(encoder, texts, path, texts_source=DEFAULT_TEXTS.name)
    else:
        bank = CaptionBank.write(encoder, texts, vectors, path, texts_source=DEFAULT_TEXTS.name)
    return with_shipped_head(bank, encoder)


def holds_superseded_head(folder: Path) -> bool:
    """Whether the bank in ``folder`` holds a query head the package shipped once and has since replaced."""
    return (folder / HEAD_FILE).is_file() and QueryHead.read(folder).digest in SUPERSEDED_HEADS


def with_shipped_head(bank: CaptionBank, encoder: Encoder) -> CaptionBank:
    """``bank`` with the package's query head for its bundle added, where the bank lacks one (a default bank
    written before the head shipped gets it too) or holds one the package has since replaced. A mean-shift
    head is added only to a bank holding the shipped vectors it was trained on; a head learnt from a teacher
    depends on the bundle alone."""
    path, vectors = shipped_head_path(encoder.manifest), shipped_vectors_path(encoder.manifest)
    if not path.is_file() or (bank.head is not None and bank.head.digest not in SUPERSEDED_HEADS):
        return bank
    head = QueryHead.read(path)
    if head.config.get("teacher"):
        return bank.with_head(head)
    if not vectors.is_file():
        return bank
    shipped = np.load(vectors, mmap_mode="r")
    rows = min(SHIPPED_CHECK_ROWS, len(bank.vectors))
    if shipped.shape != bank.vectors.shape or not np.allclose(
            bank.vectors[:rows], np.asarray(shipped[:rows], np.float32), atol=SHIPPED_CHECK_ATOL):
        return bank
    return bank.with_head(head)
