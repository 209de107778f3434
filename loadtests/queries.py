"""Realistic queries for load tests and benchmarks: COCO caption groups (the captions of one photo
are human paraphrases of each other)."""

from __future__ import annotations

import json
from pathlib import Path

from paraseek.core.demo import CAPTIONS_FILE
from paraseek.evaluation.data import read_caption_groups


def caption_groups(tsv: str | Path | None = None, min_size: int = 2) -> list[list[str]]:
    """Caption groups from a TSV with image_id/caption columns, else from the demo gallery's captions."""
    if tsv and Path(tsv).is_file():
        return read_caption_groups(tsv, min_size)
    groups: dict[str, list[str]] = {}
    for a in json.loads(CAPTIONS_FILE.read_text())["annotations"]:
        groups.setdefault(str(a["image_id"]), []).append(a["caption"].strip())
    return [g for g in groups.values() if len(g) >= min_size]
