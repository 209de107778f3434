"""Training data: images embedded once by the frozen image tower (cached as plain arrays), their caption sets
(COCO's ~5 captions per photo are human paraphrases), and generated paraphrases x', x''.

Batches are a pure function of (seed, step), so a resumed run sees exactly the batches it would have
seen without the interruption.
"""

from __future__ import annotations

import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from paraseek.core.errors import UserError
from paraseek.core.encoder import Encoder
from paraseek.core.settings import Settings
from paraseek.evaluation.data import held_out_texts, read_caption_groups, without_held_out
from paraseek.index.builder import embed_records
from paraseek.index.image_sources import open_source
from paraseek.paraphrase import ParaphraseSource
from paraseek.paraphrase.factory import make_source
from paraseek.training.recipe import DataSpec, ParaphraseSpec

log = logging.getLogger(__name__)


@dataclass
class TrainingData:
    image_ids: np.ndarray
    vectors: np.ndarray  # (N, D) frozen image embeddings
    captions: list[list[str]]  # per image
    rewrites: dict[str, tuple[str | None, str]]  # caption -> (generated x1 or None, x2 of the caption)
    differences: list[tuple[int, int, str]] | None = None  # PC-CLIP (row1, row2, text)
    text_groups: list[list[str]] | None = None  # paraphrase sets without images


@dataclass
class Batch:
    images: np.ndarray
    x: list[str]
    x1: list[str]
    x2: list[str]
    rows: np.ndarray


@dataclass
class ImageEmbeddings:
    ids: np.ndarray  # (N,) image ids
    vectors: np.ndarray  # (N, D) frozen image-tower embeddings
    captions: list[list[str]]  # per image


PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def resolve_data_path(path: str) -> Path:
    """A recipe's data path as given, or else relative to the installed packages, so built-in recipes
    name data the package ships (``paraphrase/data/...``, ``training/assets/...``)."""
    given = Path(path).expanduser()
    if given.exists() or given.is_absolute():
        return given
    shipped = PACKAGE_ROOT / path
    return shipped if shipped.exists() else given


IMAGE_EMBEDDING_KEYS = frozenset({"ids", "vectors", "captions", "image_space"})


