"""The Milvus backend: one collection per snapshot version, the serving version behind an alias.

Layout in Milvus, for collection prefix ``P``::

    P_manifests                 one row per version: its state (building | published) and manifest JSON
    P_v0001_20261122T080000Z    a version: id (primary key), vector, licence_id, caption_text, meta (JSON)
    alias P                     -> the current version's collection (switched with alter_alias: atomic)

A build first records the version as ``building`` (with the writing process), then creates and fills
its collection, checks the count, measures recall, and only then marks it ``published`` and moves the
alias. A build that fails drops its collection; one that is killed leaves a ``building`` row that the
next build or service start removes (``clean_stale``), with its collection. The current version is
never touched by either.

``uri``: a file path ending in ``.db`` runs Milvus Lite in this process (tests, small setups; one
process at a time per file); ``http://host:19530`` talks to a Milvus standalone or distributed server.
pymilvus is imported here only, so FAISS-only installs never need it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from cachetools import LRUCache

from paraseek.core.errors import UserError
from paraseek.index.faiss_index import EXACT_LIMIT, IndexSpec
from paraseek.index.filters import (
    FilterError,
    SearchFilter,
    caption_text,
    licence_id,
    milvus_expression,
    widened_ef,
    widened_nprobe,
)
from paraseek.index.recall import measure_recall_with
from paraseek.index.snapshot import check_image_space
from paraseek.index.store import IndexUnavailable, SearchableSnapshot, SnapshotStore, next_version_name, version_order
from paraseek.index.versions import (
    STALE_BUILD_AFTER_S,
    VERSION_TEXT,
    SnapshotError,
    SnapshotManifest,
    build_is_stale,
    build_owner,
    versions_to_prune,
)

log = logging.getLogger(__name__)

MANIFESTS = "manifests"
VARCHAR_MAX = 65_535  # bytes, Milvus' longest VARCHAR
INSERT_ROWS = 2_000
METADATA_CACHE = 100_000  # metadata rows kept per loaded version (rows of a version never change)
FILTER_CACHE = 256
RETRY_EF, RETRY_EF_MAX = 512, 16_384  # an HNSW search's ef when asking again for the hits a search left out
CONNECT_ATTEMPTS = 3
TRANSIENT = ("too many pings", "goaway", "unavailable", "fail connecting", "connection reset")
# a Milvus server answers reads at "Bounded" staleness unless asked: a version written a moment ago
# would be missing from its manifests and counts (Milvus Lite is strongly consistent anyway). A Strong
# read waits for the server's time tick (200-400 ms a query on an idle 2.3.5 standalone, against 2-4 ms):
# what only grows (a published version's row, which never changes until dropped, and a version's rows)
# is read at the default staleness first, and again Strong only where it is not all there yet
STRONG = {"consistency_level": "Strong"}
BOUNDED = {"consistency_level": "Bounded"}


def _pymilvus():
    try:
        import pymilvus
    except ImportError as exc:  # pragma: no cover - the install command installs it
        raise UserError("the milvus backend needs pymilvus (pip install 'pymilvus[milvus-lite]')") from exc
    return pymilvus


def is_lite(uri: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*://", uri)


def stop_lite(uri: str) -> None:
    """Stop the in-process Milvus Lite server of this database file now. It otherwise stops at exit and
    writes its collections back then, recreating a folder that was removed meanwhile (a temporary one)."""
    if not is_lite(uri):
        return
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)


def redact(uri: str) -> str:
    """The URI without credentials, for messages."""
    if is_lite(uri):
        return uri
    parts = urlsplit(uri)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def native_index(spec: IndexSpec, index_type: str | None = None, params: dict | None = None) -> tuple[str, dict, dict]:
    """(Milvus index type, build params, search params) for an index spec; ``index_type``/``params``
    override the mapping (index types only a Milvus server has, e.g. DISKANN)."""
    if index_type:
        return index_type, dict(params or {}), {}
    if spec.type == "flat":
        return "FLAT", {}, {}
    if spec.type == "ivf_flat":
        return "IVF_FLAT", {"nlist": spec.nlist}, {"nprobe": spec.nprobe}
    if spec.type == "hnsw":
        return "HNSW", {"M": spec.hnsw_m, "efConstruction": spec.ef_construction}, {"ef": spec.ef_search}
    if spec.type == "ivf_pq":
        return "IVF_PQ", {"nlist": spec.nlist, "m": spec.pq_m, "nbits": spec.pq_nbits}, {"nprobe": spec.nprobe}
    raise UserError(f"index type {spec.type!r} has no Milvus counterpart")


def _truncate_utf8(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", errors="ignore")


def _outage_is_unavailable(method):
    """A version call the server did not answer is an outage (IndexUnavailable: 503 from the service's admin
    routes, exit 69 from the CLI), not a bug's traceback."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except self.errors as exc:
            raise IndexUnavailable(f"{self.describe()}: {method.__name__.strip('_').replace('_', ' ')} failed: "
                                   f"{_reason(exc)}") from exc

    return call


