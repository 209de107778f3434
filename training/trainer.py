"""`paraseek train RECIPE`: one entry point for CPU, one GPU and torchrun/DDP.

AdamW, cosine schedule with warm-up, gradient accumulation, bf16 autocast on GPU, checkpoint and
resume (a resumed run reaches exactly the state of an uninterrupted one), seeded determinism, a
progress bar and JSONL metrics. The run ends by exporting a bundle (and a TensorRT engine where
``trtexec`` exists).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import numpy as np
import torch
from tqdm import tqdm

from paraseek.core.errors import UserError
from paraseek.core.bundle import read_manifest
from paraseek.core.encoder import Encoder
from paraseek.core.query_vectors import mean_fusion
from paraseek.core.settings import Settings
from paraseek.evaluation.data import StsPair, read_sts
from paraseek.paraphrase.caption_bank import CaptionBank, CaptionBankError, read_caption_texts
from paraseek.training.export.hf_text import minilm_dir
from paraseek.training.export.starter import ensure_starter_bundle
from paraseek.training.data import (TrainingData, close_captions, difference_batch, load_training_data, resolve_data_path,
                                    sample_batch)
from paraseek.training.losses import (Temperature, anchor_loss, cosent_loss, difference_loss, info_nce, multi_positive_loss,
                                      paraclip_loss, relation_loss, wise_ft)
from paraseek.training.models import AlignmentText, OpenClipText, SentenceText, TextTower, frozen_copy
from paraseek.training.recipe import Recipe

log = logging.getLogger(__name__)
T = TypeVar("T")
CHECKPOINT = "checkpoint.pt"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _resolve_image_bundle(spec: str) -> Path:
    if spec == "starter":  # the frozen image tower: the same in the plain and the robust starter
        return ensure_starter_bundle(Settings().plain_starter_bundle_dir)
    return Path(spec)


def build_model(recipe: Recipe, run_dir: Path) -> tuple[TextTower, Encoder]:
    """The trainable tower and the frozen image encoder (an ONNX bundle) that embeds the images."""
    m = recipe.model
    tower: TextTower
    if m.kind == "open_clip":
        tower = OpenClipText(m.name or "", m.pretrained, m.config, train_layers=m.train_layers)
        base = run_dir / "base-bundle"
        if not (base / "manifest.json").is_file():
            tower.export(base, name=f"{recipe.name}-base", version="0", source={"role": "frozen image tower"})
        tower.frozen_image_bundle = base
        return tower, Encoder(base)
    assert m.image_bundle is not None  # the recipe schema requires it for these kinds
    image_bundle = _resolve_image_bundle(m.image_bundle)
    image_encoder = Encoder(image_bundle)
    if not image_encoder.has_image_tower:
        raise UserError(f"model.image_bundle: {image_bundle} has no image tower")
    encoder_dir = minilm_dir() if m.encoder == "minilm" else Path(m.encoder)
    if m.kind == "alignment":
        tower = AlignmentText(encoder_dir, image_encoder.image_space, image_encoder.dim, m.layers, m.heads, image_bundle)
    else:
        tower = SentenceText(encoder_dir, image_encoder.image_space, image_bundle, train_layers=m.train_layers)
    return tower, image_encoder


def run_steps(photos: int, batch_size: int, text_sets: int, text_per_batch: int, epochs: float) -> int:
    """Steps of a run of ``epochs`` epochs: an epoch passes every photo once, and every text-only paraphrase
    set once where batches carry them (``text_per_batch``)."""
    per_epoch = max(1, math.ceil(photos / batch_size))
    if text_sets and text_per_batch:
        per_epoch = max(per_epoch, math.ceil(text_sets / text_per_batch))
    return max(1, math.ceil(per_epoch * epochs))


def cosine_schedule(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def bank_of_frozen_tower(path: Path, frozen: TextTower) -> CaptionBank:
    """A caption bank made with the frozen tower (``paraseek models build-bank --bundle BASE``): a bank of
    another image space or width would pull the tower toward another model's embeddings."""
    try:
        bank = CaptionBank.read(path)
    except (CaptionBankError, OSError) as exc:
        raise UserError(f"objective.anchor_bank: {exc}") from None
    with torch.no_grad():
        dim = int(frozen.encode(["a photo"]).shape[-1])
    if bank.manifest.image_space != frozen.image_space or bank.manifest.dim != dim:
        raise UserError(f"objective.anchor_bank: {path} holds {bank.manifest.dim}-d vectors in image space "
                        f"{bank.manifest.image_space!r}; the tower being trained is {dim}-d in {frozen.image_space!r}: "
                        "build the bank with the frozen tower's bundle (paraseek models build-bank --bundle BASE)")
    return bank


