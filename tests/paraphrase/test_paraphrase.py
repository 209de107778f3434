"""Paraphrase sources (shared by the service and training)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from paraphrase import ParaphraseSourceUnavailable, substitution_variants


@pytest.fixture()
def wordnet(shared_data, monkeypatch):
    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))
    from paraphrase.wordnet import WordNetSource

    return WordNetSource()


def test_substitution_variants_keep_stopwords_and_punctuation():
    alts = {"dog": ["puppy", "hound"], "beach": ["shore"]}
    out = substitution_variants("A dog on the beach.", lambda w: alts.get(w, []), 3)
    assert out[0] == "A puppy on the shore." and out[1] == "A hound on the shore."
    assert all(v.endswith(".") and " on the " in v for v in out)
    assert substitution_variants("on the", lambda w: ["x"], 2) == []


def test_wordnet_is_pos_aware_and_uses_phrases(wordnet):
    syn = wordnet.synonyms("dog")
    assert "domestic dog" in syn  # multi-word lemma as a phrase
    out = wordnet.paraphrases("A dog on a beach", 2)
    assert len(out) == 2 and all(p != "A dog on a beach" for p in out)


def test_wordnet_is_safe_under_concurrent_requests(wordnet):
    """The service calls it from several threads at once (NLTK's reader alone is not thread-safe)."""
    words = ["car", "house", "tree", "river", "street", "horse", "table", "window", "plate", "train"] * 3
    texts = [f"a {w} near a {v}" for w, v in zip(words, reversed(words))]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda t: wordnet.paraphrases(t, 2), texts))
    # the same answers as one thread asking one at a time: nothing was lost or corrupted by the threads
    assert results == [wordnet.paraphrases(t, 2) for t in texts]
    assert all(len(r) == 2 and all(p != t for p in r) for r, t in zip(results, texts))


def test_unconfigured_sources_say_so(tmp_path):
    from paraphrase.llm import ChatClient
    from paraphrase.ppdb import PPDBSource

    with pytest.raises(ParaphraseSourceUnavailable, match="PPDB"):
        PPDBSource(None)
    with pytest.raises(ParaphraseSourceUnavailable, match="does not exist"):
        PPDBSource(tmp_path / "none.tsv")
    with pytest.raises(ParaphraseSourceUnavailable, match="LLM"):
        ChatClient(None, None)


def test_ppdb_drops_inflections(shared_data):
    from paraphrase.ppdb import PPDBSource

    ppdb = PPDBSource(shared_data / "paraphrase/ppdb_lexical_synonyms.tsv")
    syn = ppdb.synonyms("dog")
    assert syn and "dogs" not in syn