class MilvusStore(SnapshotStore):
    backend = "milvus"

    def __init__(self, uri: str, *, token: str | None = None, prefix: str = "paraseek", index_type: str | None = None,
                 index_params: dict | None = None, search_params: dict | None = None, timeout_s: float = 10.0,
                 index_timeout_s: float = 3600.0):
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,120}$", prefix):
            raise UserError(f"Milvus collection prefix {prefix!r}: letters, digits and underscores, not starting with a digit")
        self.uri, self.prefix, self.timeout_s, self.index_timeout_s = uri, prefix, timeout_s, index_timeout_s
        self.index_type, self.index_params, self.search_params = index_type, index_params, search_params
        self.alias = prefix
        self.manifests = f"{prefix}_{MANIFESTS}"
        pymilvus = _pymilvus()
        import grpc  # pymilvus' own transport

        # pymilvus wraps most failures in MilvusException, but lets a gRPC deadline or an unreachable
        # server through as the bare RpcError (seen while a server restarts)
        self.errors: tuple[type[BaseException], ...] = (pymilvus.MilvusException, grpc.RpcError)
        if is_lite(uri):
            Path(uri).parent.mkdir(parents=True, exist_ok=True)
            # Milvus Lite's in-process gRPC server logs a traceback for the optional AllocTimestamp call
            # that pymilvus' query iterator tries first (and then does without)
            logging.getLogger("grpc._server").setLevel(logging.CRITICAL)
        options = {}
        if is_lite(uri):
            # pymilvus pings idle connections every 10 s; the in-process server (gRPC's defaults) counts
            # those as abuse and sends GOAWAY "too many pings", which breaks the shared channel
            options = {"grpc_options": {"grpc.keepalive_time_ms": 300_000, "grpc.keepalive_permit_without_calls": False}}
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                self.client = pymilvus.MilvusClient(uri=uri, token=token or "", timeout=timeout_s, **options)
                self._ensure_manifests()
                break
            except self.errors as exc:
                if attempt + 1 == CONNECT_ATTEMPTS:
                    raise IndexUnavailable(f"Milvus at {redact(uri)} is unavailable: {_reason(exc)}") from exc
                time.sleep(0.5 * (attempt + 1))  # a server that is starting or restarting
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"Milvus at {redact(self.uri)}, collection {self.prefix}"

    def close(self) -> None:
        if is_lite(self.uri):
            # Milvus Lite's in-process server is shared by every client of the file and stops at exit;
            # closing it here would strand the next client of the same file on a dead port
            return
        try:
            self.client.close()
        except self.errors:
            pass

    # -- the manifests collection ----------------------------------------------------------------
    def _ensure_manifests(self) -> None:
        if self.client.has_collection(self.manifests):
            self.client.load_collection(self.manifests)
            return
        from pymilvus import DataType

        schema = self.client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("version", DataType.VARCHAR, max_length=64, is_primary=True)
        schema.add_field("state", DataType.VARCHAR, max_length=16)
        schema.add_field("manifest", DataType.VARCHAR, max_length=VARCHAR_MAX)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=2)  # Milvus requires a vector field
        index = self.client.prepare_index_params()
        index.add_index(field_name="vector", index_type="FLAT", metric_type="L2")
        self.client.create_collection(self.manifests, schema=schema, index_params=index, **STRONG)

    def _rows(self, state: str | None = None) -> list[dict]:
        expr = f'state == "{state}"' if state else 'version != ""'
        return self.client.query(self.manifests, filter=expr, output_fields=["version", "state", "manifest"], **STRONG)

    def _query_until(self, collection: str, expr: str, fields: list[str], enough: Callable[[list[dict]], bool]) -> list[dict]:
        """The rows a Bounded read returns where ``enough`` accepts them, else a Strong read's (see STRONG)."""
        rows = self.client.query(collection, filter=expr, output_fields=fields, **BOUNDED)
        return rows if enough(rows) else self.client.query(collection, filter=expr, output_fields=fields, **STRONG)

    def _put(self, version: str, state: str, body: str) -> None:
        if len(body.encode("utf-8")) > VARCHAR_MAX:
            raise UserError(f"the manifest of {version} is larger than Milvus' {VARCHAR_MAX}-byte text field")
        self.client.upsert(self.manifests, [{"version": version, "state": state, "manifest": body, "vector": [0.0, 0.0]}])

    def collection(self, version: str) -> str:
        return f"{self.prefix}_{version.replace('-', '_')}"

    def location(self, version: str) -> str:
        return self.collection(version)

    # -- versions --------------------------------------------------------------------------------
    @_outage_is_unavailable
    def versions(self) -> list[str]:
        return sorted((r["version"] for r in self._rows("published")), key=version_order)

    def new_version_name(self) -> str:
        # Milvus has no compare-and-set: the name's random suffix keeps two writers' names apart
        return next_version_name(r["version"] for r in self._rows())

    def _alias_exists(self) -> bool:
        return self.alias in (self.client.list_aliases().get("aliases") or [])

    @_outage_is_unavailable
    def current_version(self) -> str | None:
        if not self._alias_exists():
            return None  # nothing published yet
        target = self.client.describe_alias(self.alias).get("collection_name")
        # the alias moves only to a version already published, so a read that lacks its row is stale
        rows = self._query_until(self.manifests, 'state == "published"', ["version"],
                                 lambda rows: any(self.collection(r["version"]) == target for r in rows))
        return next((r["version"] for r in rows if self.collection(r["version"]) == target), None)

    @_outage_is_unavailable
    def manifest(self, version: str | None = None) -> SnapshotManifest:
        version = version or self.current_version()
        if version is not None and not VERSION_TEXT.match(version):
            raise SnapshotError(f"{version!r} is not a snapshot version name (like v0001-20261122T080000Z)")
        if version is None:
            raise SnapshotError(f"{self.describe()}: no published version (build one with `paraseek index build --backend milvus`)")
        rows = self._query_until(self.manifests, f'version == "{version}" and state == "published"', ["manifest"], bool)
        if not rows:
            raise SnapshotError(f"{self.describe()}: no published version {version!r}")
        return SnapshotManifest.model_validate_json(rows[0]["manifest"])

    @_outage_is_unavailable
    def activate(self, version: str) -> None:
        self.manifest(version)  # published, or SnapshotError
        name = self.collection(version)
        with self._lock:
            if self._alias_exists():
                self.client.alter_alias(name, self.alias)  # one step: readers see the old or the new version
                return
            try:
                self.client.create_alias(name, self.alias)
            except self.errors:
                # Milvus has no create-or-alter: another writer's first publication may have created the
                # alias since the check above; then this one moves it, as a later activation would
                if not self._alias_exists():
                    raise
                self.client.alter_alias(name, self.alias)

    def load(self, version: str | None = None, *, image_space: str | None = None, threads: int | None = None,
             verify: bool = True, rehash: bool = False, use_gpu: bool | None = None) -> MilvusSnapshot:
        # the server holds the vectors: ``verify`` compares its count with the manifest's; no files to hash
        try:
            manifest = self.manifest(version)
            check_image_space(manifest, image_space)
            name = self.collection(manifest.version)
            self.client.load_collection(name)
            if verify:
                count = self._count(name, manifest.count)
                if count != manifest.count:
                    raise SnapshotError(f"{self.describe()}: version {manifest.version} holds {count} vectors, its "
                                        f"manifest says {manifest.count}")
        except self.errors as exc:
            raise IndexUnavailable(f"{self.describe()}: version not loaded: {_reason(exc)}") from exc
        return MilvusSnapshot(self, manifest)

    def _count(self, name: str, expected: int) -> int:
        """The vectors of a version's collection, read Strong where a Bounded read counts other than ``expected``."""
        rows = self._query_until(name, "", ["count(*)"], lambda rows: int(rows[0]["count(*)"]) == expected)
        return int(rows[0]["count(*)"])

    @_outage_is_unavailable
    def prune(self, keep: int) -> list[str]:
        versions = self.versions()
        current = self.current_version()
        parent = self.manifest(current).parent if current in versions else None
        removed = versions_to_prune(versions, current, parent, keep)
        for version in removed:
            self._drop(version)
        return removed

    def _drop(self, version: str) -> None:
        self._drop_collection(self.collection(version))
        self.client.delete(self.manifests, filter=f'version == "{version}"')

    def _drop_collection(self, name: str) -> None:
        try:
            if self.client.has_collection(name):
                self.client.drop_collection(name)
        except self.errors:
            if self.client.has_collection(name):
                raise  # still there: not another writer's drop (of a stale build) that came first

    @_outage_is_unavailable
    def clean_stale(self, max_age_s: float = STALE_BUILD_AFTER_S) -> list[str]:
        """Versions whose build died: written by a process of this host that is gone, or by anyone
        longer ago than ``max_age_s``; and collections of this prefix that no manifest row names."""
        # listed before the rows are read: a build writes its row before it creates its collection, so a
        # collection listed here that no row names is not one whose build began meanwhile
        listed = self.client.list_collections()
        removed = []
        for row in self._rows("building"):
            try:
                stale = build_is_stale(json.loads(row["manifest"]), max_age_s=max_age_s)
            except ValueError:
                stale = True
            if stale:
                self._drop(row["version"])
                removed.append(row["version"])
        known = {self.collection(r["version"]) for r in self._rows()}
        pattern = re.compile(rf"^{re.escape(self.prefix)}_v\d{{4,}}_\d{{8}}T\d{{6}}Z(?:_[0-9a-f]{{4}})?$")
        for name in listed:
            if pattern.match(name) and name not in known:
                self._drop_collection(name)
                removed.append(name)
        return removed

    # -- writing a version ------------------------------------------------------------------------
    def begin_version(self) -> str:
        with self._lock:
            version = self.new_version_name()
            self._put(version, "building", json.dumps(build_owner()))
        return version

    def abort_version(self, version: str) -> None:
        try:
            rows = self.client.query(self.manifests, filter=f'version == "{version}"', output_fields=["state"], **STRONG)
            if rows and rows[0]["state"] == "building":
                self._drop(version)
        except self.errors as exc:
            log.warning("could not remove the failed build %s (the next build removes it): %s", version, _reason(exc))

    def _create(self, name: str, dim: int) -> None:
        from pymilvus import DataType

        schema = self.client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dim)
        schema.add_field("licence_id", DataType.INT64)
        schema.add_field("caption_text", DataType.VARCHAR, max_length=VARCHAR_MAX)
        schema.add_field("meta", DataType.JSON)
        # no index yet: a collection created with one is loaded at once, so the rows inserted next would be
        # served from growing segments through the server's interim index (IVF, its own nprobe) until the
        # query nodes swap in the indexed segments, seconds later; recall measured meanwhile is that index's
        self.client.create_collection(name, schema=schema)

    def _index_and_load(self, name: str, kind: str, build: dict, count: int) -> None:
        """Index the flushed rows, wait until every segment is indexed, then load: the query nodes load the
        sealed segments with their index, which serves from the first search."""
        index = self.client.prepare_index_params()
        index.add_index(field_name="vector", index_type=kind, metric_type="IP", params=build)
        self.client.create_index(name, index, sync=False)  # pymilvus' own wait has no deadline: ours has
        self._wait_indexed(name, kind, count)
        self.client.load_collection(name)

    def _insert(self, name: str, ids: np.ndarray, vectors: np.ndarray, metadata: list[dict], on_rows=None) -> None:
        for begin in range(0, len(ids), INSERT_ROWS):
            rows = []
            for row, image_id, vector in zip(metadata[begin:begin + INSERT_ROWS], ids[begin:begin + INSERT_ROWS],
                                             vectors[begin:begin + INSERT_ROWS]):
                rows.append({"id": int(image_id), "vector": np.asarray(vector, np.float32), "licence_id": licence_id(row),
                             "caption_text": _truncate_utf8(caption_text(row), VARCHAR_MAX), "meta": row})
            self.client.insert(name, rows)
            if on_rows is not None:
                on_rows(begin + len(rows))

    def write_version(self, draft, ref, spec, *, queries, query_source, index=None, target_recall=None, activate=True,
                      on_progress=None):
        count, dim = len(draft.ids), int(draft.vectors.shape[1])
        indexed = on_progress or (lambda done, rows: None)
        if spec.type == "auto" and count > EXACT_LIMIT:
            # the lists live in the Milvus server's memory, not ours; ivf_fp16 has no Milvus counterpart
            spec = spec.model_copy(update={"type": "ivf_flat"})
        spec = spec.resolved(count, dim).model_copy(update={"refine_factor": 1})  # Milvus re-ranks by its own rules
        kind, build, search = native_index(spec, self.index_type, self.index_params)
        name = self.collection(draft.version)
        metadata = draft.metadata if len(draft.metadata) == count else [{"id": int(i)} for i in draft.ids]
        try:
            if not self._query_until(self.manifests, f'version == "{draft.version}"', ["state"], bool):
                self._put(draft.version, "building", json.dumps(build_owner()))  # not begun with begin_version
            self._create(name, dim)
            self._insert(name, draft.ids, draft.vectors, metadata, on_rows=lambda done: indexed(done, count))
            self.client.flush(name)
            self._index_and_load(name, kind, build, count)
            indexed(count, count)
            written = self._count(name, count)
            if written != count:
                raise SnapshotError(f"Milvus holds {written} of the {count} vectors written to {name}")
            location = {"collection": name, "index_type": kind, "index_params": build,
                        "search_params": self.search_params or search}
            probe = MilvusSnapshot(self, draft.manifest(ref, spec, None, 0, None, backend="milvus", location=location))
            spec, recall, n_queries, tuning = self._measure_recall(probe, spec, draft, queries, query_source, target_recall)
            indexed(count, count)
            if tuning is not None:  # the tuned setting is what the version serves with
                location["search_params"] = native_index(spec)[2]
            manifest = draft.manifest(ref, spec, recall, n_queries, tuning, backend="milvus", location=location)
            self._put(draft.version, "published", manifest.model_dump_json())
        except BaseException as exc:
            try:
                self._drop(draft.version)  # nothing of a failed build stays; the alias never moved
            except self.errors:
                log.warning("could not drop the failed build's collection %s (the next build removes it)", name)
            if isinstance(exc, self.errors):
                raise IndexUnavailable(f"{self.describe()}: build of {draft.version} failed: {_reason(exc)}") from exc
            raise
        if activate:
            self.activate(draft.version)
        return name, manifest

    def _wait_indexed(self, name: str, kind: str, count: int) -> None:
        """Until the server's index nodes have indexed every flushed segment: a server builds indexes
        in the background, and a collection loaded earlier would serve (and measure its recall) without
        its index. An index the server cannot build (e.g. DISKANN on a build without disk-index support,
        which retries for ever) fails the build after ``index_timeout_s``."""
        deadline = time.monotonic() + self.index_timeout_s
        pause = 0.05  # doubling to 1 s: a small version is indexed within a few tenths of a second
        while True:
            info = self.client.describe_index(name, "vector")
            pending = int(info.get("pending_index_rows", 0))
            if not pending and int(info.get("indexed_rows", count)) >= count:
                return
            if time.monotonic() > deadline:
                raise SnapshotError(f"{self.describe()}: the server indexed {info.get('indexed_rows')} of {count} vectors of "
                                    f"{name} as {kind} in {self.index_timeout_s:.0f} s (PARASEEK_MILVUS_INDEX_TIMEOUT_S); "
                                    f"its index nodes' log says why")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(1.0, pause * 2)

    def _measure_recall(self, probe: MilvusSnapshot, spec: IndexSpec, draft, queries: np.ndarray, query_source: str,
                        target_recall: float | None) -> tuple[IndexSpec, float | None, int, dict | None]:
        """Recall@10 of the collection's index against exact search, as the FAISS builder measures it
        (with ``target_recall``, nprobe / ef tuned on half the queries). A native index type or search
        params set by the settings are measured as they are, not tuned."""

        tunable = not self.index_type and not self.search_params  # else the settings fix the search

        def run(candidate: IndexSpec, q: np.ndarray, k: int) -> np.ndarray:
            probe.params = native_index(candidate)[2] if tunable else (self.search_params or {})
            return probe.search_ids(q, k)[1]

        return measure_recall_with(run, spec, draft.vectors, draft.ids, queries, 10, target_recall if tunable else None,
                                   query_source, exact=spec.exact and not self.index_type)


