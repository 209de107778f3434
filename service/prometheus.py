"""Prometheus metrics of the service (one registry per app, so tests can build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from paraseek.core.memory import process_memory

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
AO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
# label values exported from the start (at 0), so a dashboard panel has a series before the first event
STAGES = ("paraphrase", "encode", "expand", "search", "fusion", "consistency")


class ServiceMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("paraseek_requests_total", "HTTP requests", ["route", "method", "status"], registry=r)
        self.latency = Histogram("paraseek_request_seconds", "HTTP request latency", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.stage = Histogram("paraseek_stage_seconds", "Time per search stage", ["stage"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.cache = Counter("paraseek_cache_total", "Cache lookups", ["cache", "result"], registry=r)
        self.cache_errors = Counter("paraseek_cache_errors_total", "Redis errors (served without cache)", registry=r)
        self.batch_size = Histogram("paraseek_encoder_batch_texts", "Texts per encoder call",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.index_batch_size = Histogram("paraseek_index_batch_queries", "Query rows per index search call",
                                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.index_size = Gauge("paraseek_index_vectors", "Vectors in the serving snapshot", registry=r)
        self.reindex = Counter("paraseek_reindex_total", "Reindex jobs", ["result"], registry=r)
        self.reindex_images = Counter("paraseek_reindex_images_total", "Images indexed by successful reindexes: encoded "
                                      "by the image tower, or reused (their files' vectors found in the version built from)",
                                      ["how"], registry=r)
        self.shed = Counter("paraseek_shed_total", "Requests refused with 503 to keep the others' latency",
                            ["reason"], registry=r)  # in_flight, queue, deadline
        self.in_flight = Gauge("paraseek_requests_in_flight", "Requests being answered", registry=r)
        self.batch_wait = Histogram("paraseek_batch_wait_seconds", "Time a request's work waited in a batcher's queue "
                                    "before its call started", ["stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.cache_breaker = Gauge("paraseek_cache_breaker_state", "Redis circuit breaker: 0 closed, 0.5 half-open "
                                   "(probing), 1 open (serving without cache)", registry=r)
        self.snapshot = Gauge("paraseek_snapshot_info", "The serving snapshot and bundle (value 1)",
                              ["version", "backend", "bundle"], registry=r)
        self.consistency_ao = Histogram("paraseek_consistency_mean_ao", "Mean AO@k of each consistency report "
                                        "(answers' stability under rephrasing, in real traffic)", buckets=AO_BUCKETS, registry=r)
        self.consistency_reports = Counter("paraseek_consistency_reports_total", "Consistency reports, by whether "
                                           "mean AO@k met PARASEEK_CONSISTENCY_THRESHOLD", ["stable"], registry=r)
        # the process's RSS, CPU seconds, open files (Linux /proc), on this app's registry
        ProcessCollector(registry=r)
        # RSS splits into private memory and page cache of mapped files (a memory-mapped IVF index, the
        # refine stage's vectors.npy): only the private part is this replica's alone, and must fit its limit
        self.private_memory = Gauge("paraseek_process_private_memory_bytes", "Resident memory of this process "
                                    "alone (anonymous pages)", registry=r)
        self.private_memory.set_function(lambda: process_memory().private_mb * 2**20)
        self.file_memory = Gauge("paraseek_process_file_backed_memory_bytes", "Resident pages of mapped files "
                                 "(snapshot index and vectors): page cache the kernel can drop and re-read", registry=r)
        self.file_memory.set_function(lambda: process_memory().file_mb * 2**20)
        for stage in STAGES:
            self.stage.labels(stage)
        for stage in ("encoder", "index"):
            self.batch_wait.labels(stage)
        for cache in ("embedding", "result"):
            for result in ("hit", "miss"):
                self.cache.labels(cache, result)
        for result in ("succeeded", "failed", "cancelled"):
            self.reindex.labels(result)
        for how in ("encoded", "reused"):
            self.reindex_images.labels(how)
        for reason in ("in_flight", "queue", "deadline"):
            self.shed.labels(reason)
        for stable in ("true", "false"):
            self.consistency_reports.labels(stable)

    def serving(self, version: str, backend: str, bundle: str) -> None:
        """The snapshot now served: one series of paraseek_snapshot_info, the old one removed."""
        self.snapshot.clear()
        self.snapshot.labels(version, backend, bundle).set(1)