def preserved_sentences(source: str) -> list[str]:
    """The general-domain sentences of ``objective.preserve_texts``: WordNet's, or a file's."""
    from paraseek.paraphrase import ParaphraseSourceUnavailable
    from paraseek.paraphrase.wordnet import general_sentences

    try:
        return general_sentences() if source == "wordnet" else read_caption_texts(resolve_data_path(source))
    except (ParaphraseSourceUnavailable, UserError) as exc:
        raise UserError(f"objective.preserve_texts: {source}: {exc}") from None


def similarity_pairs(path: str) -> list[StsPair]:
    """The scored sentence pairs of ``objective.similarity_pairs`` (an STS Benchmark file)."""
    try:
        return read_sts(resolve_data_path(path))
    except UserError as exc:
        raise UserError(f"objective.similarity_pairs: {exc}") from None


def tower_digest(tower: TextTower) -> str:
    """A short digest of a tower's weights (its state dict, in order)."""
    h = hashlib.sha256()
    for name, value in tower.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class AnchorTargets:
    """Anchor targets that teach the tower caption-bank expansion: for every training text, the frozen
    tower's embedding moved to the eq. 5 mean with its ``n`` nearest captions of a bank (the expansion
    the service applies with a caption bank): the human training captions embedded by the frozen tower,
    or a bank built beforehand from the user's own captions (``objective.anchor_bank``). Computed once
    per run directory."""

    def __init__(self, texts: list[str], vectors: np.ndarray, plain: np.ndarray):
        self.row = {t: i for i, t in enumerate(texts)}
        self.vectors = torch.from_numpy(vectors.astype(np.float32))
        self.plain = torch.from_numpy(plain.astype(np.float32))  # the frozen tower's own embeddings

    @classmethod
    def expanded(cls, frozen: TextTower, data: TrainingData, n: int, run_dir: Path, batch: int = 256,
                 bank_path: Path | None = None, leave_own_out: bool = False, rounds: int = 1) -> AnchorTargets:
        groups = data.captions + (data.text_groups or [])
        captions = list(dict.fromkeys(c for group in groups for c in group))
        rewrites = [r for pair in data.rewrites.values() for r in pair if r]
        texts = list(dict.fromkeys(captions + rewrites))
        given = bank_of_frozen_tower(bank_path, frozen) if bank_path is not None else None
        source = "training captions"  # what the cached targets were expanded with
        if given is not None:
            digest = hashlib.sha256("\n".join(given.texts).encode() + given.vectors.tobytes()).hexdigest()[:16]
            source = f"bank {given.manifest.bundle} {given.manifest.count} {digest}"
        # the frozen tower's weights are part of the key: a run directory (or a sweep's shared targets)
        # reused for another starting tower must not hand it the first tower's targets
        source += f" tower {tower_digest(frozen)}"
        cache = run_dir / f"anchor-targets-bank{n}{'-own-out' if leave_own_out else ''}{f'-x{rounds}' if rounds > 1 else ''}.npz"
        if cache.is_file():
            with np.load(cache, allow_pickle=False) as z:
                if z["texts"].tolist() == texts and "bank" in z.files and str(z["bank"]) == source:
                    return cls(texts, z["vectors"], z["plain"])
        plain = frozen.embed(texts, batch, desc="anchor targets")
        bank = given or CaptionBank.in_memory(captions, plain[: len(captions)])
        def expand(rows: np.ndarray) -> np.ndarray:
            return np.concatenate([bank.expand(rows[i:i + 2048], n) for i in range(0, len(rows), 2048)])

        vectors = _expand_leaving_own_out(bank, groups, data.rewrites, texts, plain, n) if leave_own_out else expand(plain)
        for _ in range(rounds - 1):  # the moved embeddings look up their own neighbours (a mean shift)
            vectors = expand(vectors)
        np.savez(cache, texts=np.array(texts), vectors=vectors.astype(np.float32), plain=plain.astype(np.float32),
                 bank=np.array(source))
        return cls(texts, vectors, plain)

    def of(self, texts: list[str]) -> torch.Tensor:
        return self.vectors[[self.row[t] for t in texts]]

    def plain_of(self, texts: list[str]) -> torch.Tensor:
        return self.plain[[self.row[t] for t in texts]]


