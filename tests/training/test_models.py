"""Trainable text towers."""

import numpy as np
import torch

from paraseek.training.export.hf_text import minilm_dir
from paraseek.training.models import SentenceText


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