def _reason(exc: BaseException) -> str:
    message = getattr(exc, "message", None) or str(exc)
    code = getattr(exc, "code", None)
    return f"{message} (code {code})" if code not in (None, "") else message


def widened_for_filter(params: dict, index_params: dict, share: float) -> dict:
    """Native search params for a filter that keeps ``share`` of the vectors: an IVF index's nprobe
    (``widened_nprobe``) or an HNSW graph's ef (``widened_ef``) widened, others as they are."""
    nlist, nprobe, ef = index_params.get("nlist"), params.get("nprobe"), params.get("ef")
    if nlist and nprobe:
        return {**params, "nprobe": widened_nprobe(int(nprobe), int(nlist), share)}
    if ef:
        return {**params, "ef": widened_ef(int(ef), share)}
    return params


def params_for_short_answers(params: dict, index_type: str, index_params: dict) -> dict | None:
    """Search params for asking again the queries a search with ``params`` answered with fewer hits
    than there are vectors to find, or None where asking again would find no more.

    A 2.3.5 server's HNSW search under a filter sometimes answers a query with 0 or 1 hits of 10 when
    a thousand vectors match, whatever its ef (milvus-io/milvus #33933: the graph around the query
    holds no matching node). Asked as a range search over every score (unit vectors score above -1),
    it finds them with a wide enough beam: at 10K vectors, 500 queries, a 10 % filter answered 15 with
    no hit, all found at ef 512; a 50 % filter answered 3 with one hit, found only at ef 4096. So the
    beam starts at RETRY_EF and grows fourfold up to RETRY_EF_MAX. An IVF index probes every list."""
    if index_type == "HNSW":
        ef = int(params.get("ef") or 0)
        if "radius" not in params:
            return {**params, "ef": max(RETRY_EF, ef), "radius": -1.0}
        return {**params, "ef": min(RETRY_EF_MAX, 4 * ef)} if ef < RETRY_EF_MAX else None
    nlist = int(index_params.get("nlist") or 0)
    if nlist and int(params.get("nprobe") or 0) < nlist:
        return {**params, "nprobe": nlist}
    return None