def _expand_leaving_own_out(bank: CaptionBank, groups: list[list[str]], rewrites: dict[str, tuple[str | None, str]],
                            texts: list[str], plain: np.ndarray, n: int) -> np.ndarray:
    """Each text's eq. 5 mean with its ``n`` nearest bank captions outside its own paraphrase set (a
    rewrite belongs to its caption's set)."""
    group_of = {c: g for g, group in enumerate(groups) for c in group}
    for caption, pair in rewrites.items():
        for rewrite in pair:
            if rewrite and caption in group_of:
                group_of.setdefault(rewrite, group_of[caption])
    row_group = np.array([group_of.get(t, -1) for t in bank.texts])
    widest = max(map(len, groups), default=0) + 2  # a set's captions and rewrites that may be in the bank
    out = []
    for i in range(0, len(texts), 2048):
        rows, _ = bank.neighbours(plain[i:i + 2048], n + widest)
        own = np.array([group_of.get(t, -2) for t in texts[i:i + 2048]])
        keep = row_group[rows] != own[:, None]
        kept = np.stack([r[k][:n] for r, k in zip(rows, keep)])
        out.append(mean_fusion(plain[i:i + 2048], bank.vectors[kept]))
    return np.concatenate(out)


@dataclass
class RunResult:
    run_dir: Path
    bundle: Path
    steps: int
    first_loss: float
    last_loss: float


