"""Trainable text towers."""

import numpy as np
import pytest
import torch

from paraseek.training.export.hf_text import minilm_dir
from paraseek.training.models import SentenceText


@pytest.mark.quick
def test_embed_batches_by_length_and_returns_rows_in_input_order():
    tower = SentenceText(minilm_dir(), "test-space").eval()
    texts = ["a dog", "two people riding horses along a sandy beach at sunset near the water", "cat",
             "a red bus", "a man holding an umbrella in the rain", "kids", "a plate of food with a fork and a knife"]
    rows = tower.embed(texts, batch_size=3)
    assert rows.dtype == np.float32 and rows.shape == (len(texts), 384)
    with torch.no_grad():
        one_by_one = np.concatenate([tower.encode([t]).numpy() for t in texts])
    np.testing.assert_allclose(rows, one_by_one, atol=1e-5)
    # batched by length: the three shortest texts share the first batch, whatever their input order
    seen: list[list[str]] = []
    original = tower.encode
    tower.encode = lambda batch: seen.append(list(batch)) or original(batch)  # type: ignore[method-assign]
    tower.embed(texts, batch_size=3)
    assert seen[0] == ["cat", "kids", "a dog"] and [len(b) for b in seen] == [3, 3, 1]
    assert tower.embed([], batch_size=3).shape[0] == 0


def test_encode_runs_many_texts_in_chunks_of_similar_length_with_the_same_rows_and_gradients(tiny_clip):
    """A training step's texts go through the tower in length-sorted chunks, each padded to its own longest:
    the rows (and their gradients) are those of one pass padded to the longest of all, in input order."""
    from tests.conftest import TINY_CLIP_CONFIG
    from paraseek.training.models import OpenClipText

    _, _, ckpt = tiny_clip
    texts = ["a dog", "two people riding horses along a sandy beach at sunset near the water", "cat",
             "a red bus", "a man holding an umbrella in the rain", "kids", "a plate of food with a fork and a knife"]
    for tower in (OpenClipText("tiny-clip", str(ckpt), str(TINY_CLIP_CONFIG)), SentenceText(minilm_dir(), "test-space")):
        tower.eval()
        tower.encode_chunk = 0
        whole = tower.encode(texts)
        whole.sum().backward()
        grads = {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}
        tower.zero_grad()
        passes: list[list[str]] = []
        original = tower._forward
        tower._forward = lambda batch, seen=passes, run=original: seen.append(list(batch)) or run(batch)  # type: ignore[method-assign]
        tower.encode_chunk = 3
        chunked = tower.encode(texts)
        assert [len(b) for b in passes] == [3, 3, 1] and passes[0] == ["cat", "kids", "a dog"]
        torch.testing.assert_close(chunked, whole, atol=2e-5, rtol=1e-4)
        chunked.sum().backward()
        assert grads and all(torch.allclose(p.grad, grads[n], atol=1e-4) for n, p in tower.named_parameters() if n in grads)
        assert len(tower.encode(texts[:3])) == 3 and len(passes) == 4  # no more than a chunk: one pass


def test_an_open_clip_tower_keeps_each_texts_token_ids_and_shares_them_with_its_frozen_twin(tiny_clip):
    """open_clip's tokenizer runs in Python (~50 µs a caption): a run's towers tokenise a text once, with the
    ids and padding of the tokenizer itself; past the limit (or with 0) nothing more is kept."""
    import open_clip

    from paraseek.training.models import OpenClipText, frozen_copy
    from tests.conftest import TINY_CLIP_CONFIG

    _, _, ckpt = tiny_clip
    tower = OpenClipText("tiny-clip", str(ckpt), str(TINY_CLIP_CONFIG))
    texts = ["a dog", "two people riding horses along a sandy beach", "a dog", "x" * 400, "🐕 café", "!#$"]
    raw = open_clip.get_tokenizer("tiny-clip")(texts)
    assert raw[5, 1] == 0  # "!" is token 0, the padding id: a row ends at its last non-zero id, not its count
    want = raw[:, : int((raw != 0).sum(1).max())]
    twin = frozen_copy(tower)
    calls: list[list[str]] = []
    inner = tower._tokenizer.tokenizer
    tower._tokenizer.tokenizer = lambda batch: calls.append(list(batch)) or inner(batch)
    assert torch.equal(tower.tokenize(texts)["input_ids"], want)
    assert calls == [["a dog", "two people riding horses along a sandy beach", "x" * 400, "🐕 café", "!#$"]]  # each once
    short = tower.tokenize(texts[5:])["input_ids"]
    assert short.tolist() == [raw[5, :5].tolist()] and short[0, -1] == raw.max()  # the end-of-text token kept
    assert torch.equal(twin.tokenize(texts[:2])["input_ids"], want[:2, : int((want[:2] != 0).sum(1).max())])
    assert len(calls) == 1  # the frozen twin reads the same kept ids
    tower.keep_token_ids(0)
    assert torch.equal(tower.tokenize(texts)["input_ids"], want) and len(calls) == 2 and not tower._tokenizer.ids
    tower.keep_token_ids(2)
    tower.tokenize(texts)  # five new texts, over the limit of 2: tokenised, not kept
    assert not tower._tokenizer.ids and len(calls) == 3
