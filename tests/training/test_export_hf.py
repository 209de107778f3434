"""Hugging Face sentence-encoder exporter, with and without a trained head (alignment layers)."""

import numpy as np
import pytest
import torch
from torch import nn

from paraseek.core.bundle import read_manifest
from paraseek.core.encoder import Encoder
from paraseek.training.export.hf_text import SentenceEncoder, export_hf_text, load_hf_encoder, mean_pool, minilm_dir
from paraseek.training.export.onnx_export import max_abs_diff

TEXTS = ["a dog on a beach", "people riding bicycles", "x"]


class ProjectionHead(nn.Module):
    """Stands in for trained alignment layers: token states + mask -> image-space vector."""

    def __init__(self, width=384, out=32):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True, dropout=0.0)
        self.proj = nn.Linear(width, out)

    def forward(self, hidden, mask):
        return self.proj(mean_pool(self.layer(hidden, src_key_padding_mask=mask == 0), mask))


def test_export_with_head_matches_torch(tmp_path):
    torch.manual_seed(0)
    head = ProjectionHead().eval()
    manifest = export_hf_text(minilm_dir(), tmp_path / "b", head=head, image_space="open_clip/tiny/x")
    assert manifest.embedding_dim == 32 and manifest.image_space == "open_clip/tiny/x"
    enc = Encoder(tmp_path / "b")
    hf, _ = load_hf_encoder(minilm_dir())
    ref_model = SentenceEncoder(hf, head=head).eval()
    batch = enc.tokenize(TEXTS)
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.attention_mask))
    assert max_abs_diff(ref, enc.encode_text(TEXTS)) <= 1e-4
    assert read_manifest(tmp_path / "b").image is None


@pytest.mark.quick
def test_padding_does_not_change_embeddings(starter_encoder):
    alone = starter_encoder.encode_text(["x"])
    with_long = starter_encoder.encode_text(["x", "a much longer sentence that forces padding of the short one"])
    assert np.abs(alone[0] - with_long[0]).max() <= 1e-5


@pytest.mark.quick
def test_long_batches_keep_input_order(starter_encoder, coco_val):
    captions = coco_val[1][:150]
    sorted_batches = starter_encoder.encode_text(captions, batch_size=16)
    one_by_one = np.concatenate([starter_encoder.encode_text([c]) for c in captions[:20]])
    assert np.abs(sorted_batches[:20] - one_by_one).max() <= 1e-5