class MilvusView:
    """A Milvus snapshot restricted by a filter: Milvus applies the expression inside the search, with
    search params widened for the share of the collection the filter keeps (counted at the first search)."""

    def __init__(self, snapshot: MilvusSnapshot, expression: str):
        self.snapshot, self.expression = snapshot, expression
        self._params: dict | None = None
        self.matching = 0

    def search_params(self) -> dict:
        if self._params is None:  # two threads may both count: the same answer
            index_params = self.snapshot.manifest.location.get("index_params") or {}
            self.matching = self.snapshot.matching(self.expression)
            share = self.matching / max(1, self.snapshot.manifest.count)
            self._params = widened_for_filter(self.snapshot.params, index_params, share)
        return self._params

    def search_ids(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        params = self.search_params()
        return self.snapshot.search_ids(queries, k, self.expression, params=params, findable=self.matching)


class MilvusSnapshot(SearchableSnapshot):
    """A published version's collection, searched through the store's client."""

    device = "milvus"

    def __init__(self, store: MilvusStore, manifest: SnapshotManifest):
        self.store = store
        self.manifest = manifest
        self.collection = manifest.location.get("collection") or store.collection(manifest.version)
        self.params = store.search_params or manifest.location.get("search_params") or {}
        self._meta: LRUCache = LRUCache(METADATA_CACHE)
        self._meta_lock = threading.Lock()
        self._views: OrderedDict[str, MilvusView] = OrderedDict()
        self._lock = threading.Lock()

    def _call(self, what: str, fn, *args, **kwargs):
        """A Milvus call; failures become IndexUnavailable (503). A collection the server no longer
        has loaded (after a restart) is loaded again, and a dropped connection reconnected, and the
        call retried once (they only read)."""
        try:
            return fn(*args, **kwargs)
        except self.store.errors as first:
            message = str(first).lower()
            if "unsupported pattern" in message and "like" in message:
                # a request the server cannot run is the request's problem, not an outage
                raise FilterError("filter.caption_contains", "this Milvus server matches text only at the start of a "
                                  "caption (LIKE 'abc%'); matching inside captions needs Milvus 2.4 or newer, "
                                  "or the faiss backend") from first
            try:
                if "not loaded" in message or "released" in message or "load()" in message:
                    self.store.client.load_collection(self.collection)
                    return fn(*args, **kwargs)
                if any(t in message for t in TRANSIENT):  # a dropped connection: gRPC reconnects on the next call
                    time.sleep(0.2)
                    return fn(*args, **kwargs)
            except self.store.errors as exc:
                first = exc
            raise IndexUnavailable(f"{self.store.describe()}: {what} failed: {_reason(first)}") from first

    def search_ids(self, queries: np.ndarray, k: int, expression: str = "", params: dict | None = None,
                   findable: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` ids and scores per query (-1 / -inf where there are fewer). ``findable``: how many
        vectors the expression keeps (all of them without one). A query answered with fewer hits than
        that allows is asked again with params_for_short_answers, wider each time, until its answer is
        full or nothing wider is left; it keeps its longest answer."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if queries.shape[1] != self.manifest.dim:
            raise SnapshotError(f"query dim {queries.shape[1]} != snapshot dim {self.manifest.dim}")
        width = max(1, min(int(k), self.manifest.count))
        params = self.params if params is None else params
        scores, ids = self._search(queries, width, expression, params)
        findable = self.manifest.count if not expression else findable
        wanted = min(width, findable or 0)
        short = np.flatnonzero((ids[:, :wanted] < 0).any(axis=1))
        index_type, index_params = self.manifest.location.get("index_type", ""), self.manifest.location.get("index_params") or {}
        retry = params_for_short_answers(params, index_type, index_params) if short.size else None
        while short.size and retry is not None:
            log.debug("%s: %d of %d queries answered short, asked again with %s", self.collection, short.size,
                      len(queries), retry)
            more_scores, more_ids = self._search(queries[short], width, expression, retry)
            longer = (more_ids >= 0).sum(axis=1) > (ids[short] >= 0).sum(axis=1)
            scores[short[longer]], ids[short[longer]] = more_scores[longer], more_ids[longer]
            short = short[(ids[short, :wanted] < 0).any(axis=1)]
            retry = params_for_short_answers(retry, index_type, index_params)
        return scores, ids

    def _search(self, queries: np.ndarray, width: int, expression: str, params: dict) -> tuple[np.ndarray, np.ndarray]:
        hits = self._call("search", self.store.client.search, self.collection, data=list(queries), limit=width,
                          filter=expression, output_fields=[], search_params={"metric_type": "IP", "params": params},
                          timeout=self.store.timeout_s)
        scores = np.full((len(queries), width), -np.inf, np.float32)
        ids = np.full((len(queries), width), -1, np.int64)
        for row, found in enumerate(hits):
            for col, hit in enumerate(found[:width]):
                ids[row, col] = int(hit["id"])
                scores[row, col] = float(hit["distance"])
        return scores, ids

    def matching(self, expression: str) -> int:
        """How many vectors of this version a filter expression keeps."""
        rows = self._call("filter count", self.store.client.query, self.collection, filter=expression,
                          output_fields=["count(*)"], timeout=self.store.timeout_s)
        return int(rows[0]["count(*)"])

    def filtered(self, flt: SearchFilter) -> MilvusView:
        key = flt.key()
        with self._lock:
            view = self._views.get(key)
            if view is None:
                view = self._views[key] = MilvusView(self, milvus_expression(flt, self.manifest.user_fields or []))
                if len(self._views) > FILTER_CACHE:
                    self._views.popitem(last=False)
            else:
                self._views.move_to_end(key)
            return view

    def metadata_of(self, image_ids) -> dict[int, dict]:
        wanted = [int(i) for i in image_ids]
        # the LRU reorders itself on every read: worker threads take turns (the lookup runs unlocked)
        with self._meta_lock:
            found = {i: self._meta[i] for i in dict.fromkeys(wanted) if i in self._meta}
        missing = [i for i in dict.fromkeys(wanted) if i not in found]
        if missing:
            rows = self._call("metadata lookup", self.store.client.get, self.collection, ids=missing,
                              output_fields=["meta"], timeout=self.store.timeout_s)
            with self._meta_lock:
                for row in rows:
                    found[int(row["id"])] = self._meta[int(row["id"])] = row["meta"]
        return {i: found[i] for i in wanted if i in found}

    def vectors_of(self, image_ids) -> np.ndarray:
        wanted = [int(i) for i in image_ids]
        rows = self._call("vector lookup", self.store.client.get, self.collection, ids=list(dict.fromkeys(wanted)),
                          output_fields=["vector"], timeout=self.store.timeout_s)
        found = {int(r["id"]): r["vector"] for r in rows}
        missing = [i for i in wanted if i not in found]
        if missing:
            raise KeyError(f"ids not in the index: {missing[:5]}")
        return np.asarray([found[i] for i in wanted], np.float32).reshape(len(wanted), self.manifest.dim)

    def _export(self, fields: list[str], chunk: int = 16_384):
        """The version's rows, ``fields`` of each, chunk by chunk (a query iterator: no offset limit)."""
        iterator = self._call("export", self.store.client.query_iterator, self.collection, batch_size=min(chunk, 16_384),
                              output_fields=fields)
        try:
            while rows := self._call("export", iterator.next):
                yield rows
        finally:
            iterator.close()

    def held_ids(self) -> np.ndarray:
        parts = [np.fromiter((r["id"] for r in rows), np.int64, len(rows)) for rows in self._export(["id"])]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def iter_metadata(self, chunk: int = 16_384):
        for rows in self._export(["id", "meta"], chunk):
            yield np.array([r["id"] for r in rows], np.int64), [r["meta"] for r in rows]

    def iter_contents(self, chunk: int = 16_384):
        for rows in self._export(["id", "vector", "meta"], chunk):
            yield (np.array([r["id"] for r in rows], np.int64), np.asarray([r["vector"] for r in rows], np.float32),
                   [r["meta"] for r in rows])
