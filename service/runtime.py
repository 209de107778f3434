"""What the service serves with: the encoder and snapshot pair (``Active``) and how every one of them
is loaded from the settings (startup, reload, reindex, a new current version)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from paraseek.core.bundle import BundleError
from paraseek.core.encoder import GPU_PROVIDERS, Encoder, configured_providers
from paraseek.core.settings import Settings
from paraseek.index.store import SearchableSnapshot, SnapshotStore
from paraseek.index.versions import SnapshotError


@dataclass(frozen=True)
class Active:
    """What a request searches with. Replaced as one object, so a request never sees an encoder
    from one reindex and a snapshot from another."""

    encoder: Encoder
    snapshot: SearchableSnapshot
    # PARASEEK_FIRST_ANSWER_BUNDLE: a second text tower of the same image space (a request's ``lead_margin``)
    first_answer: Encoder | None = None

    @property
    def model_id(self) -> str:
        return encoder_id(self.encoder)

    @property
    def first_answer_id(self) -> str | None:
        return encoder_id(self.first_answer) if self.first_answer is not None else None

    @property
    def text_towers(self) -> list[Encoder]:
        """Every text tower loaded here, the served one first: what ``/v1/models`` lists and
        ``/v1/embeddings`` embeds with by name (the first-answer tower keeps its own sentence embeddings:
        the plain starter's beside the robust ranking of the embedded default)."""
        return [self.encoder] + ([self.first_answer] if self.first_answer is not None else [])

    def text_tower(self, model: str) -> Encoder | None:
        """The text tower a client names by ``name`` or ``name:version``; the served one wins a shared name."""
        return next((t for t in self.text_towers if model in (t.name, f"{t.name}:{t.version}")), None)


def encoder_id(e: Encoder) -> str:
    """What an encoder's vectors are keyed by in the caches: bundle, version, precision and the digest
    of its content (a retrained bundle exported under the same name and version is another model)."""
    return f"{e.name}:{e.version}:{e.precision}:{e.digest}"


def encoder_workers(settings: Settings) -> int:
    """Encoder calls run at once: PARASEEK_ENCODER_WORKERS, default 2 where there are 2+ cores."""
    return settings.encoder_workers or min(2, os.cpu_count() or 1)


def default_text_batch(encoder: Encoder) -> int:
    """Texts per encoder call unless PARASEEK_MAX_BATCH_SIZE says otherwise: 16 on CPU, where a call runs
    them in runs of similar length (``text_sub_batch``); a GPU wants large calls."""
    return 16 if encoder.providers == ["CPUExecutionProvider"] else 64


def text_sub_batch(encoder: Encoder, settings: Settings) -> int | None:
    """Texts per model run within one encoder call (None: the whole call in one run). A run pads every
    text to its longest, and on CPU padding costs as much as text: COCO captions numbered as the
    benchmarks send them hold 14-29 tokens, and runs of 8 in arrival order compute about 1.2x their
    tokens. So a CPU call sorts its texts by token count and runs them 3 at a time (MiniLM int8, one
    thread: 289-301 texts/s in runs of 8 as they came, 298-328 in calls of 16 sorted into runs of 4;
    runs of 2 or 3 did 4-5 % more than 4 in calls of 4 to 16, 3 the most in calls of 16).
    An int8 tower's vectors also depend less on a text's company then (cosine to the text encoded alone
    >= 0.9962 against 0.9947). PARASEEK_ENCODER_SUB_BATCH; default 3 on CPU, the whole call on a GPU."""
    if settings.encoder_sub_batch:
        return settings.encoder_sub_batch
    return 3 if encoder.providers == ["CPUExecutionProvider"] else None


def load_encoder(bundle, settings: Settings, precision: str | None = None, load_image: bool = True) -> Encoder:
    """Every encoder the service runs (startup, reload, reindex) is built here from the settings. Its
    intra-op threads default to the cores shared out among the encoder workers (2 cores, 2 workers:
    one each; two single-threaded calls side by side encode ~1.4x more than one call on two threads).
    On CPU, fewer threads than cores also get a second text session on every core (PARASEEK_ENCODER_SOLO)
    for calls that run alone (see ``LoneCallGate``)."""
    cores = os.cpu_count() or 1
    threads = settings.encoder_threads or max(1, cores // encoder_workers(settings))
    providers = configured_providers(settings.providers)
    solo = settings.encoder_solo and threads < cores and providers == ["CPUExecutionProvider"]
    return Encoder(bundle, precision=precision or settings.precision, providers=providers, threads=threads,
                   solo_threads=cores if solo else None, load_image=load_image,
                   spin=settings.encoder_spin, memory_arena=False)


def search_gpu(settings: Settings) -> bool | None:
    """``use_gpu`` of the snapshots the service loads: False where the settings keep the search on the CPU
    (PARASEEK_SEARCH_DEVICE=cpu, or PARASEEK_PROVIDERS naming no GPU provider), else None: a GPU where usable."""
    cpu_only = settings.search_device == "cpu" or (
        bool(settings.providers) and not GPU_PROVIDERS.intersection(configured_providers(settings.providers)))
    return False if cpu_only else None


def load_snapshot(store: SnapshotStore, image_space: str, settings: Settings, version: str | None = None) -> SearchableSnapshot:
    """A version of the configured index backend (default: the current one), refused unless built in the
    served encoder's ``image_space``, ready to serve as a server would."""
    snapshot = store.load(version, image_space=image_space, threads=settings.faiss_threads,
                          rehash=settings.snapshot_verify == "always", use_gpu=search_gpu(settings))
    # the int8 copy's onnxruntime session searches merged rows and lone requests: the cores of merged searches
    snapshot.prepare_serving(scan_copy=None if settings.flat_scan_copy == "off" else settings.flat_scan_copy,
                             threads=settings.faiss_batch_threads)
    return snapshot


def load_active(bundle, store: SnapshotStore, settings: Settings, precision: str | None = None) -> Active:
    encoder = load_encoder(bundle, settings, precision)
    return Active(encoder, load_snapshot(store, encoder.image_space, settings), load_first_answer(settings, encoder))


def load_first_answer(settings: Settings, encoder: Encoder) -> Encoder | None:
    """The first-answer tower (PARASEEK_FIRST_ANSWER_BUNDLE), if one is configured."""
    if settings.first_answer_bundle is None:
        return None
    return load_first_answer_bundle(settings.first_answer_bundle, settings, encoder)


def load_first_answer_bundle(bundle, settings: Settings, encoder: Encoder) -> Encoder:
    """A first-answer tower, text only, refused unless it embeds into the served encoder's image space (its
    first answers are searched in the same index)."""
    first = load_encoder(bundle, settings, load_image=False)
    if first.image_space != encoder.image_space:
        raise BundleError(f"first-answer bundle {bundle} embeds into image space {first.image_space!r}, not the "
                          f"served bundle's {encoder.image_space!r}")
    return first


def first_answer_for(previous: Active | None, encoder: Encoder) -> Encoder | None:
    """The first-answer tower a new encoder keeps from what served before it: the same one while the image
    space stays (a reindex with a bundle of another space serves without it until the next start)."""
    first = previous.first_answer if previous is not None else None
    return first if first is not None and first.image_space == encoder.image_space else None


def validate_snapshot(active: Active) -> None:
    """A new snapshot must load and answer a query before it replaces the serving one."""
    vec = active.encoder.encode_text(["a photo"])
    _, ids = active.snapshot.search_ids(vec, 1)
    if len(active.snapshot) and ids[0][0] < 0:
        raise SnapshotError("the new snapshot returned no result for a test query")
