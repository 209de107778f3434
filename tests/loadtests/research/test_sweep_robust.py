"""The robust sweep's shared files."""

from pathlib import Path

import pytest

from paraseek.loadtests.research.sweep_robust import shared_paraphrases
from paraseek.training.recipe import ParaphraseSpec

pytestmark = pytest.mark.quick


def test_runs_share_rewrites_only_when_they_make_them_the_same_way(tmp_path):
    wordnet = shared_paraphrases(tmp_path, ParaphraseSpec())
    assert wordnet == shared_paraphrases(tmp_path, ParaphraseSpec(x1="human", x2="wordnet"))
    ppdb = shared_paraphrases(tmp_path, ParaphraseSpec(x2="ppdb", ppdb="/data/ppdb_lexical_synonyms.tsv"))
    other_ppdb = shared_paraphrases(tmp_path, ParaphraseSpec(x2="ppdb", ppdb="/data/ppdb-s.tsv"))
    assert len({wordnet, ppdb, other_ppdb}) == 3
    assert all(Path(p).parent == tmp_path and p.suffix == ".jsonl" for p in (wordnet, ppdb, other_ppdb))
