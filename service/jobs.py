"""Admin jobs (reindex) run on a background thread; the event loop keeps answering queries.

Each job's record is also a JSON file (``Settings.jobs_path``), written atomically at every change, so
a restarted service still answers for its jobs: one that was queued or running when the process died
is reported as failed ("interrupted")."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Collection

from paraseek.core.memory import release_free_memory
from paraseek.index.backends import store_from_settings
from paraseek.index.builder import build_snapshot, plan_build
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.image_sources import open_source
from paraseek.service.engine import SearchEngine
from paraseek.service.job_states import FINISHED
from paraseek.service.runtime import Active, first_answer_for, load_encoder, load_snapshot, validate_snapshot
from paraseek.service.schemas import Job, JobProgress, ReindexRequest

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.now(UTC).isoformat()


INTERRUPTED = "interrupted: the service stopped before the job finished"
CANCELLED = "cancelled by an admin request"


class JobCancelled(Exception):
    """An admin asked to cancel the job: raised in the job's thread where it next reports progress."""


class JobFinished(Exception):
    """The job to cancel has already finished."""


class JobManager:
    def __init__(self, engine: SearchEngine, max_jobs: int = 100, store: Path | None = None):
        self.engine = engine
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reindex")  # one build at a time
        self.max_jobs = max_jobs
        self.store = store
        self._written_at: dict[str, float] = {}
        self._futures: dict[str, Future] = {}  # queued or running jobs
        self._cancel_asked: set[str] = set()
        if store is not None:
            self._load()

    # -- records on disk -------------------------------------------------------------------------
    def _load(self) -> None:
        assert self.store is not None
        self.store.mkdir(parents=True, exist_ok=True)
        records = []
        for path in self.store.glob("*.json"):
            try:
                records.append(Job.model_validate_json(path.read_text()))
            except (OSError, ValueError) as exc:
                log.warning("job record %s unreadable, ignored: %s", path.name, exc)
        for job in sorted(records, key=lambda j: j.created_at):
            if job.state in ("queued", "running"):
                job = job.model_copy(update={"state": "failed", "finished_at": _now(), "error": INTERRUPTED})
                self._write(job)
            self.jobs[job.id] = job

    def _write(self, job: Job) -> None:
        if self.store is None:
            return
        tmp = self.store / f".{job.id}.json.tmp"
        tmp.write_text(job.model_dump_json())
        os.replace(tmp, self.store / f"{job.id}.json")

    def _forget(self, job_id: str) -> None:
        del self.jobs[job_id]
        self._written_at.pop(job_id, None)
        if self.store is not None:
            (self.store / f"{job_id}.json").unlink(missing_ok=True)

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def listed(self, states: Collection[str] | None = None) -> list[Job]:
        """The jobs it remembers (``max_jobs``), newest first; with ``states``, those in one of them."""
        with self._lock:
            jobs = list(self.jobs.values())
        return sorted((j for j in jobs if states is None or j.state in states), key=lambda j: j.created_at, reverse=True)

    def _update(self, job_id: str, **changes) -> None:
        with self._lock:
            before = self.jobs[job_id]
            self.jobs[job_id] = before.model_copy(update=changes)
            # progress comes once per image: on disk at most once a second; state and phase changes at once
            now = time.monotonic()
            new_phase = "progress" in changes and (before.progress is None
                                                   or before.progress.phase != changes["progress"].phase)
            if set(changes) != {"progress"} or new_phase or now - self._written_at.get(job_id, 0.0) >= 1.0:
                self._write(self.jobs[job_id])
                self._written_at[job_id] = now

    def submit_reindex(self, req: ReindexRequest, within: list[Path] | None = None) -> Job:
        """Queue a build of ``req`` (its paths already resolved); ``within``: the roots its source must
        still resolve inside when the job opens it."""
        job = Job(id=uuid.uuid4().hex, kind="reindex", state="queued", created_at=_now())
        with self._lock:
            if len(self.jobs) >= self.max_jobs:  # forget the oldest finished jobs
                for old in [j.id for j in self.jobs.values() if j.state in FINISHED][: len(self.jobs) // 2]:
                    self._forget(old)
            self.jobs[job.id] = job
            self._write(job)
            self._futures[job.id] = self._executor.submit(self._reindex, job.id, req, within)
        return job

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued or running job; -> its record (None: no such job; ``JobFinished``: it has ended).
        A queued job never starts. A running one stops where it next reports progress (each photo hashed
        or encoded, each phase begun), its unfinished version removed, the served one untouched; a build
        already past its last report (indexing) ends as written, unpublished and unserved."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                return None
            if job.state in FINISHED:
                raise JobFinished(f"job {job_id} has already {job.state}")
            self._cancel_asked.add(job_id)
            future = self._futures.get(job_id)
        if future is not None and future.cancel():  # still queued
            self._finish(job_id)
            self.engine.metrics.reindex.labels("cancelled").inc()
            self._update(job_id, state="cancelled", finished_at=_now(), error=CANCELLED)
        return self.jobs[job_id]

    def _check_cancel(self, job_id: str) -> None:
        if job_id in self._cancel_asked:
            raise JobCancelled(CANCELLED)

    def _finish(self, job_id: str) -> None:
        with self._lock:
            self._futures.pop(job_id, None)
            self._cancel_asked.discard(job_id)

    def _reindex(self, job_id: str, req: ReindexRequest, within: list[Path] | None = None) -> None:
        engine = self.engine
        self._update(job_id, state="running")
        try:
            self._check_cancel(job_id)  # asked between its start and this line
            settings = engine.settings
            current = engine.active
            if req.bundle:
                encoder = load_encoder(req.bundle, settings)
            elif current is not None:
                encoder = current.encoder
            else:
                encoder = load_encoder(settings.bundle_dir, settings)
            spec = IndexSpec.model_validate({"type": req.index_type, **req.index_params})
            store = engine.store or store_from_settings(settings)
            self._update(job_id, progress=JobProgress(phase="listing"))
            source = open_source(req.source, req.images, within=within)

            def on_progress(phase: str, done: int, total: int) -> None:
                self._check_cancel(job_id)  # the build removes its unfinished version
                self._update(job_id, progress=JobProgress(phase=phase, done=done, total=total))

            if req.dry_run:  # the plan is the report: nothing encoded, written or swapped
                plan = plan_build(source, encoder, store, spec=spec, reuse=req.reuse, checksum=req.checksum,
                                  on_progress=on_progress)
                self._update(job_id, state="succeeded", finished_at=_now(), report={"dry_run": True, **plan})
                log.info("reindex %s: dry run: %s", job_id, plan)
                return
            result = build_snapshot(
                source, encoder, store, spec=spec, progress=False, on_progress=on_progress,
                activate=False, reuse=req.reuse, checksum=req.checksum,
            )
            self._check_cancel(job_id)  # built, not served: it stays written, unpublished
            if result.report.get("unchanged") and current is not None and current.snapshot.version == result.manifest.version:
                engine.metrics.reindex.labels("succeeded").inc()  # nothing changed: the served version stays
                self._update(job_id, state="succeeded", finished_at=_now(), report=result.report,
                             snapshot_version=result.manifest.version)
                log.info("reindex %s: nothing changed, still serving snapshot %s", job_id, result.manifest.version)
                return
            active = Active(encoder, load_snapshot(store, encoder.image_space, settings, result.manifest.version),
                            first_answer_for(current, encoder))
            validate_snapshot(active)
            report = dict(result.report)
            if engine.hub_corrects_by_default:
                try:  # computed before the swap, so the new version serves hub-corrected lists from its first request
                    seconds = engine.expansion_sources.prepare_hub_table(active)
                    if seconds is not None:
                        report["hub_table_s"] = round(seconds, 3)
                except Exception:  # an index that went away meanwhile: the swap's own build (or per-image hubness) serves
                    log.exception("reindex %s: no hub table before the swap", job_id)
            # published only if what this build started from is still served (a reload or another
            # reindex meanwhile fails the job: the version stays written, unpublished)
            engine.swap(active, replaces=current, publish=lambda: store.activate(result.manifest.version))
            try:  # the new version serves already: a failed clean-up is reported, the job succeeded
                pruned = store.prune(settings.snapshot_keep_versions)
                if pruned:
                    log.info("pruned old snapshot versions %s", pruned)
            except Exception as exc:
                report["prune_error"] = f"{type(exc).__name__}: {exc}"
                log.warning("reindex %s: serving snapshot %s, but pruning old versions failed: %s",
                            job_id, result.manifest.version, exc)
            engine.metrics.reindex.labels("succeeded").inc()
            for how in ("encoded", "reused"):
                engine.metrics.reindex_images.labels(how).inc(report.get(how, 0))
            self._update(job_id, state="succeeded", finished_at=_now(), report=report,
                         snapshot_version=result.manifest.version)
            log.info("reindex %s: now serving snapshot %s", job_id, result.manifest.version)
        except JobCancelled:
            engine.metrics.reindex.labels("cancelled").inc()
            self._update(job_id, state="cancelled", finished_at=_now(), error=CANCELLED)
            log.info("reindex %s cancelled, still serving the previous snapshot", job_id)
            release_free_memory()
        except BaseException as exc:  # the old snapshot keeps serving; the job says why
            engine.metrics.reindex.labels("failed").inc()
            self._update(job_id, state="failed", finished_at=_now(), error=f"{type(exc).__name__}: {exc}")
            log.warning("reindex %s failed, still serving the previous snapshot: %s", job_id, exc)
            release_free_memory()  # the failed build's buffers (a success released them in engine.swap)
        finally:
            self._finish(job_id)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
