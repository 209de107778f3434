"""Training recipes: YAML files validated by this schema. Unknown or wrong fields fail with a message
naming the field (``recipe.train.lr: Input should be greater than 0``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from paraseek.core.errors import UserError


class RecipeError(UserError):
    """A recipe file or override is invalid; the message names the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Strict):
    kind: Literal["open_clip", "alignment", "sentence"]
    # open_clip
    name: str | None = Field(None, description="open_clip model name (ViT-B-32, ...)")
    pretrained: str | None = Field(None, description="open_clip tag or checkpoint file")
    config: str | None = Field(None, description="JSON architecture file (configs as data)")
    # alignment / sentence
    encoder: str = Field("minilm", description="Hugging Face model dir, or 'minilm' (the packaged all-MiniLM-L6-v2)")
    image_bundle: str | None = Field(None, description="bundle whose frozen image tower defines the target space "
                                     "('starter': the starter bundle, built if missing)")
    layers: int = Field(6, ge=1, le=24, description="alignment layers m")
    heads: int = Field(8, ge=1)
    train_layers: int | None = Field(None, ge=1, description="train only the last n blocks")

    @model_validator(mode="after")
    def _needs(self):
        if self.kind == "open_clip" and not (self.name or self.config):
            raise ValueError("open_clip models need 'name' or 'config'")
        if self.kind in ("alignment", "sentence") and not self.image_bundle:
            raise ValueError(f"{self.kind} models need 'image_bundle' (the frozen image tower)")
        return self


class ParaphraseSpec(Strict):
    x1: Literal["human", "wordnet", "ppdb", "llm"] = Field("human", description="x' = paraphrase of the caption")
    x2: Literal["wordnet", "ppdb", "llm", "human"] = Field("wordnet", description="x'' = paraphrase of x' avoiding its words")
    dataset: str | None = Field(None, description="pre-generated JSONL (caption, x1, x2); generated if missing")
    ppdb: str | None = None
    human_min_cos: float | None = Field(
        None, ge=-1, le=1, description="x1 'human': only the photo's other captions whose cosine to the caption, by the "
        "frozen tower, is at least this (the nearest one where none is): captions of one photo often describe "
        "different parts of it, and pulling those together blurs the first answer")

    @model_validator(mode="after")
    def _human_only(self):
        if self.human_min_cos is not None and self.x1 != "human":
            raise ValueError(f"human_min_cos picks among human captions: x1 is {self.x1!r}, not 'human'")
        return self


class DataSpec(Strict):
    captions: str | None = Field(None, description="COCO-format captions JSON with images")
    image_embeddings: str | None = Field(None, description="instead of captions: a .npz of image embeddings made by the "
                                         "frozen image tower (ids, vectors, captions as JSON, image_space), e.g. "
                                         "'assets/coco_mini_train_starter_images.npz' (paths relative to training/)")
    images: str | None = Field(None, description="image folder of the captions file (default: beside it)")
    max_images: int | None = Field(None, ge=2, description="train on the first N captioned photos only (a trial on a "
                                   "large set: only those are embedded)")
    text_captions: str | None = Field(None, description="TSV (image_id, caption): extra paraphrase sets without "
                                      "images, used by the text-text terms (ParaCLIP L2/L3)")
    text_per_batch: int = Field(0, ge=0, description="text-only sets added to each batch")
    hold_out: list[str] = Field([], description="pairs files you evaluate on (the `paraseek eval --pairs` TSV): "
                                "captions equal to one of their texts (case and spaces ignored) leave the training data")
    paraphrases: ParaphraseSpec = ParaphraseSpec()
    differences: str | None = Field(None, description="PC-CLIP: JSONL of {image1, image2, text}; default: built from captions")

    @model_validator(mode="after")
    def _one_image_source(self):
        if (self.captions is None) == (self.image_embeddings is None):
            raise ValueError("give exactly one of 'captions' (photos to embed) and 'image_embeddings' (embedded already)")
        return self


