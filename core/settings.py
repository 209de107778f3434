"""The one settings object: every ``PARASEEK_*`` environment variable is declared here and read here.

The service, the CLI, training and the load tests all take a ``Settings`` (pydantic-settings), so a
variable means the same thing everywhere, e.g. ``PARASEEK_HOME``, ``PARASEEK_BUNDLE``,
``PARASEEK_REDIS_URL``, ``PARASEEK_PPDB_PATH``, ``PARASEEK_LLM_BASE_URL``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# tokens shipped in examples (deploy/k8s's Secret) or guessed first: an admin API behind one is open to anyone
PLACEHOLDER_TOKENS = frozenset({"change-me", "changeme", "change_me", "replace-me", "secret", "password", "admin", "token"})


def _default_home() -> Path:
    return Path.home() / ".cache" / "paraseek"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PARASEEK_", env_file=None, extra="ignore")

    home: Path = Field(default_factory=_default_home, description="where the embedded default (starter bundles, demo "
                       "snapshot, caption bank) and caches live (default: ~/.cache/paraseek)")
    bundle: Path | None = Field(None, description="the model bundle served (default: the embedded default's starter under "
                                "PARASEEK_HOME)")
    snapshot: Path | None = Field(None, description="the snapshot root served (default: the embedded demo gallery under "
                                  "PARASEEK_HOME)")
    starter: Literal["robust", "plain"] = Field(
        "robust", description="which starter the embedded default serves: the robust text tower or plain MiniLM")

    # encoder and index runtime
    precision: str = Field(
        "auto", pattern="^(auto|fp32|fp16|int8)$", description="the text tower served. auto, on CPU: the int8 tower where "
        "the bundle's manifest shows it agrees with fp32 (mean cosine >= 0.99) and loses at most 0.5 point of AO@10 and "
        "T2I R@10 (measured at export); on a GPU (CUDA or TensorRT provider): the fp16 tower where its cosine to fp32 "
        "is >= 0.999 everywhere; else fp32")
    providers: str | None = Field(
        None, pattern=r"^[A-Za-z]+( *, *[A-Za-z]+)*$", description="onnxruntime execution providers in order, comma "
        "separated: cuda, tensorrt, cpu or onnxruntime's full names (default: TensorRT where installed, CUDA, CPU, as "
        "onnxruntime offers them); `cpu` keeps a GPU host's encoder, and its searches, on its CPU cores")
    search_device: Literal["auto", "cpu"] = Field(
        "auto", description="where a FAISS snapshot is searched: auto, on a GPU where one is usable (faiss' GPUs, or for a "
        "flat index onnxruntime's CUDA provider where faiss has no kernels for the card), else the CPU; cpu, always the CPU")
    encoder_threads: int | None = Field(None, ge=1, description="intra-op threads per call (default: cores / workers)")
    encoder_workers: int | None = Field(None, ge=1, le=64, description="encoder calls at once (default: 2 on 2+ cores)")
    encoder_spin: bool = Field(False, description="let onnxruntime threads spin between calls (batch jobs: on)")
    encoder_solo: bool = Field(True, description="the encoder call of the only request in flight (up to 4 texts) "
                               "uses every core (a second session of the text tower, CPU only): lower latency at low load")
    alone_on_event_loop_ms: float = Field(
        25, ge=0, description="the only request in flight runs its encoder call and search on the event loop's thread, "
        "without two thread hand-offs (robust starter int8, 100K flat, 2 cores: ~0.35 ms less a request), while such "
        "requests lately took at most this many ms: a request arriving meanwhile waits that long to be read, as it would "
        "for the cores that call holds; 0: always on the index's thread")
    faiss_threads: int | None = Field(1, ge=1, description="threads of a one-row search while other requests are in flight")
    faiss_batch_threads: int | None = Field(
        None, ge=1, description="threads of merged searches of 2+ rows and of a lone request's search, the int8 scan copy's "
        "included (default: every core)")
    flat_scan_copy: Literal["int8", "fp16", "off"] = Field(
        "int8", description="flat snapshots searched on the CPU: searches scan a quantized copy of the vectors and "
        "rescore its candidates from the fp32 vectors (the same results). int8: single queries and merged batches (up to "
        "8 calls' worth), by onnxruntime's integer matrix product (the copy and its packed form: half the vectors' bytes); "
        "fp16: searches of 1-3 queries (half their bytes); off: every search scans the fp32 vectors")
    index_memory_map: bool = Field(True, description="IVF and flat snapshots: search the index file's lists (IVF) or "
                                   "vectors (flat) through a read-only memory map (page cache, shared by the replicas on a "
                                   "host) instead of copying them into each process")
    snapshot_verify: Literal["changed", "always"] = Field(
        "changed", description="at load, hash only the snapshot files changed since they were last verified (size, "
        "inode, times), or always every file (a 10M x 384 snapshot: ~30 s)")
    snapshot_poll_s: float = Field(0, ge=0, description="> 0: reload when the current version changes (the snapshot "
                                   "root's `current`, or the Milvus alias): replicas pick up another replica's reindex")

    index_backend: Literal["faiss", "milvus"] = Field(
        "faiss", description="faiss: snapshots in a folder (the embedded default); milvus: one collection per version")
    milvus_uri: str | None = Field(None, description="a .db path (Milvus Lite, in-process) or http(s)://host:19530 "
                                   "(default: Milvus Lite at HOME/milvus/paraseek.db)")
    milvus_token: SecretStr | None = Field(None, description="user:password or an API key")
    milvus_collection: str = Field("paraseek", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,120}$",
                                   description="collection prefix: versions are PREFIX_v0001_..., the serving alias PREFIX")
    milvus_index_type: str | None = Field(None, pattern=r"^[A-Z][A-Z0-9_]{1,31}$", description="a Milvus index type "
                                          "(e.g. DISKANN, IVF_SQ8) instead of the one mapped from the build's type")
    milvus_index_params: str | None = Field(None, description="JSON build params of PARASEEK_MILVUS_INDEX_TYPE")
    milvus_search_params: str | None = Field(None, description="JSON search params (e.g. {\"nprobe\": 32}); default: "
                                             "those of the build's index spec")
    milvus_timeout_s: float = Field(10.0, gt=0, description="per Milvus call; past it the request is answered 503")
    milvus_index_timeout_s: float = Field(3600.0, gt=0, description="how long a build waits for a server to index a "
                                          "new version before it fails (the version is published only once indexed)")

    batching: bool = Field(True, description="micro-batch concurrent requests' texts into one encoder call")
    max_batch_size: int | None = Field(None, ge=1, le=1024, description="texts per encoder call (default: 16 on CPU, 64 on GPU)")
    encoder_sub_batch: int | None = Field(
        None, ge=1, le=1024, description="texts per model run within an encoder call, the call's texts sorted by token "
        "count so each run pads little (default: 3 on CPU, the whole call in one run on a GPU)")
    max_wait_ms: float = Field(0.0, ge=0, le=1000, description="continuous batching sends a batch as soon as the encoder "
                               "is free; this adds a wait for company")
    max_company_wait_ms: float = Field(
        2.0, ge=0, le=1000, description="while another encoder call runs, how long a batch waits for the requests of the "
        "current load not yet in hand (0: never); at low load nothing waits")
    max_index_batch_size: int = Field(256, ge=1, le=4096, description="query rows per merged index search")
    max_index_wait_ms: float = Field(
        100.0, ge=0, le=1000, description="longest an index search waits for requests being encoded (0: never)")

    # back-pressure: what the service takes on at once, and how long a request may take
    max_in_flight: int = Field(32, ge=1, description="requests answered at once (search, image, similar, embeddings); "
                               "one more is refused at once with 503 and Retry-After instead of queueing")
    request_timeout_s: float = Field(30.0, gt=0, description="a request unanswered after this is given up: 503 with Retry-After")
    max_queued_batches: int = Field(1024, ge=1, description="items waiting in each batcher's queue; past it: 503")
    paraphrase_workers: int = Field(4, ge=1, description="threads of each paraphrase source (an LLM endpoint's calls "
                                    "wait on these), so a slow source holds neither the shared pool nor another source")
    freeze_heap: bool = Field(True, description="at start and after each swap, collect once and move the whole process's "
                              "heap out of the cyclic collector's reach (gc.freeze), so full collections stop pausing "
                              "requests; off where the service shares its process with other work (an application "
                              "embedding it, a test session): there that collection walks the other work's heap too "
                              "(0.64 s a start in a test process holding torch)")

    redis_url: str | None = Field(None, description="the cache: Redis at this URL (shared by replicas), else an "
                                  "in-process LRU")
    redis_timeout_s: float = Field(0.25, gt=0, description="per Redis command")
    redis_connect_timeout_s: float = Field(0.25, gt=0, description="per new Redis connection")
    redis_retry_after_s: float = Field(5.0, ge=0, description="after the breaker opens, probe Redis again this often")
    redis_failures_to_open: int = Field(3, ge=1, description="consecutive timeouts before the cache is skipped")
    embedding_ttl_s: int = Field(7 * 24 * 3600, ge=1, description="how long a cached query embedding lives")
    result_ttl_s: int = Field(600, ge=1, description="how long a cached result list lives")
    lru_size: int = Field(10_000, ge=0, description="entries of the in-process cache (without Redis)")

    # request limits
    max_query_chars: int = Field(1000, ge=1, description="characters of a query text")
    max_body_bytes: int = Field(256 * 1024, ge=1024, description="body limit of the text routes")
    max_batch_queries: int = Field(64, ge=1, description="requests in one /v1/search/batch call")
    max_upload_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="body limit of image queries (base64 included)")
    max_image_pixels: int = Field(40_000_000, ge=1, description="image queries with more pixels are refused before decoding")
    max_embedding_inputs: int = Field(256, ge=1, description="texts per /v1/embeddings call")
    consistency_threshold: float = Field(0.5, ge=0, le=1, description="mean AO@k at or above -> stable")

    admin_token: SecretStr | None = Field(None, description="bearer token of the admin routes (reindex, reload, "
                                          "versions); unset: they answer 404")
    @field_validator("admin_token")
    @classmethod
    def _not_a_placeholder(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and value.get_secret_value().strip().lower() in PLACEHOLDER_TOKENS:
            raise ValueError("is a placeholder, not a secret: generate one (python -c 'import secrets; "
                             "print(secrets.token_hex(16))'), or leave it unset to disable the admin routes")
        return value

    jobs_dir: Path | None = Field(None, description="where admin job records are kept (default: HOME/jobs); one folder per process: "
                                     "a starting service reports the unfinished records it finds there as interrupted")
    snapshot_keep_versions: int = Field(5, ge=2, description="published versions kept after a reindex (current and "
                                        "the one before it are always kept)")
    reindex_root: Path | None = Field(None, description="where admin reindex and reload requests may read image "
                                      "sources and bundles (unset: sources only under the serving snapshot's own "
                                      "source folder, bundles only beside the serving bundle)")

    default_expansion: str | None = Field(
        None, description="query expansion applied when a request names none (JSON of the request's `expansion`, e.g. "
        '{"method": "bank", "n": 30}; the embedded default has its own); a request opts out with {"method": "none"}')
    caption_bank: Path | None = Field(None, description="caption bank folder (default: the bundle's bank under HOME)")
    hub_tables: Path | None = Field(None, description="where each index version's hub table is kept (default: HOME/hub-tables); "
                                    "on the volume replicas share, every replica reads the table a reindex or "
                                    "`paraseek index build` wrote instead of computing its own")
    first_answer_bundle: Path | None = Field(
        None, description="a second bundle of the served image space whose first answer a request's `lead_margin` puts on "
        "top where that tower is sure of it (its first score above its second by more than the margin): a plainer, more "
        "precise tower over a stable ranking; `/v1/embeddings` also embeds with it by name (default for the embedded "
        "robust starter: the plain starter, whose sentence embeddings score higher on STS)")

    # paraphrase / expansion sources (service, CLI evaluation and training data generation alike)
    ppdb_path: Path | None = Field(None, description="a PPDB lexical file for the `ppdb` paraphrase source")
    llm_base_url: str | None = Field(None, description="an OpenAI-compatible endpoint for the `llm` paraphrase source")
    llm_model: str | None = Field(None, description="the model the `llm` source asks")
    llm_api_key: SecretStr | None = Field(None, description="the `llm` endpoint's API key")
    llm_timeout_s: float = Field(20.0, gt=0, description="per `llm` endpoint call")
    llm_retries: int = Field(2, ge=0, description="retries of a failed `llm` endpoint call")
    llm_deadline_s: float = Field(15.0, gt=0, description="all the endpoint calls for one text's paraphrases end by then "
                                  "(retries included): what came back by then is used")
    llm_cache: Path | None = Field(None, description="on-disk cache of LLM answers (default: HOME/llm-cache.jsonl)")
    llm_cache_entries: int = Field(100_000, ge=1, description="answers the LLM cache keeps (the least recently used go, "
                                   "in memory and, when the file doubles, on disk)")

    # logs and load tests
    log_json: bool = Field(True, description="log one JSON object a line (false: plain text)")
    load_queries: Path | None = Field(None, description="TSV (image_id, caption) the Locust users draw queries from")

    @property
    def embedded_default(self) -> bool:
        """Neither a bundle nor a snapshot was configured: serve the starter over the demo gallery."""
        return self.bundle is None and self.snapshot is None

    @property
    def plain_starter_bundle_dir(self) -> Path:
        """The offline starter as MiniLM and EfficientNet-Lite0 come (``paraseek models build-starter``)."""
        return self.home / "bundles" / "starter"

    @property
    def robust_starter_bundle_dir(self) -> Path:
        """The starter with the robust text tower (``paraseek models build-starter --robust``)."""
        return self.home / "bundles" / "starter-robust"

    @property
    def starter_bundle_dir(self) -> Path:
        """The starter the embedded default serves (``PARASEEK_STARTER``)."""
        return self.robust_starter_bundle_dir if self.starter == "robust" else self.plain_starter_bundle_dir

    @property
    def bundle_dir(self) -> Path:
        return self.bundle or self.starter_bundle_dir

    @property
    def snapshot_root(self) -> Path:
        return self.snapshot or self.home / "snapshots" / "demo"

    @property
    def milvus_location(self) -> str:
        return self.milvus_uri or str(self.home / "milvus" / "paraseek.db")

    @property
    def jobs_path(self) -> Path:
        return self.jobs_dir or self.home / "jobs"

    @property
    def llm_cache_path(self) -> Path:
        return self.llm_cache or self.home / "llm-cache.jsonl"

    @property
    def hub_tables_dir(self) -> Path:
        return self.hub_tables or self.home / "hub-tables"
