"""Admin jobs (reindex) run on a background thread; the event loop keeps answering queries."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from index.builder import build_snapshot
from index.faiss_index import IndexSpec
from index.snapshot import activate_version
from service.engine import Active, SearchEngine, load_encoder, load_snapshot, validate_snapshot
from service.schemas import Job, ReindexRequest

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class JobManager:
    def __init__(self, engine: SearchEngine, max_jobs: int = 100):
        self.engine = engine
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reindex")  # one build at a time
        self.max_jobs = max_jobs

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def _update(self, job_id: str, **changes) -> None:
        with self._lock:
            self.jobs[job_id] = self.jobs[job_id].model_copy(update=changes)

    def submit_reindex(self, req: ReindexRequest) -> Job:
        job = Job(id=uuid.uuid4().hex, kind="reindex", state="queued", created_at=_now())
        with self._lock:
            if len(self.jobs) >= self.max_jobs:  # forget the oldest finished jobs
                for old in [j.id for j in self.jobs.values() if j.state in ("succeeded", "failed")][: len(self.jobs) // 2]:
                    del self.jobs[old]
            self.jobs[job.id] = job
        self._executor.submit(self._reindex, job.id, req)
        return job

    def _reindex(self, job_id: str, req: ReindexRequest) -> None:
        engine = self.engine
        self._update(job_id, state="running")
        try:
            settings = engine.settings
            current = engine.active
            if req.bundle:
                encoder = load_encoder(req.bundle, settings)
            elif current is not None:
                encoder = current.encoder
            else:
                encoder = load_encoder(settings.bundle_dir, settings)
            spec = IndexSpec.model_validate({"type": req.index_type, **req.index_params})
            result = build_snapshot(
                req.source, encoder, settings.snapshot_root, spec=spec, image_root=req.images, progress=False,
                on_progress=lambda done, total: self._update(job_id, progress={"done": done, "total": total}),
                activate=False,
            )
            active = Active(encoder, load_snapshot(result.version_dir, encoder, settings))
            validate_snapshot(active)
            activate_version(settings.snapshot_root, result.manifest.version)
            engine.swap(active)
            engine.metrics.reindex.labels("succeeded").inc()
            report = (result.version_dir / "report.json").read_text()
            self._update(job_id, state="succeeded", finished_at=_now(), report=json.loads(report),
                         snapshot_version=result.manifest.version)
            log.info("reindex %s: now serving snapshot %s", job_id, result.manifest.version)
        except BaseException as exc:  # the old snapshot keeps serving; the job says why
            engine.metrics.reindex.labels("failed").inc()
            self._update(job_id, state="failed", finished_at=_now(), error=f"{type(exc).__name__}: {exc}")
            log.warning("reindex %s failed, still serving the previous snapshot: %s", job_id, exc)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