class ObjectiveSpec(Strict):
    kind: Literal["paraclip", "laclip", "pcclip", "clip"]
    temperature: float = Field(0.07, gt=0, le=1)
    learnable_temperature: bool = False
    # ParaCLIP ablations
    l1_text: Literal["x", "x1", "x2"] = "x2"
    l1: bool = True
    l2: bool = True
    l3: bool = True
    l1_weight: float = Field(1.0, ge=0, description="weight of L1 (images, x'')")
    l2_weight: float = Field(1.0, ge=0, description="weight of L2 (captions, x')")
    l3_weight: float = Field(1.0, ge=0, description="weight of L3 (x', x'')")
    # LaCLIP: texts sampled per image among the caption and its rewrites
    positives: int = Field(2, ge=1, le=3)
    anchor_weight: float = Field(0.0, ge=0)
    anchor_target: Literal["tower", "bank"] = Field(
        "tower", description="what the anchor term pulls toward: the frozen tower's embedding of the text ('tower'), or "
        "that embedding expanded by its nearest training captions as caption-bank expansion does ('bank': the tower "
        "learns the expansion, so a query needs no expansion at serving time)")
    anchor_bank_n: int = Field(30, ge=1, description="neighbours of a 'bank' anchor target (eq. 5 mean)")
    anchor_bank_rounds: int = Field(
        1, ge=1, le=4, description="rounds of a 'bank' anchor target's expansion: each moves the expanded embedding "
        "to the mean with its own nearest captions again (the mean shift of a bank expansion's `rounds`)")
    anchor_bank_leave_own_out: bool = Field(
        False, description="a 'bank' anchor target leaves out the bank captions of the text's own paraphrase set "
        "(its photo's other captions), as a query's own rephrasings are not in the bank when it is served")
    relation_weight: float = Field(
        0.0, ge=0, description="weight of the similarity-structure term: the cosines among a batch's captions of "
        "different photos kept at the frozen tower's (squared error), so consistency training does not reshape "
        "how unrelated sentences compare (what STS measures)")
    preserve_texts: str | None = Field(
        None, description="general-domain sentences the tuned tower keeps where the frozen tower embeds them, "
        "preserve_per_batch of them each step: 'wordnet' = WordNet's usage examples and glosses (needs NLTK_DATA, "
        "as WordNet rewrites do), or a file of your own (one sentence per line, .gz too, or a TSV with a "
        "'caption' column). Consistency training then reshapes the captions' domain, not how sentences in "
        "general compare (STS)")
    preserve_weight: float = Field(0.0, ge=0, description="weight of that term: mean (1 - cosine) to the frozen tower")
    preserve_per_batch: int = Field(64, ge=1)
    similarity_pairs: str | None = Field(
        None, description="sentence pairs with graded similarity scores the tuned tower learns to order by "
        "cosine (CoSENT), similarity_per_batch of them each step: an STS Benchmark file (genre, file, year, id, "
        "score, sentence1, sentence2), e.g. STS-B's training split. Teaches the sentence similarity that "
        "consistency training would otherwise flatten (never the split you evaluate on)")
    similarity_weight: float = Field(0.0, ge=0, description="weight of that term")
    similarity_per_batch: int = Field(64, ge=2)
    anchor_bank: str | None = Field(
        None, description="caption bank folder whose captions expand a 'bank' anchor target: one `paraseek models "
        "build-bank --bundle BASE --captions YOUR_CAPTIONS` made with the frozen tower (same image space); default: "
        "the training captions, embedded by the frozen tower")


class TrainSpec(Strict):
    lr: float = Field(gt=0)
    batch_size: int = Field(ge=2)
    weight_decay: float = Field(0.001, ge=0)
    epochs: float | None = Field(1.0, gt=0)
    steps: int | None = Field(None, ge=1, description="overrides epochs")
    warmup_steps: int = Field(0, ge=0)
    grad_accum: int = Field(1, ge=1)
    grad_clip: float | None = Field(1.0, gt=0)
    seed: int = 0
    amp: bool = Field(True, description="bf16 autocast on GPU (ignored on CPU)")
    checkpoint_every: int = Field(100, ge=1)
    log_every: int = Field(10, ge=1)
    wise_ft_alpha: float = Field(1.0, ge=0, le=1, description="WiSE-FT: 1 = tuned weights, 0 = original")
    device: str | None = None

    @model_validator(mode="after")
    def _length(self):
        if self.epochs is None and self.steps is None:
            raise ValueError("train.epochs: a run needs train.epochs or train.steps")
        return self


class Recipe(Strict):
    name: str = Field(min_length=1)
    version: str = "1"
    model: ModelSpec
    data: DataSpec
    objective: ObjectiveSpec
    train: TrainSpec
    output: str | None = Field(None, description="run directory (default: runs/<name>)")

    @model_validator(mode="after")
    def _compatible(self):
        if self.objective.relation_weight > 0 and self.objective.kind != "paraclip":
            raise ValueError("objective.relation_weight: the similarity-structure term is part of the paraclip objective")
        if self.objective.preserve_weight > 0 and self.objective.preserve_texts is None:
            raise ValueError("objective.preserve_weight: say which sentences to preserve (objective.preserve_texts)")
        if self.objective.similarity_weight > 0 and self.objective.similarity_pairs is None:
            raise ValueError("objective.similarity_weight: say which scored pairs to learn (objective.similarity_pairs)")
        if (self.objective.anchor_weight > 0 or self.objective.preserve_weight > 0) and self.model.kind == "alignment":
            raise ValueError("objective.anchor_weight, objective.preserve_weight: alignment layers start from scratch, "
                             "there is nothing to anchor to")
        return self


def _set(data: dict, dotted: str, value: str) -> None:
    *path, last = dotted.split(".")
    node = data
    for key in path:
        node = node.setdefault(key, {})
    node[last] = yaml.safe_load(value)


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read a YAML recipe; ``overrides`` are ``train.lr=1e-5`` style assignments."""
    path = Path(path)
    if not path.is_file():
        builtin = Path(__file__).resolve().parent / "recipes" / f"{path.name.removesuffix('.yaml')}.yaml"
        if not builtin.is_file():
            raise RecipeError(f"recipe {path} does not exist (built-in recipes: {', '.join(list_recipes())})")
        path = builtin
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from exc
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key.path=value")
        _set(data, *item.split("=", 1))
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        lines = [f"recipe.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise RecipeError(f"recipe {path} is invalid:\n  " + "\n  ".join(lines)) from exc


def list_recipes() -> list[str]:
    return sorted(p.stem for p in (Path(__file__).resolve().parent / "recipes").glob("*.yaml"))