class Trainer:
    def __init__(self, recipe: Recipe, run_dir: Path | None = None):
        self.recipe = recipe
        self.run_dir = Path(run_dir or recipe.output or Path("runs") / recipe.name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t = recipe.train
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.distributed:
            torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            self.rank, self.world = 0, 1
        self.device = torch.device(t.device or (f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"))
        seed_everything(t.seed)
        self.tower, self.image_encoder = build_model(recipe, self.run_dir)
        self.tower.to(self.device)
        o = recipe.objective
        self.original = (frozen_copy(self.tower) if (o.anchor_weight > 0 or o.relation_weight > 0 or o.preserve_weight > 0
                                                      or t.wise_ft_alpha < 1) else None)
        self.preserved = preserved_sentences(o.preserve_texts) if o.preserve_weight > 0 and o.preserve_texts else []
        self.similarity = similarity_pairs(o.similarity_pairs) if o.similarity_weight > 0 and o.similarity_pairs else []
        self.temperature = Temperature(recipe.objective.temperature, recipe.objective.learnable_temperature).to(self.device)
        self.data = load_training_data(recipe.data, self.image_encoder, self.run_dir)
        bank_path = resolve_data_path(o.anchor_bank) if o.anchor_bank else None
        self.anchor_targets = (AnchorTargets.expanded(self.original, self.data, o.anchor_bank_n, self.run_dir, bank_path=bank_path,
                                                      leave_own_out=o.anchor_bank_leave_own_out,
                                                      rounds=o.anchor_bank_rounds)
                               if self.original is not None and o.anchor_weight > 0 and o.anchor_target == "bank" else None)
        min_cos = recipe.data.paraphrases.human_min_cos
        self.x1_choices = self._close_captions(min_cos) if min_cos is not None else None
        if self.data.vectors.shape[1] != self._probe_dim():
            raise UserError(f"text tower dim {self._probe_dim()} != image embedding dim {self.data.vectors.shape[1]}")
        text_per_batch = recipe.data.text_per_batch if recipe.objective.kind == "paraclip" else 0
        self.total_steps = t.steps or run_steps(len(self.data.captions), t.batch_size, len(self.data.text_groups or []),
                                                text_per_batch, t.epochs or 0.0)  # epochs is set without steps
        params = [p for p in self.tower.parameters() if p.requires_grad] + list(
            p for p in self.temperature.parameters() if p.requires_grad)
        self.model: torch.nn.Module = self.tower
        if self.distributed:
            self.model = torch.nn.parallel.DistributedDataParallel(self.tower, device_ids=[self.device] if self.device.type == "cuda" else None)
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, cosine_schedule(t.warmup_steps, self.total_steps))
        self.step = 0
        self._resume()

    def _close_captions(self, min_cos: float) -> dict[str, list[str]]:
        """``data.paraphrases.human_min_cos``: each caption's x' candidates, by the frozen tower's cosines
        (the anchor targets' own embeddings where they are computed)."""
        groups = self.data.captions + (self.data.text_groups or [])
        texts = list(dict.fromkeys(c for group in groups for c in group))
        if self.anchor_targets is not None:
            plain = self.anchor_targets.plain_of(texts).numpy()
        else:
            frozen = self.original if self.original is not None else self.tower  # not trained yet either way
            plain = frozen.embed(texts, 256, desc="x' candidates")
        return close_captions(groups, dict(zip(texts, plain)), min_cos)

    def _probe_dim(self) -> int:
        with torch.no_grad():
            return int(self.tower.encode(["a photo"]).shape[-1])

    # -- checkpoints -------------------------------------------------------------------------
    def _resume(self) -> None:
        path = self.run_dir / CHECKPOINT
        if not path.is_file():
            return
        state = torch.load(path, map_location=self.device, weights_only=True)  # tensors and plain data: no pickled code runs
        if state.get("recipe") != self.recipe.model_dump(mode="json"):
            raise UserError(f"{path} belongs to a different recipe: use another output directory")
        self.tower.load_state_dict(state["tower"], strict=False)
        self.temperature.load_state_dict(state["temperature"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        log.info("resumed %s at step %d", path, self.step)

    def save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        tmp = self.run_dir / (CHECKPOINT + ".tmp")
        torch.save({"tower": self.tower.trainable_state(), "temperature": self.temperature.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "step": self.step, "recipe": self.recipe.model_dump(mode="json")}, tmp)
        os.replace(tmp, self.run_dir / CHECKPOINT)

    # -- objective ---------------------------------------------------------------------------
    def _sample(self, items: list[T], k: int, step: int, stream: int) -> list[T]:
        """``k`` of ``items`` for this step, without repeats: seeded by (seed, step, stream) so a resumed run
        draws what the uninterrupted one drew."""
        rng = np.random.default_rng([self.recipe.train.seed, step, stream])
        return [items[i] for i in rng.choice(len(items), size=min(k, len(items)), replace=False)]

    def loss(self, step: int) -> tuple[torch.Tensor, dict]:
        r, t = self.recipe, self.recipe.train
        o = r.objective
        temp = self.temperature()
        batch = sample_batch(self.data, step, t.batch_size, t.seed, r.data.paraphrases.x1 == "human",
                             r.data.text_per_batch if o.kind == "paraclip" else 0, self.x1_choices)
        if self.world > 1:  # each rank takes its share of the batch
            keep = slice(self.rank, None, self.world)
            batch.images, batch.x, batch.x1, batch.x2 = batch.images[keep], batch.x[keep], batch.x1[keep], batch.x2[keep]
        images = torch.from_numpy(batch.images).to(self.device)
        encode = self.tower.encode
        parts: dict = {}
        if o.kind == "paraclip":
            x, x1, x2 = encode(batch.x), encode(batch.x1), encode(batch.x2)
            loss, parts = paraclip_loss(images, x, x1, x2, temp, l1_text=o.l1_text, use_l1=o.l1, use_l2=o.l2, use_l3=o.l3,
                                        weights=(o.l1_weight, o.l2_weight, o.l3_weight))
            anchor_texts, anchor_vecs = batch.x, x
            if self.anchor_targets is not None:  # a learned expansion: every human caption has a target
                anchor_texts, anchor_vecs = batch.x + batch.x1, torch.cat([x, x1])
        elif o.kind == "laclip":
            rng = np.random.default_rng([t.seed, step, 2])
            texts, owner = [], []
            for i, (a, b, c) in enumerate(zip(batch.x, batch.x1, batch.x2)):
                for j in rng.choice(3, size=o.positives, replace=False):
                    texts.append((a, b, c)[j])
                    owner.append(i)
            vecs = encode(texts)
            loss = multi_positive_loss(images, vecs, torch.tensor(owner, device=self.device), temp)
            anchor_texts, anchor_vecs = texts, vecs
        elif o.kind == "pcclip":
            i1, i2, diff = difference_batch(self.data, step, t.batch_size, t.seed)
            dvec = encode(diff)
            loss = difference_loss(torch.from_numpy(i1).to(self.device), torch.from_numpy(i2).to(self.device), dvec, temp)
            x = encode(batch.x)
            parts["difference"] = float(loss.detach())
            clip = info_nce(images, x, temp)  # keeps the plain image-text alignment while learning differences
            parts["clip"] = float(clip.detach())
            loss = loss + clip
            anchor_texts, anchor_vecs = batch.x, x
        else:
            x = encode(batch.x)
            loss = info_nce(images, x, temp)
            anchor_texts, anchor_vecs = batch.x, x
        if o.anchor_weight > 0:
            if self.anchor_targets is not None:
                ref = self.anchor_targets.of(anchor_texts).to(self.device)
            else:
                with torch.no_grad():
                    ref = self.original.encode(anchor_texts)
            anchor_term = anchor_loss(anchor_vecs, ref)
            parts["anchor"] = float(anchor_term.detach())
            loss = loss + o.anchor_weight * anchor_term
        if o.relation_weight > 0:
            # among the captions of different photos only: pairs of one photo are the paraphrases to pull together
            first = anchor_vecs[: len(batch.x)]  # paraclip's x (the recipe allows the term there only)
            if self.anchor_targets is not None:
                plain = self.anchor_targets.plain_of(batch.x).to(self.device)
            else:
                with torch.no_grad():
                    plain = self.original.encode(batch.x)
            relation = relation_loss(first, plain)
            parts["relation"] = float(relation.detach())
            loss = loss + o.relation_weight * relation
        if o.preserve_weight > 0:
            general = self._sample(self.preserved, o.preserve_per_batch, step, stream=3)
            with torch.no_grad():
                kept = self.original.encode(general)
            preserve = anchor_loss(encode(general), kept)
            parts["preserve"] = float(preserve.detach())
            loss = loss + o.preserve_weight * preserve
        if o.similarity_weight > 0:
            chosen = self._sample(self.similarity, o.similarity_per_batch, step, stream=4)
            scores = torch.tensor([p.score for p in chosen], device=self.device)
            similarity = cosent_loss(encode([p.a for p in chosen]), encode([p.b for p in chosen]), scores)
            parts["similarity"] = float(similarity.detach())
            loss = loss + o.similarity_weight * similarity
        return loss, parts

    # -- loop --------------------------------------------------------------------------------
    def fit(self, max_steps: int | None = None, progress: bool = True) -> list[float]:
        """Train until the recipe's last step (or ``max_steps`` more steps, for tests and time limits)."""
        t = self.recipe.train
        end = self.total_steps if max_steps is None else min(self.total_steps, self.step + max_steps)
        losses = []
        metrics = open(self.run_dir / "metrics.jsonl", "a") if self.rank == 0 else None
        use_amp = t.amp and self.device.type == "cuda"
        self.tower.train()
        bar = tqdm(total=end - self.step, desc=self.recipe.name, disable=not progress or self.rank != 0)
        try:
            while self.step < end:
                started = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                total = 0.0
                parts: dict[str, float] = {}
                for micro in range(t.grad_accum):
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_amp):
                        loss, parts = self.loss(self.step * t.grad_accum + micro)
                    (loss / t.grad_accum).backward()
                    total += float(loss.detach()) / t.grad_accum
                if t.grad_clip:
                    torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], t.grad_clip)
                self.optimizer.step()
                self.scheduler.step()
                self.step += 1
                losses.append(total)
                bar.update(1)
                bar.set_postfix(loss=f"{total:.4f}")
                if metrics and (self.step % t.log_every == 0 or self.step == end):
                    metrics.write(json.dumps({"step": self.step, "loss": total, **parts, "lr": self.scheduler.get_last_lr()[0],
                                              "temperature": float(self.temperature().detach()), "seconds": time.perf_counter() - started}) + "\n")
                    metrics.flush()
                if self.step % t.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
            if metrics:
                metrics.close()
        self.save_checkpoint()
        return losses

    def final_state(self) -> dict[str, torch.Tensor]:
        """The trained parameters after WiSE-FT (the recipe's alpha), as the exported tower has them."""
        alpha = self.recipe.train.wise_ft_alpha
        tuned = self.tower.trainable_state()
        if alpha < 1 and self.original is not None:
            return wise_ft(self.original.state_dict(), tuned, alpha)
        return tuned

    def export(self) -> Path:
        """Apply WiSE-FT and write the bundle (rank 0)."""
        out = self.run_dir / "bundle"
        if self.rank != 0:
            return out
        self.tower.load_state_dict(self.final_state(), strict=False)
        self.tower.eval().cpu()
        if out.exists():
            shutil.rmtree(out)
        self.tower.export(out, name=self.recipe.name, version=self.recipe.version,
                          source={"exporter": "paraseek train", "recipe": self.recipe.model_dump(mode="json"), "steps": self.step})
        _maybe_tensorrt(out)
        return out


def _maybe_tensorrt(bundle: Path) -> None:
    """Where TensorRT's trtexec exists, build an engine for the text tower beside the ONNX file."""
    trtexec = shutil.which("trtexec")
    if trtexec is None:
        return
    m = read_manifest(bundle)
    shapes = lambda b, n: ",".join(f"{name}:{b}x{n}" for name in m.text.input_names)  # noqa: E731
    result = subprocess.run([trtexec, f"--onnx={bundle / m.text.file}", f"--saveEngine={bundle / 'text.plan'}",
                             f"--minShapes={shapes(1, 2)}", f"--optShapes={shapes(32, 32)}",
                             f"--maxShapes={shapes(256, m.max_tokens)}"], capture_output=True, text=True)
    if result.returncode != 0:
        log.warning("TensorRT engine not built: %s", result.stderr[-500:])


def train(recipe: Recipe, run_dir: Path | None = None, max_steps: int | None = None, progress: bool = True) -> RunResult:
    trainer = Trainer(recipe, run_dir)
    losses = trainer.fit(max_steps=max_steps, progress=progress)
    bundle = trainer.export() if trainer.step >= trainer.total_steps else trainer.run_dir / "bundle"
    if trainer.distributed:
        torch.distributed.destroy_process_group()
    return RunResult(trainer.run_dir, bundle, trainer.step, losses[0] if losses else float("nan"),
                     losses[-1] if losses else float("nan"))
