"""No unbounded waiting: requests past PARASEEK_MAX_IN_FLIGHT are refused at once (503, Retry-After),
a request past its deadline is given up, slow paraphrase sources run on threads of their own (the
rest of the service keeps answering), the LLM client stops at its deadline, and its cache and the
batchers' queues are bounded."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from paraseek.paraphrase.llm import ChatClient, JsonlCache, LLMError, LLMSource
from paraseek.service.batcher import ContinuousBatcher, Overloaded
from paraseek.service.main import create_app

SLOW_LLM = {"query": "a dog on a beach", "k": 3, "expansion": {"method": "llm", "n": 2}}


def _shed(client, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(client.get("/metrics").text)
    return sum(s.value for f in families if f.name == "paraseek_shed" for s in f.samples
               if s.labels.get("reason") == reason and s.name.endswith("_total"))


def _in_background(client, body):
    out: dict = {}

    def go():
        out["response"] = client.post("/v1/search", json=body)

    thread = threading.Thread(target=go)
    thread.start()
    return thread, out


def _wait_for_calls(handler, n: int) -> None:
    """Until the fake endpoint has received ``n`` calls (the requests that make them are waiting on it)."""
    deadline = time.monotonic() + 30
    while len(handler.calls) < n:
        assert time.monotonic() < deadline, f"the endpoint received {len(handler.calls)} calls, not {n}"
        time.sleep(0.01)


def test_past_max_in_flight_requests_are_refused_at_once(make_settings, fake_llm):
    handler = fake_llm["handler"]
    handler.hold()  # the accepted request waits on the endpoint until the test releases it
    settings = make_settings(llm_base_url=fake_llm["url"], llm_model="fake", max_in_flight=1)
    with TestClient(create_app(settings)) as c:
        thread, slow = _in_background(c, SLOW_LLM)
        _wait_for_calls(handler, 1)
        refused = c.post("/v1/search", json={"query": "a cat", "k": 3, "expansion": {"method": "none"}})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["detail"][0]["loc"] == ["service"] and "PARASEEK_MAX_IN_FLIGHT" in refused.text
        # refused while the accepted one still waits on the endpoint: before any work, not after its turn
        assert handler.answered == 0 and "response" not in slow
        assert _shed(c, "in_flight") == 1
        handler.release.set()
        thread.join(30)
        assert slow["response"].status_code == 200  # the accepted one is answered in full
        assert c.post("/v1/search", json={"query": "a cat", "k": 3}).status_code == 200  # room again


def test_a_request_past_its_deadline_is_given_up(make_settings, fake_llm):
    handler = fake_llm["handler"]
    handler.hold()  # the endpoint answers only once the test releases it
    settings = make_settings(llm_base_url=fake_llm["url"], llm_model="fake", request_timeout_s=1.0)
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/search", json=SLOW_LLM)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1" and "PARASEEK_REQUEST_TIMEOUT_S" in r.text
        assert handler.calls and handler.answered == 0  # given up at its deadline, with the endpoint still silent
        assert _shed(c, "deadline") == 1
        handler.release.set()


def test_slow_paraphrase_calls_do_not_starve_the_rest(make_settings, fake_llm):
    """Four requests wait on a held LLM endpoint on the LLM source's threads; a filtered search (which
    uses the shared pool), an image and a WordNet expansion (another source's threads) are answered meanwhile."""
    handler = fake_llm["handler"]
    handler.hold()
    settings = make_settings(llm_base_url=fake_llm["url"], llm_model="fake", paraphrase_workers=2, max_in_flight=16)
    with TestClient(create_app(settings)) as c:
        waiting = [_in_background(c, {**SLOW_LLM, "query": f"a dog number {i}"}) for i in range(4)]
        _wait_for_calls(handler, 2)  # both paraphrase threads wait on the endpoint
        filtered = c.post("/v1/search", json={"query": "a dog", "k": 3, "filter": {"licence": [4]}, "expansion": {"method": "none"}})
        assert filtered.status_code == 200, filtered.text
        image = c.get(f"/v1/images/{filtered.json()['results'][0]['id']}")
        assert image.status_code == 200
        wordnet = c.post("/v1/search", json={"query": "a dog on a couch", "k": 3, "expansion": {"method": "wordnet", "n": 2}})
        assert wordnet.status_code == 200, wordnet.text
        # answered while every LLM request still waited: not behind them
        assert handler.answered == 0 and not any("response" in out for _, out in waiting)
        handler.release.set()
        for thread, out in waiting:
            thread.join(60)
            assert out["response"].status_code == 200


def test_the_llm_client_stops_at_its_deadline(fake_llm, tmp_path):
    handler = fake_llm["handler"]
    handler.hold(answer_first=1)  # one answer, then silence
    client = ChatClient(fake_llm["url"], "fake", timeout=20, retries=5, cache_path=tmp_path / "c.jsonl", deadline_s=1.0)
    got = LLMSource(client).paraphrases("a dog on a beach", 5)
    assert len(got) == 1 and handler.answered == 1  # what came back by the deadline, the second call unanswered
    with pytest.raises(LLMError, match="no paraphrase within 1 s"):
        LLMSource(client).paraphrases("a cat on a sofa", 2)
    assert handler.answered == 1
    handler.release.set()


@pytest.mark.quick
def test_the_llm_cache_is_bounded_in_memory_and_on_disk(tmp_path):
    path = tmp_path / "llm.jsonl"
    cache = JsonlCache(path, max_entries=3)
    for i in range(20):
        cache.put(f"k{i}", f"v{i}")
        assert len(cache) <= 3
    lines = path.read_text().splitlines()
    assert len(lines) <= 2 * 3 + 1
    assert cache.get("k19") == "v19" and cache.get("k0") is None
    again = JsonlCache(path, max_entries=3)
    assert len(again) == 3 and again.get("k19") == "v19" and again.get("k17") == "v17"
    assert {json.loads(line)["key"] for line in lines} >= {"k17", "k18", "k19"}


@pytest.mark.quick
def test_a_full_batcher_queue_refuses_more():
    async def scenario():
        release = threading.Event()

        def run(key, payloads):
            release.wait(10)
            return payloads

        batcher = ContinuousBatcher(run, name="test", max_batch_size=1, max_queued=2)
        await batcher.start()
        try:
            first = asyncio.create_task(batcher.submit("k", 1))  # taken by the worker, which blocks
            await asyncio.sleep(0.1)
            queued = [asyncio.create_task(batcher.submit("k", i)) for i in (2, 3)]
            await asyncio.sleep(0.05)
            with pytest.raises(Overloaded, match="queue holds 2"):
                await batcher.submit("k", 4)
            release.set()
            assert await first == 1 and [await q for q in queued] == [2, 3]
        finally:
            release.set()
            await batcher.stop()

    asyncio.run(scenario())


@pytest.mark.quick
def test_a_request_may_spend_at_most_24_llm_endpoint_calls(make_settings, fake_llm):
    handler = fake_llm["handler"]
    settings = make_settings(llm_base_url=fake_llm["url"], llm_model="fake")
    with TestClient(create_app(settings)) as c:
        costly = c.post("/v1/search", json={"query": "a dog on a beach", "expansion": {"method": "generator", "n": 8},
                                            "consistency": {"auto": 8, "method": "llm"}})
        assert costly.status_code == 422 and costly.json()["detail"][0]["loc"] == ["body", "expansion", "n"]
        assert "up to 26 LLM endpoint calls" in costly.json()["detail"][0]["msg"] and handler.calls == []  # refused first
        within = c.post("/v1/search", json={"query": "a dog on a beach", "expansion": {"method": "generator", "n": 8},
                                            "consistency": {"auto": 6, "method": "llm"}})
        assert within.status_code == 200, within.text
        assert 0 < len(handler.calls) <= 24
        # and a client address that has spent its calls of the minute waits: 429, nothing called
        from paraseek.service.llm_budget import ClientBudget

        c.app.state.engine.llm_budget = ClientBudget(per_minute=20)
        calls = len(handler.calls)
        assert c.post("/v1/search", json={"query": "a cat", "expansion": {"method": "llm", "n": 3}}).status_code == 200
        spent = c.post("/v1/search", json={"query": "a bus", "expansion": {"method": "generator", "n": 12}})
        assert spent.status_code == 429 and spent.json()["detail"][0]["loc"] == ["body", "expansion", "n"]
        assert "retry in" in spent.json()["detail"][0]["msg"] and len(handler.calls) <= calls + 5
