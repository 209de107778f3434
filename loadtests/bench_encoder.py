"""Encoder benchmark: torch eager at 77 tokens vs the bundle runtime (fp32 as exported, fp32 fused,
int8; truncated to the longest real sequence), batch 1 and batch 32, for the open_clip ViT-B-32 text
tower (random weights: speed does not depend on them) and the starter's text tower. All timings in
one run, medians; "fused x" is the exported graph's time over the fused one's (``graph_optimize``).

    paraseek bench encoder [--repeats 30]
    python -m paraseek.loadtests.bench_encoder
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from paraseek.loadtests import temporary_folder
from paraseek.core.demo import demo_captions
from paraseek.core.encoder import Encoder

TARGET = 4.0  # int8 truncated batch-1 must be at least this much faster than torch eager 77 tokens


def _median_ms(fn, inputs, repeats: int) -> float:
    fn(inputs[0])  # warm-up
    times = []
    for i in range(repeats):
        x = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def run(repeats: int = 30, workdir: Path | None = None, threads: int | None = None) -> int:
    # torch and open_clip, lazily: the CLI imports this module, and only this benchmark needs them
    import paraseek.training.torch_env  # noqa: F401  (torchvision shim before open_clip)
    import open_clip
    import torch

    from paraseek.training.export.hf_text import SentenceEncoder, export_text_encoder, load_hf_encoder, max_seq_length, minilm_dir
    from paraseek.training.export.openclip import export_open_clip_model
    from paraseek.training.export.quantize import quantize_text_tower

    if threads:
        torch.set_num_threads(threads)
    tmp = Path(workdir) if workdir else temporary_folder("paraseek-bench-encoder-")
    captions = demo_captions()
    singles = [[c] for c in captions[:repeats]]
    batches = [captions[i : i + 32] for i in range(0, 32 * 4, 32)]

    # open_clip ViT-B-32 text tower, random init, and its bundle
    clip = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    clip_tok = open_clip.get_tokenizer("ViT-B-32")
    for name, optimize in (("vitb32", True), ("vitb32-exported", False)):
        export_open_clip_model(clip, tmp / name, name="vitb32-random", version="bench",
                               image_space="bench", include_image=False, optimize=optimize)
    quantize_text_tower(tmp / "vitb32", captions)

    # starter text tower (MiniLM)
    hf_model, model_dir = load_hf_encoder(minilm_dir())
    minilm = SentenceEncoder(hf_model).eval()
    for name, optimize in (("starter-text", True), ("starter-text-exported", False)):
        export_text_encoder(minilm, model_dir / "tokenizer.json", tmp / name, name="starter-text", version="bench",
                            image_space="bench", max_tokens=max_seq_length(model_dir), optimize=optimize)
    quantize_text_tower(tmp / "starter-text", captions)
    from tokenizers import Tokenizer

    hf_tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    hf_tok.enable_padding(pad_id=0, length=77)
    hf_tok.enable_truncation(77)

    def clip_eager(texts):
        with torch.no_grad():
            return clip.encode_text(clip_tok(texts), normalize=True)

    def minilm_eager(texts):
        enc = hf_tok.encode_batch(texts)
        with torch.no_grad():
            return minilm(torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc]))

    rows = []
    for label, eager, bundle in (  # fp32 and int8 from the fused graph, "exported" as torch wrote it
        ("open_clip ViT-B-32 text", clip_eager, tmp / "vitb32"),
        ("starter text (MiniLM-L6)", minilm_eager, tmp / "starter-text"),
    ):
        exported = Encoder(bundle.with_name(bundle.name + "-exported"), threads=threads)
        fp32 = Encoder(bundle, threads=threads)
        int8 = Encoder(bundle, threads=threads, precision="int8")
        for batch_label, inputs in (("1", singles), ("32", batches)):
            t_eager = _median_ms(eager, inputs, repeats)
            t_exported = _median_ms(exported.encode_text, inputs, repeats)
            t_fp32 = _median_ms(fp32.encode_text, inputs, repeats)
            t_int8 = _median_ms(int8.encode_text, inputs, repeats)
            rows.append((label, batch_label, t_eager, t_exported, t_fp32, t_int8))

    print(f"\nencoder benchmark: median of {repeats} runs, threads={threads or 'all'}")
    print(f"{'model':28} {'batch':>5} {'eager77 ms':>11} {'exported ms':>12} {'fp32 ms':>9} {'int8 ms':>9} "
          f"{'fused x':>8} {'fp32 x':>7} {'int8 x':>7}")
    ok = True
    for label, b, te, tx, tf, ti in rows:
        print(f"{label:28} {b:>5} {te:11.2f} {tx:12.2f} {tf:9.2f} {ti:9.2f} {tx / tf:8.2f} {te / tf:7.2f} {te / ti:7.2f}")
        if b == "1" and te / ti < TARGET:
            ok = False
    print(f"target: int8 truncated batch-1 >= {TARGET:.0f}x faster than torch eager 77 tokens: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run())
