"""Realistic paraseek traffic for Locust. Select scenarios with tags (``--tags plain cache``).

Queries are COCO captions. By default these are the captions of the demo gallery shipped with
paraseek; set PARASEEK_LOAD_QUERIES to a TSV with ``image_id`` and ``caption`` columns (COCO
train_captions.tsv, for example) for more. The other captions of the same photo are its human
paraphrases, used for consistency reports.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000
"""

from __future__ import annotations

import random

from locust import FastHttpUser, between, tag, task

from paraseek.core.settings import Settings
from paraseek.loadtests.queries import caption_groups

GROUPS = caption_groups(Settings().load_queries)
POPULAR = [g[0] for g in GROUPS[:20]]  # a few queries many users repeat: cache hits


class SearchUser(FastHttpUser):
    wait_time = between(0.05, 0.5)

    def _post(self, body: dict, name: str):
        with self.client.post("/v1/search", json=body, name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
            elif not resp.json().get("results"):
                resp.failure("no results")

    @tag("plain")
    @task(10)
    def plain_search(self):
        group = random.choice(GROUPS)
        self._post({"query": random.choice(group), "k": 10}, "search")

    @tag("cache")
    @task(5)
    def repeated_search(self):
        self._post({"query": random.choice(POPULAR), "k": 10}, "search (repeated)")

    @tag("consistency")
    @task(3)
    def consistency_report(self):
        group = random.choice(GROUPS)
        query, *paraphrases = random.sample(group, k=min(4, len(group)))
        self._post({"query": query, "k": 10, "consistency": {"paraphrases": paraphrases[:3], "k": 10}},
                   "search + consistency")

    @tag("expansion")
    @task(2)
    def expanded_search(self):
        self._post({"query": random.choice(random.choice(GROUPS)), "expansion": {"method": "wordnet", "n": 3}},
                   "search + wordnet expansion")

    @tag("batch")
    @task(1)
    def batch_search(self):
        queries = [random.choice(random.choice(GROUPS)) for _ in range(8)]
        with self.client.post("/v1/search/batch", json={"requests": [{"query": q, "k": 5} for q in queries]},
                              name="search/batch", catch_response=True) as resp:
            if resp.status_code != 200 or len(resp.json().get("responses", [])) != 8:
                resp.failure(f"HTTP {resp.status_code}")

    @tag("info")
    @task(1)
    def info(self):
        self.client.get("/v1/info", name="info")
