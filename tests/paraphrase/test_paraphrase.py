"""Paraphrase sources (shared by the service and training)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from paraseek.paraphrase import ParaphraseSourceUnavailable, substitution_variants


@pytest.fixture()
def wordnet(shared_data, monkeypatch):
    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))
    from paraseek.paraphrase.wordnet import WordNetSource

    return WordNetSource()


@pytest.mark.quick
def test_substitution_variants_keep_stopwords_and_punctuation():
    alts = {"dog": ["puppy", "hound"], "beach": ["shore"]}
    out = substitution_variants("A dog on the beach.", lambda w: alts.get(w, []), 3)
    assert out[0] == "A puppy on the shore." and out[1] == "A hound on the shore."
    assert all(v.endswith(".") and " on the " in v for v in out)
    assert substitution_variants("on the", lambda w: ["x"], 2) == []


@pytest.mark.quick
def test_wordnet_offers_only_the_more_usual_wording_of_the_main_sense(wordnet):
    assert wordnet.synonyms("kid") == ["child"]  # SemCor: child 148, kid 53
    assert wordnet.synonyms("automobile") == ["car"]
    assert wordnet.synonyms("car") == []  # already the usual word
    assert wordnet.synonyms("man") == []  # not "military man": a rarer sense means something else
    assert "movie" not in wordnet.synonyms("picture")
    assert "way of life" in wordnet.synonyms("path")  # multi-word lemmas become phrases
    out = wordnet.paraphrases("A kid in an automobile", 2)
    assert out[0] == "A child in an car" and len(out) == 2 and "A kid in an automobile" not in out


@pytest.mark.quick
def test_wordnet_is_safe_under_concurrent_requests(wordnet):
    """The service calls it from several threads at once (NLTK's reader alone is not thread-safe)."""
    words = ["kid", "automobile", "photo", "airplane", "phone", "forest", "bathtub", "shop", "big", "someone"] * 3
    texts = [f"a {w} near a {v}" for w, v in zip(words, reversed(words))]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda t: wordnet.paraphrases(t, 2), texts))
    # the same answers as one thread asking one at a time: nothing was lost or corrupted by the threads
    assert results == [wordnet.paraphrases(t, 2) for t in texts]
    assert all(len(r) == 2 and all(p != t for p in r) for r, t in zip(results, texts))


@pytest.mark.quick
def test_unconfigured_sources_say_so(tmp_path):
    from paraseek.paraphrase.llm import ChatClient
    from paraseek.paraphrase.ppdb import PPDBSource

    with pytest.raises(ParaphraseSourceUnavailable, match="PPDB"):
        PPDBSource(None)
    with pytest.raises(ParaphraseSourceUnavailable, match="does not exist"):
        PPDBSource(tmp_path / "none.tsv")
    with pytest.raises(ParaphraseSourceUnavailable, match="LLM"):
        ChatClient(None, None)


@pytest.mark.quick
def test_ppdb_drops_inflections(shared_data):
    from paraseek.paraphrase.ppdb import PPDBSource

    ppdb = PPDBSource(shared_data / "paraphrase/ppdb_lexical_synonyms.tsv", usual_only=False)
    syn = ppdb.synonyms("dog")
    assert syn and "dogs" not in syn


@pytest.mark.quick
def test_ppdb_rewrites_only_toward_more_usual_caption_wording(shared_data):
    from paraseek.paraphrase.caption_bank import caption_word_counts
    from paraseek.paraphrase.ppdb import PPDBSource

    ppdb = PPDBSource(shared_data / "paraphrase/ppdb_lexical_synonyms.tsv")
    counts = caption_word_counts()
    assert "child" in ppdb.synonyms("kid") and "lamb" not in ppdb.synonyms("kid")
    assert ppdb.synonyms("man") == []  # "man" is already the usual word in captions
    for word in ("kid", "automobile", "tiny", "guy"):
        assert all(min(counts[w] for w in alt.split()) > counts[word] for alt in ppdb.synonyms(word))


