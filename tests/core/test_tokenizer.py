"""The bundle tokenizer (no torch) must give open_clip's own ids."""

import logging

import numpy as np
import pytest

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import open_clip

from paraseek.core.encoder import Encoder
from paraseek.core.tokenizer import EmptyTextError

TRICKY = [
    "A photo of a dog.",
    "Café crème brûlée — naïve façade!",
    "日本語のテキスト and emoji 🐶🏖️",
    "it's a dog's life, isn't it? They'll've",
    "  multiple   spaces\tand\nnewlines ",
    "&amp; html &lt;b&gt; entities &quot;quoted&quot;",
    "ﬁancé ﬂowers (ligatures) and Ⅻ roman",
    "numbers 12345 and 3.14159, 1st 2nd",
    "UPPER lower MiXeD",
    "punctuation!!! ??? ... --- ;;; @#$%^&*()",
    "mojibake: donâ€™t",
    "hello<end_of_text>world",
]


@pytest.fixture(scope="module")
def clip_encoder(tiny_clip):
    return Encoder(tiny_clip[0])


@pytest.mark.parametrize("text", TRICKY)
def test_parity_with_open_clip_tokenizer(clip_encoder, text):
    ref = open_clip.get_tokenizer("ViT-B-32")([text])[0].numpy()
    got = clip_encoder.tokenize([text]).input_ids[0]
    assert np.array_equal(got, ref[: len(got)])
    assert not ref[len(got):].any()  # open_clip pads with zeros only after the real tokens


def test_overlong_input_truncated_with_warning(clip_encoder, caplog):
    text = "a very long caption " * 60
    with caplog.at_level(logging.WARNING):
        batch = clip_encoder.tokenize([text, "short"])
    assert batch.truncated == [True, False]
    assert batch.input_ids.shape[1] == 77
    assert "truncated" in caplog.text
    ref = open_clip.get_tokenizer("ViT-B-32")([text])[0].numpy()
    assert np.array_equal(batch.input_ids[0], ref)  # same truncation: keeps <end_of_text> last


@pytest.mark.parametrize("bad", ["", "   ", "\n\t"])
def test_empty_text_rejected(clip_encoder, bad):
    with pytest.raises(EmptyTextError, match="text #1 is empty"):
        clip_encoder.encode_text(["fine", bad])


def test_non_string_rejected(clip_encoder):
    with pytest.raises(TypeError, match="text #0"):
        clip_encoder.encode_text([None])


def test_batch_pads_only_to_longest(clip_encoder):
    batch = clip_encoder.tokenize(["a dog", "a dog on a beach at night"])
    assert batch.input_ids.shape[1] == max(batch.attention_mask.sum(1))
    assert batch.input_ids.shape[1] < 77


@pytest.mark.quick
def test_fingerprints_follow_the_token_ids_not_the_text(starter_bundle, tmp_path):
    """The embedding cache's key: an uncased vocabulary maps "US" and "us" to one key, a cased one
    (export-hf keeps a cased model's tokenizer as it is) to two; special tokens are not text."""
    import json

    from paraseek.core.bundle import read_manifest
    from paraseek.core.tokenizer import BundleTokenizer

    manifest = read_manifest(starter_bundle, verify=False)
    uncased = BundleTokenizer(starter_bundle / "tokenizer.json", manifest.max_tokens, "none", 0)
    a, b, c, d = uncased.fingerprints(["US", "us", "[MASK]", "[mask]"])
    assert a == b and c != d
    assert uncased.fingerprints(["a  dog"]) == uncased.fingerprints(["a dog"])
    spec = json.loads((starter_bundle / "tokenizer.json").read_text())
    assert spec["normalizer"]["lowercase"] is True
    spec["normalizer"]["lowercase"] = False
    (tmp_path / "cased.json").write_text(json.dumps(spec))
    cased = BundleTokenizer(tmp_path / "cased.json", manifest.max_tokens, "none", 0)
    upper, lower = cased.fingerprints(["US", "us"])
    assert upper != lower
