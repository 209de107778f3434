"""open_clip's BPE vocabulary -> a Hugging Face ``tokenizers`` file, so bundles tokenise without torch.

The pipeline mirrors open_clip's SimpleTokenizer: the same byte-level BPE with ``</w>`` word ends,
the same pre-tokenisation pattern, ``<start_of_text>`` ... ``<end_of_text>`` around every text and
truncation that keeps the end token. ftfy/html cleaning happens in the runtime
(``paraseek.core.tokenizer.clip_clean``, declared as ``cleaning: clip`` in the manifest).
"""

from __future__ import annotations

from pathlib import Path

SOT, EOT = "<start_of_text>", "<end_of_text>"
# open_clip.tokenizer.SimpleTokenizer's pattern without the special tokens (handled as added tokens)
_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def write_clip_tokenizer(path: str | Path, context_length: int = 77) -> Path:
    import paraseek.training.torch_env  # noqa: F401  (torchvision shim before open_clip)
    from open_clip.tokenizer import SimpleTokenizer
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    simple = SimpleTokenizer()
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.get)
    bpe = models.BPE(
        vocab=dict(simple.encoder), merges=list(merges), end_of_word_suffix="</w>",
        continuing_subword_prefix="", fuse_unk=False, unk_token=None,
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SOT, special=True), AddedToken(EOT, special=True)])
    sot, eot = simple.encoder[SOT], simple.encoder[EOT]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SOT} $A {EOT}", special_tokens=[(SOT, sot), (EOT, eot)]
    )
    tok.enable_truncation(max_length=context_length)
    path = Path(path)
    tok.save(str(path))
    return path
