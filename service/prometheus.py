"""Prometheus metrics of the service (one registry per app, so tests can build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


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
        self.shed = Counter("paraseek_shed_total", "Requests refused with 503 to keep the others' latency",
                            ["reason"], registry=r)  # in_flight, queue, deadline
        self.in_flight = Gauge("paraseek_requests_in_flight", "Requests being answered", registry=r)
