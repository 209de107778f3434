"""Readers for evaluation data: paraphrase pairs, STS-B, COCO captions."""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from pathlib import Path

from paraseek.core.errors import UserError


class DataError(UserError):
    """An evaluation file is missing or not in a format the harness reads."""


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """Paraphrase pairs from a TSV with a header: columns caption1/caption2 (CxC), sentence1/sentence2,
    or text1/text2; without those names, the last two columns."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"pairs file {path} does not exist")
    with open(path, newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path} is empty")
        for a, b in (("caption1", "caption2"), ("sentence1", "sentence2"), ("text1", "text2")):
            if a in header and b in header:
                ia, ib = header.index(a), header.index(b)
                break
        else:
            ia, ib = len(header) - 2, len(header) - 1
        pairs = [(row[ia].strip(), row[ib].strip()) for row in reader if len(row) > max(ia, ib)]
    pairs = [(a, b) for a, b in pairs if a and b]
    if not pairs:
        raise DataError(f"{path} has no text pairs")
    return pairs


def held_out_texts(paths: list[Path]) -> set[str]:
    """Every text of these pairs files, stripped and lower-cased (``without_held_out`` compares so): what
    training data and caption banks must not contain, or a measurement on those pairs would credit a
    model for having seen (or a bank for holding) the query itself."""
    return {text.strip().lower() for path in paths for pair in read_pairs(path) for text in pair}


def without_held_out(texts: list[str], held_out: set[str]) -> list[str]:
    """``texts`` less those among ``held_out`` (as ``held_out_texts`` gives them), in order."""
    return [t for t in texts if t.strip().lower() not in held_out]


def read_caption_groups(path: str | Path, min_size: int = 2) -> list[list[str]]:
    """Captions grouped by photo from a TSV with ``image_id`` and ``caption`` columns (COCO's captions
    of one photo are human paraphrases of each other); ``.gz`` files are read as they are."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"captions file {path} does not exist")
    groups: dict[str, list[str]] = {}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        if not reader.fieldnames or not {"image_id", "caption"} <= set(reader.fieldnames):
            raise DataError(f"{path}: expected a header with image_id and caption columns")
        for row in reader:
            if row["caption"] and row["caption"].strip():
                groups.setdefault(row["image_id"], []).append(row["caption"].strip())
    return [g for g in groups.values() if len(g) >= min_size]


@dataclass
class StsPair:
    score: float
    a: str
    b: str


def read_sts(path: str | Path) -> list[StsPair]:
    """STS Benchmark: tab-separated genre, file, year, id, score, sentence1, sentence2 (no header)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"STS file {path} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            cols = line.rstrip("\n").split("\t")
            if len(cols) < 7:
                continue
            try:
                out.append(StsPair(float(cols[4]), cols[5].strip(), cols[6].strip()))
            except ValueError:
                if n > 1:  # a header line is fine
                    raise DataError(f"{path}:{n}: score {cols[4]!r} is not a number") from None
    if not out:
        raise DataError(f"{path} has no STS pairs (expected genre, file, year, id, score, s1, s2)")
    return out