def save_image_embeddings(path: Path, embeddings: ImageEmbeddings, image_space: str, *, fp16: bool = False) -> None:
    """The one file format for image embeddings made elsewhere (``data.image_embeddings``) and for a run's
    cache: a .npz of ``ids``, ``vectors``, ``captions`` (a JSON string, so it loads without pickle) and
    ``image_space``. Written beside and renamed, so an interrupted write never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")  # np.savez appends .npz to a name without it
    np.savez(tmp, ids=np.asarray(embeddings.ids, np.int64),
             vectors=np.asarray(embeddings.vectors, np.float16 if fp16 else np.float32),
             captions=np.array(json.dumps(embeddings.captions)), image_space=np.array(image_space))
    tmp.replace(path)


def read_image_embeddings(path: Path) -> tuple[ImageEmbeddings, str]:
    """-> (embeddings with float32 vectors, the image space they were made in)."""
    if not path.is_file():
        raise UserError(f"data.image_embeddings: {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            missing = IMAGE_EMBEDDING_KEYS - set(arrays.files)
            if missing:
                raise UserError(f"data.image_embeddings: {path} lacks {', '.join(sorted(missing))}")
            captions = json.loads(str(arrays["captions"]))
            ids, vectors, space = arrays["ids"], arrays["vectors"].astype(np.float32), str(arrays["image_space"])
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:  # not a .npz, or a torn one
        raise UserError(f"data.image_embeddings: {path} is not an image-embeddings .npz ({err})") from err
    if len(captions) != len(ids) or len(vectors) != len(ids):
        raise UserError(f"data.image_embeddings: {path} has {len(ids)} ids, {len(vectors)} vectors, {len(captions)} caption lists")
    return ImageEmbeddings(ids, vectors, captions), space


def load_image_embeddings(path: Path, image_space: str) -> ImageEmbeddings:
    """Image embeddings computed elsewhere (``paraseek models embed-images``) by the same frozen image
    tower: refused when they were made in another image space."""
    embeddings, space = read_image_embeddings(path)
    if space != image_space:
        raise UserError(f"data.image_embeddings: {path} is in image space {space}, the frozen image tower's is {image_space}")
    return embeddings


def embed_photos(captions: Path, images: str | Path | None, image_encoder: Encoder, limit: int | None = None,
                 progress: bool = True) -> tuple[ImageEmbeddings, list[dict]]:
    """The photos of a captions file (any source ``paraseek index build`` reads) embedded by the frozen
    image tower -> (embeddings of the photos that have captions, the first ``limit`` of them where given;
    [{path, error}] of those skipped: unreadable, or without a caption the training terms could use)."""
    source = open_source(captions, images)
    records = [r for r in source.records if r.captions][:limit]
    skipped = [{"path": r.path, "error": "no captions"} for r in source.records if not r.captions]
    if not records:
        raise UserError(f"{captions}: no photo with captions to embed ({len(source.records)} photos, none captioned)")
    vectors, kept, _, unreadable = embed_records(image_encoder, source.root, records, progress=progress)
    ids = np.array([r.id for r in kept], np.int64)
    return ImageEmbeddings(ids, vectors.astype(np.float32), [r.captions for r in kept]), skipped + unreadable


def without_texts(embeddings: ImageEmbeddings, texts: set[str]) -> tuple[ImageEmbeddings, int]:
    """Drop the captions that are evaluation texts (``texts`` as ``evaluation.data.held_out_texts`` gives them),
    so training never sees a text it is measured on, and the photos left with none -> (what remains, how
    many captions were dropped)."""
    keep, captions, dropped = [], [], 0
    for row, caps in enumerate(embeddings.captions):
        left = without_held_out(caps, texts)
        dropped += len(caps) - len(left)
        if left:
            keep.append(row)
            captions.append(left)
    return ImageEmbeddings(embeddings.ids[keep], embeddings.vectors[keep], captions), dropped


def embed_images(data: DataSpec, image_encoder: Encoder, run_dir: Path) -> ImageEmbeddings:
    """Image embeddings by the frozen tower, computed once per run directory and kept as arrays
    (``image-embeddings.npz``, the format of ``data.image_embeddings``): training needs the vectors, not a
    search index. A cache of another image space (the recipe's tower changed) is embedded again."""
    if data.image_embeddings:
        return load_image_embeddings(resolve_data_path(data.image_embeddings), image_encoder.image_space)
    assert data.captions is not None  # the recipe schema asks for one of the two
    # a trial on the first N photos of a large set embeds those only, in a cache of its own
    cache = run_dir / (f"image-embeddings-first{data.max_images}.npz" if data.max_images else "image-embeddings.npz")
    if cache.is_file():
        try:
            cached, space = read_image_embeddings(cache)
            if space == image_encoder.image_space:
                return cached
        except UserError as err:
            log.warning("image-embedding cache unreadable, embedding again: %s", err)
    embeddings, skipped = embed_photos(resolve_data_path(data.captions), data.images, image_encoder, data.max_images)
    for item in skipped:
        log.warning("training image skipped: %s", item)
    save_image_embeddings(cache, embeddings, image_encoder.image_space)
    return embeddings


def paraphrase_source(method: str, spec: ParaphraseSpec, second_step: bool, settings: Settings) -> ParaphraseSource:
    """x' (first step) or x'' (second step: ParaCLIP's "avoiding existing words" prompt for llm)."""
    if method == "llm" and second_step:
        method = "llm-avoid-words"
    return make_source(method, settings, ppdb_path=spec.ppdb, usual_only=False)


def generate_paraphrases(captions: list[str], spec: ParaphraseSpec, out: Path,
                         settings: Settings | None = None) -> dict[str, tuple[str | None, str]]:
    """ParaCLIP's two-step generation: x' (unless human paraphrases are used) and x'' of every caption,
    appended to a JSONL file line by line; a rerun resumes after the last line written."""
    done: dict[str, tuple[str | None, str]] = {}
    if out.is_file():
        with open(out) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    done[row["caption"]] = (row.get("x1"), row["x2"])
                except (json.JSONDecodeError, KeyError):
                    continue  # torn last line of an interrupted run
    todo = [c for c in dict.fromkeys(captions) if c not in done]
    if not todo:
        return done
    settings = settings or Settings()
    first = None if spec.x1 == "human" else paraphrase_source(spec.x1, spec, False, settings)
    second = None if spec.x2 == "human" else paraphrase_source(spec.x2, spec, True, settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for caption in tqdm(todo, desc="paraphrases", unit="caption"):
            x1 = (first.paraphrases(caption, 1) or [caption])[0] if first else None
            base = x1 or caption
            x2 = (second.paraphrases(base, 1) or [base])[0] if second else base
            done[caption] = (x1, x2)
            f.write(json.dumps({"caption": caption, "x1": x1, "x2": x2}) + "\n")
            f.flush()
    return done


def load_training_data(data: DataSpec, image_encoder: Encoder, run_dir: Path) -> TrainingData:
    held_out = held_out_texts([resolve_data_path(p) for p in data.hold_out])  # read first: a bad file fails fast
    images = embed_images(data, image_encoder, run_dir)
    if held_out:
        images, dropped = without_texts(images, held_out)
        log.info("data.hold_out: %d captions of the photos left out", dropped)
    ids, vectors, captions = images.ids, np.asarray(images.vectors, np.float32), images.captions
    if data.max_images:
        ids, vectors, captions = ids[: data.max_images], vectors[: data.max_images], captions[: data.max_images]
    keep = [i for i, c in enumerate(captions) if len(c) >= 2]
    if len(keep) < 2:
        raise UserError(f"data.captions: need at least 2 images with 2+ captions, found {len(keep)}")
    ids, vectors, captions = ids[keep], vectors[keep], [captions[i] for i in keep]
    text_groups = None
    if data.text_captions:
        text_groups = read_caption_groups(resolve_data_path(data.text_captions))
        if held_out:
            left = [without_held_out(group, held_out) for group in text_groups]
            log.info("data.hold_out: %d captions left out of data.text_captions",
                     sum(map(len, text_groups)) - sum(map(len, left)))
            text_groups = [group for group in left if len(group) >= 2]
    dataset = Path(data.paraphrases.dataset) if data.paraphrases.dataset else run_dir / "paraphrases.jsonl"
    every_caption = [c for group in captions + (text_groups or []) for c in group]
    rewrites = generate_paraphrases(every_caption, data.paraphrases, dataset)
    differences = None
    if data.differences:
        position = {int(i): r for r, i in enumerate(ids)}
        differences = []
        with open(data.differences) as f:
            for line in f:
                row = json.loads(line)
                if int(row["image1"]) in position and int(row["image2"]) in position:
                    differences.append((position[int(row["image1"])], position[int(row["image2"])], row["text"]))
    return TrainingData(ids, vectors, captions, rewrites, differences, text_groups)


def sample_batch(data: TrainingData, step: int, batch_size: int, seed: int, x1_human: bool,
                 text_per_batch: int = 0, x1_choices: dict[str, list[str]] | None = None) -> Batch:
    """``batch_size`` photos with a caption, x' and x'' each; then ``text_per_batch`` text-only sets
    (their rows come after the photos' rows in x, x1, x2). ``x1_choices``: the human x' a caption may
    take (``close_captions``), instead of any other caption of its photo."""
    rng = np.random.default_rng([seed, step])
    rows = rng.choice(len(data.captions), size=min(batch_size, len(data.captions)), replace=False)
    groups = [data.captions[r] for r in rows]
    if text_per_batch and data.text_groups:
        pick = rng.choice(len(data.text_groups), size=min(text_per_batch, len(data.text_groups)), replace=False)
        groups += [data.text_groups[i] for i in pick]
    x, x1, x2 = [], [], []
    for group in groups:
        a, b = rng.choice(len(group), size=2, replace=False)
        caption = group[a]
        if x1_human:
            para = group[b]  # another human caption of the same photo
            choices = x1_choices.get(caption) if x1_choices is not None else None
            if choices:
                para = choices[int(rng.integers(len(choices)))]
            second = data.rewrites[para][1]
        else:
            para, second = data.rewrites[caption]
        x.append(caption)
        x1.append(para)
        x2.append(second)
    return Batch(images=data.vectors[rows], x=x, x1=x1, x2=x2, rows=rows)


def close_captions(groups: list[list[str]], vectors: dict[str, np.ndarray], min_cos: float) -> dict[str, list[str]]:
    """For each caption, the other captions of its photo whose cosine to it is at least ``min_cos``
    (``vectors``: unit embeddings by text); the nearest other one where none is."""
    out: dict[str, list[str]] = {}
    for group in groups:
        unique = list(dict.fromkeys(group))
        if len(unique) < 2:
            continue
        rows = np.stack([vectors[t] for t in unique])
        cos = rows @ rows.T
        np.fill_diagonal(cos, -np.inf)
        for i, caption in enumerate(unique):
            if caption in out:  # the same text in two photos' sets: its first set decides
                continue
            close = [unique[j] for j in np.flatnonzero(cos[i] >= min_cos)]
            out[caption] = close or [unique[int(np.argmax(cos[i]))]]
    return out


def difference_batch(data: TrainingData, step: int, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """PC-CLIP pairs: given differences, or pairs of photos with the text "<caption 1>, not <caption 2>"
    (an offline stand-in for generated comparative captions)."""
    rng = np.random.default_rng([seed, step, 1])
    if data.differences:
        pick = rng.choice(len(data.differences), size=min(batch_size, len(data.differences)), replace=False)
        pairs = [data.differences[i] for i in pick]
    else:
        a = rng.choice(len(data.captions), size=min(batch_size, len(data.captions)), replace=False)
        b = (a + 1 + rng.integers(0, len(data.captions) - 1, size=len(a))) % len(data.captions)
        pairs = [(i, j, f"{data.captions[i][0].rstrip('.')}, not {data.captions[j][0].rstrip('.').lower()}")
                 for i, j in zip(a, b)]
    return (data.vectors[[p[0] for p in pairs]], data.vectors[[p[1] for p in pairs]], [p[2] for p in pairs])