def test_wordnet_general_sentences_are_its_usage_examples_and_glosses(wordnet, tmp_path, monkeypatch):
    from paraseek.paraphrase.wordnet import _general_sentences, general_sentences

    texts = general_sentences(tmp_path / "cache")
    assert len(texts) > 150_000 and len(set(texts)) == len(texts)
    assert "the dog barked all night" in texts  # dog.n.01's usage example
    assert any(t.startswith("a member of the genus Canis") for t in texts)  # and its gloss
    assert all(t == t.strip() and t for t in texts[:1000])
    # read once a process (each trainer of a sweep asks again), each caller gets its own list
    texts.append("changed by the caller")
    hits = _general_sentences.cache_info().hits
    again = general_sentences(tmp_path / "cache")
    assert _general_sentences.cache_info().hits == hits + 1 and again[-1] != "changed by the caller"
    # and from a file for the next process: the same sentences in the same order, without walking WordNet
    cached = list((tmp_path / "cache").glob("wordnet-sentences-*.json.gz"))
    assert len(cached) == 1 and not list((tmp_path / "cache").glob("*.part"))
    _general_sentences.cache_clear()
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    def no_walk(self, *args, **kwargs):
        raise AssertionError("WordNet walked although its sentences were cached")

    monkeypatch.setattr(WordNetCorpusReader, "all_synsets", no_walk)
    assert general_sentences(tmp_path / "cache") == texts[:-1]
    _general_sentences.cache_clear()
    cached[0].write_bytes(cached[0].read_bytes()[:1000])  # a torn file is read from WordNet again (walk: refused here)
    with pytest.raises(AssertionError, match="WordNet walked"):
        general_sentences(tmp_path / "cache")
    _general_sentences.cache_clear()


@pytest.mark.quick
def test_wordnet_general_sentences_are_given_where_they_cannot_be_cached(wordnet, tmp_path, monkeypatch):
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    from paraseek.paraphrase.wordnet import _general_sentences, general_sentences

    class Synset:
        def examples(self):
            return ["a usage example ", "a usage example"]

        def definition(self):
            return "a gloss"

    monkeypatch.setattr(WordNetCorpusReader, "all_synsets", lambda self, *a, **k: iter([Synset()]))
    (tmp_path / "home").write_text("a file where the cache folder would go")
    _general_sentences.cache_clear()
    try:
        assert general_sentences(tmp_path / "home" / "cache") == ["a usage example", "a gloss"]
    finally:
        _general_sentences.cache_clear()
    assert [p.name for p in tmp_path.iterdir()] == ["home"]  # nothing half-written


_DEBIAN_PROBE = """
import json
from paraseek.paraphrase.wordnet import WordNetSource, _wordnet, _wordnet_root
source = WordNetSource()
words = ["kid", "automobile", "car", "man", "path", "photo", "sofa", "puppy"]
print(json.dumps({"root": _wordnet_root(), "synonyms": {w: source.synonyms(w) for w in words},
                  "nouns": sum(1 for _ in _wordnet().all_synsets("n"))}))
"""


@pytest.mark.quick
def test_wordnet_out_of_the_box_reads_debians_files_as_nltks_own(wordnet, tmp_path):
    """A fresh install has no NLTK data: WordNet is Debian's wordnet-base (install.sh installs it), read
    where Debian puts it, and gives what NLTK's own copy of WordNet 3.0 gives."""
    import json
    import os
    import subprocess
    import sys

    from paraseek.paraphrase.wordnet import DEBIAN_WORDNET

    assert (DEBIAN_WORDNET / "data.noun").is_file(), "install.sh installs Debian's wordnet-base"
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "NLTK_DATA": str(tmp_path / "empty"), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _DEBIAN_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    debian = json.loads(proc.stdout)
    assert debian["root"] == str(DEBIAN_WORDNET)
    assert debian["synonyms"] == {w: wordnet.synonyms(w) for w in debian["synonyms"]}
    assert debian["synonyms"]["kid"] == ["child"] and debian["nouns"] == 82115


@pytest.mark.quick
def test_lexnames_supplied_for_debian_are_wordnets_own(shared_data):
    """Debian's package leaves out lexnames; the one paraseek supplies is the file of NLTK's WordNet 3.0."""
    import zipfile

    from paraseek.paraphrase.wordnet import lexnames_file

    with zipfile.ZipFile(shared_data / "nltk_data" / "corpora" / "wordnet.zip") as zf:
        assert lexnames_file() == zf.read("wordnet/lexnames").decode()


@pytest.mark.quick
def test_without_wordnet_the_error_names_the_command_that_installs_it(tmp_path, monkeypatch):
    import nltk.data

    from paraseek.paraphrase import wordnet as wordnet_module

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    monkeypatch.setattr(wordnet_module, "DEBIAN_WORDNET", tmp_path / "wordnet")
    with pytest.raises(ParaphraseSourceUnavailable, match="WordNet is not installed: .*(apt-get install wordnet-base|nltk.downloader wordnet)"):
        wordnet_module.WordNetSource()
