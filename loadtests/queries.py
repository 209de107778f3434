"""Realistic queries for load tests and benchmarks: COCO caption groups (the captions of one photo
are human paraphrases of each other)."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path


def caption_groups(tsv: str | Path | None = None, min_size: int = 2) -> list[list[str]]:
    """Caption groups from a TSV with image_id/caption columns, else from the demo gallery's captions."""
    groups: dict[str, list[str]] = defaultdict(list)
    if tsv and Path(tsv).is_file():
        with open(tsv) as f:
            for row in csv.DictReader(f, delimiter="\t"):
                groups[row["image_id"]].append(row["caption"].strip())
    else:
        from paraseek.demo import CAPTIONS_FILE

        for a in json.loads(CAPTIONS_FILE.read_text())["annotations"]:
            groups[str(a["image_id"])].append(a["caption"].strip())
    return [g for g in groups.values() if len(g) >= min_size]
