"""What the service expands queries with: paraphrase sources and caption banks, loaded once and kept,
their slow calls on threads of their own; and the lookups a vector expansion makes
(``paraseek.paraphrase.expansions.Lookups``) through the index stage's batcher."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from paraseek.core.settings import Settings
from paraseek.index.store import SearchView
from paraseek.paraphrase import ParaphraseSource, ParaphraseSourceUnavailable
from paraseek.paraphrase.caption_bank import CaptionBank, CaptionBankError, configured_bank_dir
from paraseek.paraphrase.factory import make_source
from paraseek.paraphrase.hub_table import HubTable, hub_table_for, written_hub_table
from paraseek.paraphrase.llm import LLMError
from paraseek.service.batcher import ContinuousBatcher, search_rows
from paraseek.service.errors import RequestError
from paraseek.service.runtime import Active

log = logging.getLogger(__name__)

# the caption bank's nearest captions, merged across requests like index searches: (rows, similarities)
_BANK_NEIGHBOURS = search_rows(lambda bank, queries, n: bank.neighbours(queries, n))
# images whose hubness is kept (about 100 bytes each in a dict): past it the kept ones are dropped and computed
# again as lists show them, so a collection bigger than memory never fills it
HUB_BIAS_KEPT = 1_000_000


class ExpansionSources:
    def __init__(self, settings: Settings):
        self.settings = settings
        # each paraphrase source on threads of its own (PARASEEK_PARAPHRASE_WORKERS a source): a slow one (an
        # LLM endpoint: seconds a call) holds neither the shared pool that metadata lookups and filters use
        # nor the other sources' (WordNet answers in milliseconds while LLM calls wait)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._sources: dict[str, ParaphraseSource] = {}
        self._banks: dict[str, CaptionBank] = {}
        # hub_weight: each image's hubness against the bank, computed the first time a list shows it
        # (a gallery's worth at most; one float an image), per bundle and snapshot version
        self._hub_bias: dict[tuple[str, str], dict[int, float]] = {}
        # ... and, once built, the whole version's (``paraseek.paraphrase.hub_table``), which replaces them
        self._hub_tables: dict[tuple[str, str], HubTable] = {}
        self._hub_table_builds: set[tuple[str, str]] = set()  # being built, or failed
        self._prepared_hub_tables: dict[tuple[str, str], HubTable] = {}  # a reindex's, until its version serves
        self._hub_table_failed: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        # loading a paraphrase source takes seconds (WordNet: 3-5 s); a lock of its own keeps the bank and
        # hub lookups of every request from waiting behind it
        self._sources_lock = threading.Lock()
        self._pools_lock = threading.Lock()

    def shutdown(self) -> None:
        for pool in list(self._pools.values()):
            pool.shutdown(wait=False, cancel_futures=True)

    def pool(self, method: str) -> ThreadPoolExecutor:
        """The threads of one paraphrase source (work queued there and given up by its request is cancelled
        with it: asyncio cancels an executor future that has not started)."""
        with self._pools_lock:  # held for microseconds: taken on the event loop
            if method not in self._pools:
                self._pools[method] = ThreadPoolExecutor(self.settings.paraphrase_workers,
                                                         thread_name_prefix=f"paraphrase-{method}")
            return self._pools[method]

    def paraphrase_source(self, method: str, field: str, usual_only: bool = True) -> ParaphraseSource:
        """``usual_only``: expansion rewrites toward more usual wording (which raises consistency); a
        consistency report asks for every reliable rephrasing instead (it tests the answers' stability)."""
        key = f"{method}:{usual_only}"
        with self._sources_lock:
            if key not in self._sources:
                try:
                    self._sources[key] = make_source(method, self.settings, usual_only=usual_only)
                except ParaphraseSourceUnavailable as exc:
                    raise RequestError(field, f"{method} is unavailable: {exc}", status=400) from exc
            return self._sources[key]

    async def paraphrases(self, text: str, method: str, n: int, field: str, usual_only: bool = True) -> list[str]:
        loop = asyncio.get_running_loop()
        # loading a source reads files (WordNet takes seconds): never on the event loop
        pool = self.pool(method)
        source = await loop.run_in_executor(pool, self.paraphrase_source, method, field, usual_only)
        try:
            # LLM calls block on the network (each text's within PARASEEK_LLM_DEADLINE_S): off the event loop
            return await loop.run_in_executor(pool, source.paraphrases, text, n)
        except LLMError as exc:
            raise RequestError(field, str(exc), status=502) from exc
        except Exception as exc:  # a source's own failure: logged in full, reported as upstream, never a 500
            log.exception("paraphrase source %s failed", method)
            raise RequestError(field, f"{method} failed: {type(exc).__name__}: {exc}", status=502) from exc

    def caption_bank(self, active: Active) -> CaptionBank:
        """The bank of the serving bundle: ``PARASEEK_CAPTION_BANK``, else the bundle's default bank
        under PARASEEK_HOME; 400 when there is none. Loading reads files: call it off the event loop."""
        with self._lock:
            bank = self._banks.get(active.model_id)
            if bank is None:
                encoder = active.encoder
                path = configured_bank_dir(self.settings, encoder.manifest)
                if not (path / "manifest.json").is_file():
                    raise RequestError("expansion.method", "no caption bank for this bundle: build one with "
                                       "`paraseek models build-bank` (or set PARASEEK_CAPTION_BANK)", status=400)
                try:
                    bank = CaptionBank.load(path, encoder)
                except CaptionBankError as exc:
                    raise RequestError("expansion.method", f"caption bank unavailable: {exc}", status=400) from exc
                self._banks = {active.model_id: bank}  # one bundle serves at a time
            return bank

    def loaded_bank(self, active: Active) -> CaptionBank | None:
        return self._banks.get(active.model_id)

    def hub_bias(self, active: Active, ids: np.ndarray) -> np.ndarray:
        """``CaptionBank.hub_bias`` of the images ``ids`` names (0 for padding): from the index version's hub
        table once it is built (``start_hub_table``, asked for here the first time), until then from the
        stored vectors of those not seen before. Reads the bank and the index: call it off the event loop."""
        bank = self.caption_bank(active)
        key = (active.model_id, active.snapshot.version)
        table = self._hub_tables.get(key)
        if table is None:
            self.start_hub_table(active, bank)
        else:
            bias, missing = table.lookup(np.atleast_2d(ids))
            if not missing.any():
                return bias
        with self._lock:
            if key not in self._hub_bias or len(self._hub_bias[key]) > HUB_BIAS_KEPT:
                self._hub_bias = {key: {}}  # one bundle and snapshot serve at a time
            known = self._hub_bias[key]
            missing_ids = sorted({int(i) for i in np.unique(ids) if i >= 0} - known.keys())
        if missing_ids:
            computed = dict(zip(missing_ids, bank.hub_bias(active.snapshot.vectors_of(missing_ids)).tolist()))
            with self._lock:
                known.update(computed)
        else:
            computed = {}
        return np.array([[computed[i] if i in computed else known.get(i, 0.0) for i in map(int, row)]
                         for row in np.atleast_2d(ids)], np.float32)

    def start_hub_table(self, active: Active, bank: CaptionBank | None = None) -> threading.Thread | None:
        """Build the serving index version's hub table on a thread of its own (read from PARASEEK_HUB_TABLES where
        an earlier start, a reindex or ``paraseek index build`` wrote it, else computed over the whole version
        and written there); None where it is loaded, prepared (installed here at once), being built, or failed
        for this version already (hubness then stays computed per image)."""
        key = (active.model_id, active.snapshot.version)
        with self._lock:
            if key in self._hub_tables or key in self._hub_table_builds:
                return None
            prepared = self._prepared_hub_tables.pop(key, None)
            if prepared is not None:
                self._install_hub_table(key, prepared)
                return None
            self._hub_table_builds.add(key)
        bank = bank if bank is not None else self.caption_bank(active)
        thread = threading.Thread(target=self._build_hub_table, args=(active, bank, key), name="hub-table", daemon=True)
        thread.start()
        return thread

    def hub_table_state(self, active: Active) -> str | None:
        """What ``/v1/info`` says of the served version's hub table: ready, building, failed (hubness is computed
        per image), or None (no request or default asked for one)."""
        key = (active.model_id, active.snapshot.version)
        with self._lock:
            if key in self._hub_tables:
                return "ready"
            if key in self._hub_table_failed:
                return "failed"
            return "building" if key in self._hub_table_builds else None

    def prepare_hub_table(self, active: Active, *, compute: bool = True) -> float | None:
        """The hub table of a version about to serve (a reindex's, before its swap), computed here and written
        under PARASEEK_HUB_TABLES, then installed when ``start_hub_table`` is asked for it, so the version serves
        with it from its first request. Only for the tower whose bank is loaded (the served one): a reindex
        with another bundle leaves its table to the thread after the swap. ``compute`` False: only a table
        already written is prepared (a rollback should not wait for one). Returns the seconds computing
        took (None: read back, not computed, or not this tower's)."""
        bank = self.loaded_bank(active)
        if bank is None:
            return None
        if compute:
            table, seconds = hub_table_for(self.settings.hub_tables_dir, active.snapshot, bank)
        else:
            written = written_hub_table(self.settings.hub_tables_dir, active.snapshot, bank)
            if written is None:
                return None
            table, seconds = written, None
        with self._lock:
            self._prepared_hub_tables = {(active.model_id, active.snapshot.version): table}  # one version at a time
        return seconds

    def _build_hub_table(self, active: Active, bank: CaptionBank, key: tuple[str, str]) -> None:
        try:
            table, _ = hub_table_for(self.settings.hub_tables_dir, active.snapshot, bank)
        except Exception:  # an index that went away: per-image hubness still serves
            log.exception("no hub table for index version %s: hubness stays computed per image", active.snapshot.version)
            with self._lock:
                self._hub_table_failed.add(key)
            return
        with self._lock:
            self._install_hub_table(key, table)
            self._hub_table_builds.discard(key)  # a version served again later (a rollback) reads it back

    def _install_hub_table(self, key: tuple[str, str], table: HubTable) -> None:
        """Under ``_lock``."""
        self._hub_tables = {key: table}  # one bundle and snapshot serve at a time
        self._hub_bias.pop(key, None)


class BatchedLookups:
    """``Lookups`` for one request: bank neighbours and top images go through the index stage's batcher
    (merged with other requests' searches), stored vectors are read off the event loop."""

    def __init__(self, sources: ExpansionSources, active: Active, view: SearchView, index_batcher: ContinuousBatcher):
        self.sources, self.active, self.view, self.index_batcher = sources, active, view, index_batcher

    async def caption_bank(self) -> CaptionBank:
        bank = self.sources.loaded_bank(self.active)
        return bank if bank is not None else await asyncio.to_thread(self.sources.caption_bank, self.active)

    async def bank_neighbours(self, bank: CaptionBank, queries: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        return await self.index_batcher.submit(bank, (queries, n), _BANK_NEIGHBOURS)

    async def top_images(self, queries: np.ndarray, m: int) -> np.ndarray:
        _, top = await self.index_batcher.submit(self.view, (queries, m))
        return top

    async def image_vectors(self, ids: np.ndarray) -> list[np.ndarray]:
        return await asyncio.to_thread(self.active.snapshot.feedback_vectors, ids)
