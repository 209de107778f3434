"""POST /v1/search and friends, in-process."""

import asyncio
import time

import httpx
import numpy as np
import pytest

from paraseek.index.snapshot import Snapshot
from paraseek.core.encoder import Encoder, l2_normalize
from tests.service.conftest import assert_error_names

# every test that serves a snapshot runs on FAISS and on the same snapshot copied into Milvus Lite
# (those marked above_the_index, whose subject the index never sees, on FAISS only)
BOTH_BACKENDS = True
ON_MILVUS_SERVER = True  # and on a real Milvus 2.3.5 standalone server (the run's shared one)


@pytest.fixture()
def direct(starter_bundle, demo_snapshot):
    """The same bundle and snapshot used directly, for independent computations."""
    return Encoder(starter_bundle), Snapshot.load(demo_snapshot)


def test_plain_search(client, direct):
    r = client.post("/v1/search", json={"query": "a plate of food on a table", "k": 5})
    assert r.status_code == 200
    body = r.json()
    assert [x["rank"] for x in body["results"]] == [1, 2, 3, 4, 5]
    scores = [x["score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    first = body["results"][0]
    assert first["url"].startswith("http") and first["captions"] and first["licence"]["id"] in (4, 5)
    assert body["bundle"] == "paraseek-starter" and body["snapshot_version"].startswith("v0001")
    assert set(body["timings"]) == {"encode_ms", "search_ms", "total_ms"} and body["cache"] == "miss"
    enc, snap = direct
    _, ids = snap.search_ids(enc.encode_text(["a plate of food on a table"]), 5)
    assert [x["id"] for x in body["results"]] == ids[0].tolist()
    assert body["truncated"] is False


def _embedding_cache(client, result: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(client.get("/metrics").text)
    return sum(s.value for f in families if f.name == "paraseek_cache" for s in f.samples
               if s.labels == {"cache": "embedding", "result": result} and s.name.endswith("_total"))


@pytest.mark.quick
def test_cache_hit_returns_same_results(client):
    a = client.post("/v1/search", json={"query": "Two giraffes", "k": 3, "expansion": {"method": "none"}}).json()
    b = client.post("/v1/search", json={"query": "Two giraffes", "k": 3, "expansion": {"method": "none"}}).json()
    assert b["cache"] == "hit" and a["results"] == b["results"]
    hits = _embedding_cache(client, "hit")
    # another result key, the same token ids under the starter's uncased vocabulary: the vector is cached
    c = client.post("/v1/search", json={"query": "two  GIRAFFES", "k": 3, "expansion": {"method": "none"}}).json()
    assert c["cache"] == "miss" and c["results"] == a["results"]
    assert _embedding_cache(client, "hit") == hits + 1
    misses = _embedding_cache(client, "miss")
    client.post("/v1/search", json={"query": "two [MASK]", "k": 3, "expansion": {"method": "none"}})
    client.post("/v1/search", json={"query": "two [mask]", "k": 3, "expansion": {"method": "none"}})
    assert _embedding_cache(client, "miss") == misses + 2  # a special token and plain text differ


def _ao(a, b, k):
    return sum(len(set(a[:d]) & set(b[:d])) / d for d in range(1, k + 1)) / k


def _js(a, b, k):
    return len(set(a[:k]) & set(b[:k])) / len(set(a[:k]) | set(b[:k]))


@pytest.mark.quick
def test_consistency_matches_independent_computation(client, direct):
    query, paras = "a dog on a beach", ["a puppy at the seaside", "dog beach", "a cat on a sofa"]
    r = client.post("/v1/search", json={"query": query, "k": 3, "consistency": {"paraphrases": paras, "k": 10}})
    assert r.status_code == 200
    rep = r.json()["consistency"]
    enc, snap = direct
    _, ids = snap.search_ids(enc.encode_text([query, *paras]), 10)
    q = ids[0].tolist()
    for i, p in enumerate(rep["paraphrases"]):
        assert p["text"] == paras[i] and p["ids"] == ids[i + 1].tolist()
        assert p["ao"] == pytest.approx(_ao(q, p["ids"], 10)) and p["js"] == pytest.approx(_js(q, p["ids"], 10))
    assert rep["mean_ao"] == pytest.approx(np.mean([_ao(q, ids[i].tolist(), 10) for i in (1, 2, 3)]))
    assert rep["stable"] == (rep["mean_ao"] >= rep["threshold"])


@pytest.mark.above_the_index
@pytest.mark.quick
def test_consistency_auto_uses_generated_paraphrases(client):
    r = client.post("/v1/search", json={"query": "a man riding a horse", "consistency": {"auto": 2, "method": "wordnet"}})
    assert r.status_code == 200
    rep = r.json()["consistency"]
    assert len(rep["paraphrases"]) == 2 and all(p["text"] != "a man riding a horse" for p in rep["paraphrases"])


def test_expansion_is_mean_of_normalised_embeddings(client, direct):
    query = "a kid in a big automobile"  # WordNet's more usual wording: child, large, car
    r = client.post("/v1/search", json={"query": query, "k": 10, "expansion": {"method": "wordnet", "n": 2}})
    assert r.status_code == 200
    body = r.json()
    assert len(body["expansions"]) == 2
    enc, snap = direct
    vecs = enc.encode_text([query, *body["expansions"]])
    expected = l2_normalize(vecs.mean(axis=0))  # Cheng et al. eq. 5
    scores, ids = snap.search_ids(expected[None], 10)
    assert [x["id"] for x in body["results"]] == ids[0].tolist()
    assert [x["score"] for x in body["results"]] == pytest.approx(scores[0].tolist(), abs=1e-5)


def test_expansion_rrf(client, direct):
    r = client.post("/v1/search", json={"query": "a photo of a big airplane", "k": 5, "expansion": {"method": "wordnet", "n": 2, "fusion": "rrf"}})
    assert r.status_code == 200
    body = r.json()
    # reciprocal-rank fusion computed by hand from the query's and each expansion's own top lists
    enc, snap = direct
    k_search = 5
    _, ids = snap.search_ids(enc.encode_text(["a photo of a big airplane", *body["expansions"]]), k_search)
    fused: dict[int, float] = {}
    for row in ids:
        for rank, i in enumerate(row.tolist()):
            fused[i] = fused.get(i, 0.0) + 1 / (60 + rank + 1)
    expected = sorted(fused.items(), key=lambda kv: -kv[1])[:5]
    assert [x["id"] for x in body["results"]] == [i for i, _ in expected]
    assert [x["score"] for x in body["results"]] == pytest.approx([s for _, s in expected])


@pytest.mark.above_the_index
@pytest.mark.quick
def test_ppdb_expansion(make_settings, shared_data):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    with TestClient(create_app(make_settings(ppdb_path=shared_data / "paraphrase/ppdb_lexical_synonyms.tsv"))) as c:
        r = c.post("/v1/search", json={"query": "a kid in an automobile", "expansion": {"method": "ppdb", "n": 2}})
        assert r.status_code == 200 and len(r.json()["expansions"]) == 2


@pytest.mark.quick
def test_weighted_terms(client, direct):
    terms = [{"text": "a dog on a beach", "weight": 1}, {"text": "at night", "weight": -0.5}]
    r = client.post("/v1/search", json={"terms": terms, "k": 5})
    assert r.status_code == 200
    enc, snap = direct
    v = enc.encode_text(["a dog on a beach", "at night"])
    _, ids = snap.search_ids(l2_normalize(v[0] - 0.5 * v[1])[None], 5)
    assert [x["id"] for x in r.json()["results"]] == ids[0].tolist()


BAD_BODIES = [  # (body, status, loc)
    ({"query": ""}, 422, ["body", "query"]),
    ({"query": "   "}, 422, ["body", "query"]),
    ({"query": "x", "k": 0}, 422, ["body", "k"]),
    ({"query": "x", "k": 1001}, 422, ["body", "k"]),
    ({"query": "x", "k": "ten"}, 422, ["body", "k"]),
    ({"query": 3}, 422, ["body", "query"]),
    ({"query": "x", "unknown": 1}, 422, ["body", "unknown"]),
    ({}, 422, ["body"]),
    ({"query": "x" * 1001}, 422, ["body", "query"]),
    ({"query": "x", "expansion": {"method": "llm"}}, 400, ["body", "expansion", "method"]),
    ({"query": "x", "expansion": {"method": "ppdb"}}, 400, ["body", "expansion", "method"]),
    ({"query": "x", "expansion": {"method": "wordnet", "n": 17}}, 422, ["body", "expansion", "n"]),
    ({"query": "x", "expansion": {"method": "bank", "n": 129}}, 422, ["body", "expansion", "n"]),
    ({"query": "x", "consistency": {}}, 422, ["body", "consistency"]),
    ({"query": "x", "consistency": {"paraphrases": ["ok", " "]}}, 422, ["body", "consistency", "paraphrases"]),
    ({"terms": [{"text": "a", "weight": 1}, {"text": "a", "weight": -1}]}, 422, ["body", "terms"]),
    ({"terms": []}, 422, ["body", "terms"]),
]


@pytest.mark.above_the_index
@pytest.mark.quick
def test_bad_input_names_the_field(client, subtests):
    for case, (body, status, loc) in enumerate(BAD_BODIES):
        with subtests.test(case=case):
            assert_error_names(client.post("/v1/search", json=body), loc, status)


@pytest.mark.above_the_index
def test_malformed_and_oversized_bodies(client):
    assert client.post("/v1/search", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    big = b'{"query": "' + b"a" * 300_000 + b'"}'
    assert client.post("/v1/search", content=big, headers={"content-type": "application/json"}).status_code == 413


@pytest.mark.above_the_index
@pytest.mark.quick
def test_overlong_query_is_truncated_and_says_so(make_settings):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    with TestClient(create_app(make_settings(max_query_chars=5000))) as c:
        r = c.post("/v1/search", json={"query": "a dog running on the grass " * 60})
        assert r.status_code == 200 and r.json()["truncated"] is True
        again = c.post("/v1/search", json={"query": "a dog running on the grass " * 60, "k": 3})  # embedding cached
        assert again.json()["truncated"] is True


@pytest.mark.quick
def test_batch_search(client):
    r = client.post("/v1/search/batch", json={"requests": [{"query": "a cat"}, {"query": "a bus", "k": 2}]})
    assert r.status_code == 200
    assert [len(x["results"]) for x in r.json()["responses"]] == [10, 2]
    bad = client.post("/v1/search/batch", json={"requests": [{"query": "ok"}, {"query": "x", "k": 0}]})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:3] == ["body", "requests", 1]


@pytest.mark.above_the_index
@pytest.mark.quick
def test_a_batch_takes_a_share_of_the_in_flight_slots_not_all_of_them(make_settings):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    with TestClient(create_app(make_settings(max_in_flight=8))) as c:
        engine, most = c.app.state.engine, []
        search = engine.search

        async def watched(req):
            most.append(engine.in_flight)
            return await search(req)

        engine.search = watched
        r = c.post("/v1/search/batch", json={"requests": [{"query": f"a photo of {n} dogs", "k": 2} for n in range(16)]})
        assert r.status_code == 200 and len(r.json()["responses"]) == 16  # twice the slots, none of its searches shed
        assert max(most) <= 8 // 4 - 1  # counted when each started: the others of the batch in flight then


@pytest.mark.quick
def test_images_info_health_metrics(client):
    first = client.post("/v1/search", json={"query": "a kitchen", "k": 1}).json()["results"][0]
    img = client.get(f"/v1/images/{first['id']}")
    assert img.status_code == 200 and img.content[:3] == b"\xff\xd8\xff"
    assert client.get("/v1/images/42").status_code == 404
    info = client.get("/v1/info").json()
    assert info["snapshot"]["count"] == 76 and info["bundle"]["name"] == "paraseek-starter"
    assert client.get("/healthz").status_code == 200
    deadline = time.time() + 60  # ready once the WordNet preload is done
    while client.get("/readyz").status_code != 200 and time.time() < deadline:
        time.sleep(0.05)
    assert client.get("/readyz").status_code == 200
    for bad in ("+377575", "3_7_7_5_7_5", "-1", "1e3", "99999999999999999999"):
        assert client.get(f"/v1/images/{bad}").status_code == 422  # ids are plain decimal digits
    metrics = client.get("/metrics").text
    for name in ("paraseek_requests_total", "paraseek_request_seconds_bucket", "paraseek_stage_seconds_bucket",
                 "paraseek_cache_total", "paraseek_encoder_batch_texts_bucket", "paraseek_index_vectors 76.0"):
        assert name in metrics
    assert client.get("/openapi.json").json()["info"]["title"] == "paraseek"


@pytest.mark.quick
def test_not_ready_without_snapshot(make_settings, tmp_path):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    with TestClient(create_app(make_settings(snapshot=tmp_path / "none"))) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").status_code == 503
        assert c.post("/v1/search", json={"query": "x"}).status_code == 503


@pytest.mark.quick
def test_micro_batching_merges_concurrent_requests(make_settings):
    from paraseek.service.main import create_app

    app = create_app(make_settings(max_wait_ms=50, lru_size=0))
    engine = app.state.engine

    async def go():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                rs = await asyncio.gather(*(c.post("/v1/search", json={"query": f"a photo of object {i}"}) for i in range(16)))
        return rs

    responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses)
    counts = [s for m in engine.metrics.batch_size.collect() for s in m.samples if s.name.endswith("_count")]
    sums = [s for m in engine.metrics.batch_size.collect() for s in m.samples if s.name.endswith("_sum")]
    assert sums[0].value == 16 and counts[0].value < 16  # fewer encoder calls than requests
    searches = {s.name.rsplit("_", 1)[1]: s.value for m in engine.metrics.index_batch_size.collect() for s in m.samples
                if s.name.endswith(("_count", "_sum"))}
    assert searches["sum"] == 16 and searches["count"] < 16  # and fewer index searches: they are merged too


@pytest.mark.above_the_index
def test_llm_expansion_and_two_step_generator(make_settings, fake_llm):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    settings = make_settings(llm_base_url=fake_llm["url"], llm_model="fake", llm_api_key="k")
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/search", json={"query": "A dog on a beach.", "expansion": {"method": "llm", "n": 2}})
        assert r.status_code == 200 and len(r.json()["expansions"]) == 2
        assert all(e.startswith("a picture of a dog on a beach") for e in r.json()["expansions"])
        assert fake_llm["handler"].calls[0]["auth"] == "Bearer k"
        g = c.post("/v1/search", json={"query": "A dog on a beach.", "consistency": {"auto": 2, "method": "generator"}})
        texts = [p["text"] for p in g.json()["consistency"]["paraphrases"]]
        assert texts[0].startswith("a picture of") and texts[1].startswith("an image that depicts a picture of")
        calls = len(fake_llm["handler"].calls)
        c.post("/v1/search", json={"query": "A dog on a beach.", "expansion": {"method": "llm", "n": 2}, "k": 3})
        assert len(fake_llm["handler"].calls) == calls  # answered from the on-disk cache
        fake_llm["handler"].fail = True
        bad = c.post("/v1/search", json={"query": "something new", "expansion": {"method": "llm", "n": 1}})
        assert bad.status_code == 502 and bad.json()["detail"][0]["loc"] == ["body", "expansion", "method"]


@pytest.mark.above_the_index
@pytest.mark.quick
def test_a_failing_source_is_a_502_naming_the_field(client, monkeypatch):
    from paraseek.paraphrase.wordnet import WordNetSource

    def broken(self, text, n):
        raise OSError("corpus file unreadable")

    monkeypatch.setattr(WordNetSource, "paraphrases", broken)
    r = client.post("/v1/search", json={"query": "a dog", "expansion": {"method": "wordnet", "n": 2}})
    assert r.status_code == 502
    assert r.json()["detail"][0]["loc"] == ["body", "expansion", "method"] and "corpus file" in r.text


@pytest.mark.above_the_index
@pytest.mark.quick
def test_streamed_body_over_the_limit_is_413(make_settings):
    """A chunked body (no Content-Length) is counted as it arrives and cut off at the limit."""
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    def chunks():
        yield b'{"query": "'
        for _ in range(64):
            yield b"a" * 1024
        yield b'"}'

    with TestClient(create_app(make_settings(max_body_bytes=16 * 1024))) as c:
        r = c.post("/v1/search", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body"]
        small = c.post("/v1/search", content=iter([b'{"query": "a dog"}']), headers={"content-type": "application/json"})
        assert small.status_code == 200
        declared = c.post("/v1/search", content=b"x" * (17 * 1024), headers={"content-type": "application/json"})
        assert declared.status_code == 413
        # the metrics count what was answered: two 413s (one cut off while streaming), no 500
        counts: dict[str, float] = {}
        for line in c.get("/metrics").text.splitlines():
            if line.startswith("paraseek_requests_total{") and 'method="POST"' in line:
                status = line.split('status="')[1].split('"')[0]
                counts[status] = counts.get(status, 0) + float(line.rsplit(" ", 1)[1])
        assert counts == {"413": 2, "200": 1}, counts


TEXT_FIELD_BODIES = [  # (body, loc of the error; None: accepted)
    ({"query": "a dog"}, None),
    ({"query": "\u200b\u200c\u200d\ufeff"}, ["body", "query"]),
    ({"query": "\u0000"}, ["body", "query"]),
    ({"query": " \t\u00a0\u2028 "}, ["body", "query"]),
    ({"terms": [{"text": "\u200b"}]}, ["body", "terms", 0, "text"]),
    ({"query": "a dog", "consistency": {"paraphrases": ["a \udc00 dog"]}}, ["body", "consistency", "paraphrases", 0]),
    ({"query": "a dog", "consistency": {"paraphrases": ["a puppy", "\u0000\u0001"]}}, ["body", "consistency", "paraphrases", 1]),
    ({"query": "a \udc00 dog"}, ["body", "query"]),
]


@pytest.mark.above_the_index
@pytest.mark.quick
def test_every_text_field_is_validated_the_same_way(client, subtests):
    import json

    for case, (body, loc) in enumerate(TEXT_FIELD_BODIES):
        with subtests.test(case=case):
            # ensure_ascii keeps lone surrogates as \udc00 escapes, as a hostile client would send them
            r = client.post("/v1/search", content=json.dumps(body), headers={"content-type": "application/json"})
            if loc is None:
                assert r.status_code == 200
                continue
            assert_error_names(r, loc, whole=True)
            batch = client.post("/v1/search/batch", content=json.dumps({"requests": [body]}),
                                headers={"content-type": "application/json"})
            assert batch.status_code == 422 and batch.json()["detail"][0]["loc"] == ["body", "requests", 0, *loc[1:]]


@pytest.mark.above_the_index
@pytest.mark.quick
def test_deeply_nested_json_is_a_4xx_naming_the_body(client):
    body = '{"query": "a dog", "k": ' + "[" * 5000 + "]" * 5000 + "}"
    r = client.post("/v1/search", content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500 and r.json()["detail"][0]["loc"][0] == "body"


@pytest.mark.above_the_index
@pytest.mark.quick
def test_consistency_reports_requested_and_produced(client):
    r = client.post("/v1/search", json={"query": "a man riding a horse", "consistency": {"auto": 16, "method": "wordnet"}})
    rep = r.json()["consistency"]
    assert rep["requested"] == 16 and rep["produced"] == len(rep["paraphrases"]) <= 16
    r = client.post("/v1/search", json={"query": "a dog", "consistency": {"paraphrases": ["a puppy", "a hound"]}})
    assert r.json()["consistency"]["requested"] == r.json()["consistency"]["produced"] == 2


@pytest.mark.quick
def test_not_ready_answers_without_server_paths(make_settings, tmp_path):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    with TestClient(create_app(make_settings(snapshot=tmp_path / "secret-location"))) as c:
        for r in (c.get("/readyz"), c.post("/v1/search", json={"query": "a dog"})):
            assert r.status_code == 503
            assert "secret-location" not in r.text and str(tmp_path) not in r.text


@pytest.mark.quick
def test_ready_means_warm(make_settings, monkeypatch):
    """/readyz answers 503 "warming up" until the WordNet preload has finished, then 200."""
    import threading

    from fastapi.testclient import TestClient

    from paraseek.service.engine import SearchEngine
    from paraseek.service.main import create_app

    release = threading.Event()
    original = SearchEngine._warm_up

    def slow_preload(self):
        release.wait(30)
        original(self)

    monkeypatch.setattr(SearchEngine, "_warm_up", slow_preload)
    with TestClient(create_app(make_settings())) as c:
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        assert c.post("/v1/search", json={"query": "a dog"}).status_code == 200  # plain search is not held up
        release.set()
        deadline = time.time() + 30
        while c.get("/readyz").status_code != 200 and time.time() < deadline:
            time.sleep(0.05)
        assert c.get("/readyz").json()["status"] == "ready"


def test_bank_expansion_equals_the_hand_computation(make_settings, starter_bank, direct):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    enc, snap = direct
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path))) as c:
        r = c.post("/v1/search", json={"query": "a dog on a beach", "k": 10, "expansion": {"method": "bank", "n": 7}})
        assert r.status_code == 200, r.text
        body = r.json()
        q = enc.encode_text(["a dog on a beach"])[0]
        sims = starter_bank.vectors @ q
        top = np.argsort(-sims)[:7]
        assert body["expansions"] == [starter_bank.texts[i] for i in top]  # the neighbours, most similar first
        expected = (q + starter_bank.vectors[top].sum(axis=0)) / 8  # eq. 5 over the query and 7 captions
        scores, ids = snap.search_ids((expected / np.linalg.norm(expected))[None], 10)
        assert [x["id"] for x in body["results"]] == ids[0].tolist()
        assert [x["score"] for x in body["results"]] == pytest.approx(scores[0].tolist(), abs=1e-4)
        weighted = c.post("/v1/search", json={"query": "a dog on a beach", "expansion": {"method": "bank", "n": 7, "fusion": "weighted"}})
        assert weighted.status_code == 200 and weighted.json()["expansions"] == body["expansions"]
        bad = c.post("/v1/search", json={"query": "a dog", "expansion": {"method": "bank", "fusion": "rrf"}})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == ["body", "expansion"]


@pytest.mark.quick
def test_bank_rounds_move_the_moved_query_again(make_settings, starter_bank, direct):
    """rounds 2: the once-moved query looks up its own 7 neighbours and takes their mean with them; the
    expansions shown are the last round's neighbours. rounds only applies to the bank, 1 to 4."""
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    enc, snap = direct

    def moved(q):
        top = np.argsort(-(starter_bank.vectors @ q))[:7]
        m = (q + starter_bank.vectors[top].sum(axis=0)) / 8
        return m / np.linalg.norm(m), top

    with TestClient(create_app(make_settings(caption_bank=starter_bank.path))) as c:
        r = c.post("/v1/search", json={"query": "a dog on a beach", "k": 10, "expansion": {"method": "bank", "n": 7, "rounds": 2}})
        assert r.status_code == 200, r.text
        once, _ = moved(enc.encode_text(["a dog on a beach"])[0])
        twice, last = moved(once)
        _, ids = snap.search_ids(twice[None], 10)
        assert [x["id"] for x in r.json()["results"]] == ids[0].tolist()
        assert r.json()["expansions"] == [starter_bank.texts[i] for i in last]
        one = c.post("/v1/search", json={"query": "a dog on a beach", "k": 10, "expansion": {"method": "bank", "n": 7}}).json()
        assert one["results"] != r.json()["results"]  # the second round moved the list
        for bad in ({"method": "bank", "rounds": 5}, {"method": "bank", "rounds": 0}, {"method": "prf", "rounds": 2}):
            r = c.post("/v1/search", json={"query": "a dog", "expansion": bad})
            assert r.status_code == 422, bad
            assert r.json()["detail"][0]["loc"][:2] == ["body", "expansion"]


def test_head_expansion_moves_the_query_by_the_banks_head_then_its_rounds(make_settings, starter_bank, direct, tmp_path):
    """method head: the bank's query head on the query, then ``rounds`` bank rounds (0: no lookup, no
    expansions shown); a bank without a head is a 400 naming expansion.method."""
    import shutil

    from fastapi.testclient import TestClient

    from paraseek.paraphrase.caption_bank import CaptionBank
    from paraseek.service.main import create_app
    from tests.paraphrase.test_query_head import random_head

    enc, snap = direct
    shutil.copytree(starter_bank.path, tmp_path / "bank")
    bank = CaptionBank.read(tmp_path / "bank")
    with TestClient(create_app(make_settings(caption_bank=bank.path))) as c:
        r = c.post("/v1/search", json={"query": "a dog", "expansion": {"method": "head", "rounds": 0}})
        assert r.status_code == 400 and r.json()["detail"][0]["loc"] == ["body", "expansion", "method"]
        assert "train-head" in r.json()["detail"][0]["msg"]
    head = random_head(dim=bank.manifest.dim, hidden=16, scale=0.1)
    bank = bank.with_head(head)
    q = enc.encode_text(["a dog on a beach"])[0]
    with TestClient(create_app(make_settings(caption_bank=bank.path))) as c:
        r = c.post("/v1/search", json={"query": "a dog on a beach", "k": 10, "expansion": {"method": "head"}})
        assert r.status_code == 200, r.text  # rounds: head's default, 0
        _, ids = snap.search_ids(head(q)[None], 10)
        assert [x["id"] for x in r.json()["results"]] == ids[0].tolist() and "expansions" not in r.json()
        same = c.post("/v1/search", json={"query": "a dog on a beach", "k": 10, "expansion": {"method": "head", "rounds": 0}})
        assert same.json()["results"] == r.json()["results"]
        r = c.post("/v1/search", json={"query": "a dog on a beach", "k": 10,
                                       "expansion": {"method": "head", "rounds": 1, "n": 7, "keep_first": 1}})
        assert r.status_code == 200, r.text
        top = np.argsort(-(bank.vectors @ head(q)))[:7]
        moved = (head(q) + bank.vectors[top].sum(axis=0)) / 8
        _, expanded = snap.search_ids((moved / np.linalg.norm(moved))[None], 11)
        _, plain = snap.search_ids(q[None], 1)
        first = int(plain[0][0])
        assert [x["id"] for x in r.json()["results"]] == [first] + [int(i) for i in expanded[0] if i != first][:9]
        assert r.json()["expansions"] == [bank.texts[i] for i in top]
        bad = c.post("/v1/search", json={"query": "a dog", "expansion": {"method": "head", "rounds": 5}})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == ["body", "expansion"]
        r = c.post("/v1/search", json={"query": "a dog on a beach", "k": 10, "expansion": {"method": "head", "blend": 0.5}})
        assert r.status_code == 200, r.text  # a share of the head's move, still no lookup
        _, ids = snap.search_ids(head(q, 0.5)[None], 10)
        assert [x["id"] for x in r.json()["results"]] == ids[0].tolist() and "expansions" not in r.json()
        whole = c.post("/v1/search", json={"query": "a dog on a beach", "k": 10, "expansion": {"method": "head", "blend": 1}})
        assert whole.json()["results"] == same.json()["results"]  # 1 (a JSON integer too) is the whole move
        for blend in (0, 1.5, "half"):
            bad = c.post("/v1/search", json={"query": "a dog", "expansion": {"method": "head", "blend": blend}})
            assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "expansion", "blend"], bad.text


@pytest.mark.quick
def test_prf_equals_the_hand_computation(client, direct):
    enc, snap = direct
    r = client.post("/v1/search", json={"query": "a red bus", "k": 10,
                                        "expansion": {"method": "prf", "m": 4, "alpha": 1.0, "beta": 0.5}})
    assert r.status_code == 200, r.text
    q = enc.encode_text(["a red bus"])[0]
    _, top = snap.search_ids(q[None], 4)
    feedback = np.asarray(snap.vectors())[[list(snap.ids).index(i) for i in top[0]]]
    expected = q + 0.5 * feedback.mean(axis=0)
    _, ids = snap.search_ids((expected / np.linalg.norm(expected))[None], 10)
    assert [x["id"] for x in r.json()["results"]] == ids[0].tolist()


@pytest.mark.quick
def test_server_default_expansion_and_opting_out(make_settings, starter_bank):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    settings = make_settings(caption_bank=starter_bank.path, default_expansion='{"method": "bank", "n": 5}')
    with TestClient(create_app(settings)) as c:
        default = c.post("/v1/search", json={"query": "a kitchen with a stove"}).json()
        explicit = c.post("/v1/search", json={"query": "a kitchen with a stove", "expansion": {"method": "bank", "n": 5}}).json()
        plain = c.post("/v1/search", json={"query": "a kitchen with a stove", "expansion": {"method": "none"}}).json()
        assert len(default["expansions"]) == 5 and default["results"] == explicit["results"]
        assert "expansions" not in plain
    with TestClient(create_app(make_settings())) as c:
        assert c.post("/v1/search", json={"query": "a kitchen with a stove"}).json()["results"] == plain["results"]


@pytest.mark.above_the_index
def test_bank_missing_or_of_another_bundle_is_a_400(make_settings, tmp_path):
    from fastapi.testclient import TestClient

    from paraseek.paraphrase.caption_bank import CaptionBank
    from paraseek.service.main import create_app
    from tests.paraphrase.test_caption_bank import FakeEncoder

    with TestClient(create_app(make_settings())) as c:
        r = c.post("/v1/search", json={"query": "a dog", "expansion": {"method": "bank"}})
        assert r.status_code == 400 and "build-bank" in r.json()["detail"][0]["msg"]
    CaptionBank.build(FakeEncoder(), ["a cat", "a dog"], tmp_path / "fake-bank")
    with TestClient(create_app(make_settings(caption_bank=tmp_path / "fake-bank"))) as c:
        r = c.post("/v1/search", json={"query": "a dog", "expansion": {"method": "bank"}})
        assert r.status_code == 400 and r.json()["detail"][0]["loc"] == ["body", "expansion", "method"]
        assert "rebuild it with this bundle" in r.json()["detail"][0]["msg"]


def test_guard_drops_rewrites_far_from_the_query(client, direct):
    enc, snap = direct
    query = "a kid in a big automobile"
    free = client.post("/v1/search", json={"query": query, "expansion": {"method": "wordnet", "n": 4}}).json()
    rewrites = free["expansions"]
    cos = enc.encode_text(rewrites) @ enc.encode_text([query])[0]
    threshold = float(np.median(cos))
    guarded = client.post("/v1/search", json={"query": query, "expansion": {"method": "wordnet", "n": 4, "min_cos": threshold}}).json()
    kept = [t for t, c in zip(rewrites, cos) if c >= threshold]
    assert guarded["expansions"] == kept and 0 < len(kept) < len(rewrites) + 1
    expected = (enc.encode_text([query])[0] + enc.encode_text(kept).sum(axis=0)) / (len(kept) + 1)
    _, ids = snap.search_ids((expected / np.linalg.norm(expected))[None], 10)
    assert [x["id"] for x in guarded["results"]] == ids[0].tolist()


def test_consistency_under_a_vector_expansion_compares_expanded_lists(make_settings, starter_bank, direct):
    """With bank expansion, each paraphrase is expanded like the query, so the report measures the
    stability of what is served."""
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    enc, snap = direct
    query, paraphrase = "a dog lying on a couch", "a puppy resting on a sofa"
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path))) as c:
        body = c.post("/v1/search", json={"query": query, "k": 10, "expansion": {"method": "bank", "n": 6},
                                          "consistency": {"paraphrases": [paraphrase], "k": 10}}).json()
    rep = body["consistency"]
    assert rep["expansion"] == "bank"
    vq, vp = enc.encode_text([query, paraphrase])
    lists = []
    for v in (vq, vp):
        top = np.argsort(-(starter_bank.vectors @ v))[:6]
        e = (v + starter_bank.vectors[top].sum(axis=0)) / 7
        lists.append(snap.search_ids((e / np.linalg.norm(e))[None], 10)[1][0].tolist())
    assert [x["id"] for x in body["results"]] == lists[0]
    assert rep["paraphrases"][0]["ids"] == lists[1]
    assert rep["mean_ao"] == pytest.approx(_ao(lists[0], lists[1], 10))


def test_keep_first_leads_with_the_plain_query_results_then_the_expanded_order(make_settings, starter_bank, direct):
    """keep_first 2: the unexpanded query's first two results, then the bank-expanded list without them;
    pages, scores and the consistency report follow the served list."""
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    enc, snap = direct
    query, paraphrase = "a dog lying on a couch", "a puppy resting on a sofa"

    def expanded(v):
        top = np.argsort(-(starter_bank.vectors @ v))[:6]
        e = (v + starter_bank.vectors[top].sum(axis=0)) / 7
        return snap.search_ids((e / np.linalg.norm(e))[None], 20)

    def served(v):
        plain_scores, plain_ids = snap.search_ids(v[None], 2)
        exp_scores, exp_ids = expanded(v)
        head = plain_ids[0].tolist()
        rest = [(int(i), float(s)) for i, s in zip(exp_ids[0], exp_scores[0]) if int(i) not in head]
        return list(zip(head, plain_scores[0].tolist())) + rest

    vq, vp = enc.encode_text([query, paraphrase])
    want, want_paraphrase = served(vq), served(vp)
    assert [i for i, _ in want[:10]] != expanded(vq)[1][0][:10].tolist()  # the test tells the two lists apart
    expansion = {"method": "bank", "n": 6, "keep_first": 2}
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path))) as c:
        body = c.post("/v1/search", json={"query": query, "k": 10, "expansion": expansion,
                                          "consistency": {"paraphrases": [paraphrase], "k": 10}}).json()
        second_page = c.post("/v1/search", json={"query": query, "k": 5, "offset": 8, "expansion": expansion}).json()
        within = {q: c.post("/v1/search", json={"query": q, "k": 10, "expansion": {**expansion, "keep_within": 2}}).json()
                  for q in (query, paraphrase, "a red bus in a city street", "two cats on a bed")}
        bad = c.post("/v1/search", json={"query": query, "expansion": {"method": "bank", "keep_first": 11}})
    assert [x["id"] for x in body["results"]] == [i for i, _ in want[:10]]
    assert [x["score"] for x in body["results"]] == pytest.approx([s for _, s in want[:10]], abs=1e-4)
    assert [x["rank"] for x in second_page["results"]] == [9, 10, 11, 12, 13]
    assert [x["id"] for x in second_page["results"]] == [i for i, _ in want[8:13]]
    rep = body["consistency"]
    assert rep["ids"] == [i for i, _ in want[:10]] and rep["paraphrases"][0]["ids"] == [i for i, _ in want_paraphrase[:10]]
    assert rep["mean_ao"] == pytest.approx(_ao(rep["ids"], rep["paraphrases"][0]["ids"], 10))
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "expansion", "keep_first"]
    from paraseek.paraphrase.expansions import KeepFirst

    differs = []
    for q, answer in within.items():  # keep_within 2: a first result leads only if the expanded list has it in its top 2
        v = enc.encode_text([q])[0]
        plain_ids, exp_ids = snap.search_ids(v[None], 2)[1][0].tolist(), expanded(v)[1][0].tolist()
        assert [x["id"] for x in answer["results"]] == KeepFirst(2, 2).serve(plain_ids, exp_ids)[:10]
        differs.append(KeepFirst(2, 2).serve(plain_ids, exp_ids)[:10] != KeepFirst(2).serve(plain_ids, exp_ids)[:10])
    assert any(differs)  # the queries tell keep_within from keeping always


def test_keep_blend_keeps_the_first_answer_of_the_query_moved_part_way(make_settings, starter_bank, direct):
    """keep_blend b: keep_first keeps the first result (with its score) of the query moved the share b of the way
    to its expanded vector, normalise(q + b (e - q)), then the expanded order; the consistency report compares
    the lists as served. With text rewrites the report still compares the plain query's own list."""
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    enc, snap = direct
    blend = 0.5

    def expanded(v):
        top = np.argsort(-(starter_bank.vectors @ v))[:6]
        return l2_normalize((v + starter_bank.vectors[top].sum(axis=0)) / 7)

    def served(text, b):
        v = enc.encode_text([text])[0]
        e = expanded(v)
        first_scores, first_ids = snap.search_ids(l2_normalize(v + b * (e - v))[None], 1)
        exp_scores, exp_ids = snap.search_ids(e[None], 20)
        first = (int(first_ids[0][0]), float(first_scores[0][0]))
        return [first] + [(int(i), float(s)) for i, s in zip(exp_ids[0], exp_scores[0]) if int(i) != first[0]]

    queries = ["a dog lying on a couch", "a puppy resting on a sofa", "a boat on the water", "a pizza with cheese",
               "a train at a station", "two cats on a bed", "a man riding a horse", "a kitchen with a stove"]
    expansion = {"method": "bank", "n": 6, "keep_first": 1, "keep_blend": blend}
    rewrites = {"method": "wordnet", "n": 2, "keep_first": 1, "keep_blend": blend}
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path))) as c:
        answers = {q: c.post("/v1/search", json={"query": q, "k": 10, "expansion": expansion}).json() for q in queries}
        report = c.post("/v1/search", json={"query": queries[0], "k": 10, "expansion": expansion,
                                            "consistency": {"paraphrases": [queries[1]], "k": 10}}).json()["consistency"]
        rewritten = c.post("/v1/search", json={"query": "a kid in a big automobile", "k": 10, "expansion": rewrites,
                                               "consistency": {"paraphrases": ["a child in a large car"], "k": 10}}).json()
        for bad, loc in (({**expansion, "keep_blend": 1}, ["body", "expansion", "keep_blend"]),
                         ({**expansion, "keep_blend": -0.1}, ["body", "expansion", "keep_blend"]),
                         ({"method": "bank", "keep_blend": 0.3}, ["body", "expansion"]),
                         ({**rewrites, "fusion": "rrf"}, ["body", "expansion"])):
            r = c.post("/v1/search", json={"query": "x", "expansion": bad})
            assert_error_names(r, loc, whole=True)
            assert "keep_blend" in r.text
    for q in queries:
        want = served(q, blend)[:10]
        assert [x["id"] for x in answers[q]["results"]] == [i for i, _ in want], q
        assert [x["score"] for x in answers[q]["results"]] == pytest.approx([s for _, s in want], abs=1e-4)
    assert any(served(q, blend)[0][0] != served(q, 0)[0][0] for q in queries)  # the blend moves first answers here
    assert report["ids"] == [i for i, _ in served(queries[0], blend)[:10]]
    assert report["paraphrases"][0]["ids"] == [i for i, _ in served(queries[1], blend)[:10]]
    # text rewrites: the list leads with the moved query's first answer, the report reads the plain query's list
    v = enc.encode_text(["a kid in a big automobile"])[0]
    main = l2_normalize(enc.encode_text(["a kid in a big automobile", *rewritten["expansions"]]).mean(axis=0))
    _, first = snap.search_ids(l2_normalize(v + blend * (main - v))[None], 1)
    assert rewritten["results"][0]["id"] == int(first[0][0])
    assert rewritten["consistency"]["ids"] == snap.search_ids(v[None], 10)[1][0].tolist()


def test_lead_margin_puts_the_first_answer_towers_sure_answer_on_top(make_settings, starter_bank, direct,
                                                                    whole_photo_robust_bundle):
    """lead_margin: where the first-answer tower (another tower of the served image space) scores its first
    image above its second by more than the margin, that image leads the list the request would get
    otherwise, with that tower's score; elsewhere the list is unchanged. The consistency report compares
    the lists as served; a server without such a tower refuses the field."""
    from fastapi.testclient import TestClient

    from paraseek.paraphrase.expansions import ConfidentLead, KeepFirst
    from paraseek.service.main import create_app

    enc, snap = direct
    lead_enc = Encoder(whole_photo_robust_bundle)
    margin = 0.02

    def served(text, keep):
        v = enc.encode_text([text])[0]
        top = np.argsort(-(starter_bank.vectors @ v))[:6]
        e = (v + starter_bank.vectors[top].sum(axis=0)) / 7
        exp_scores, exp_ids = snap.search_ids((e / np.linalg.norm(e))[None], 20)
        plain_scores, plain_ids = snap.search_ids(v[None], 1)
        score = dict(zip(exp_ids[0].tolist(), exp_scores[0].tolist()))
        if keep:  # a kept first answer shows the plain query's score
            score[int(plain_ids[0][0])] = float(plain_scores[0][0])
        kept = keep.serve(plain_ids[0], exp_ids[0])
        lead_scores, lead_ids = snap.search_ids(lead_enc.encode_text([text]), 2)
        led = ConfidentLead(margin).leads(lead_ids[0], lead_scores[0])
        if led:
            score[int(lead_ids[0][0])] = float(lead_scores[0][0])
        listed = ConfidentLead(margin).serve(kept, lead_ids[0], lead_scores[0])
        return [(i, score[i]) for i in listed], led, listed[:10] != kept[:10]

    queries = ["a dog lying on a couch", "a puppy resting on a sofa", "a boat on the water", "a pizza with cheese",
               "a train at a station", "a kitchen", "a giraffe eating leaves", "two cats on a bed"]
    expansion = {"method": "bank", "n": 6, "lead_margin": margin}
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path,
                                             first_answer_bundle=whole_photo_robust_bundle))) as c:
        answers = {(q, keep): c.post("/v1/search", json={"query": q, "k": 10, "expansion": {**expansion, "keep_first": keep}})
                   .json() for q in queries for keep in (0, 1)}
        report = c.post("/v1/search", json={"query": queries[0], "k": 10, "expansion": expansion,
                                            "consistency": {"paraphrases": [queries[1]], "k": 10}}).json()["consistency"]
        info = c.get("/v1/info").json()
        for bad in (-0.1, "0.1", 3):
            assert_error_names(c.post("/v1/search", json={"query": "x", "expansion": {**expansion, "lead_margin": bad}}),
                               ["body", "expansion", "lead_margin"])
    led, changed = [], []
    for (q, keep), body in answers.items():
        want, did_lead, did_change = served(q, KeepFirst(keep))
        assert [x["id"] for x in body["results"]] == [i for i, _ in want[:10]], (q, keep)
        assert [x["score"] for x in body["results"]] == pytest.approx([s for _, s in want[:10]], abs=1e-4)
        led.append(did_lead)
        changed.append(did_change)
    assert any(changed) and not all(led)  # the queries tell a lead from none, and a lead that moves the list
    assert report["ids"] == [i for i, _ in served(queries[0], KeepFirst())[0][:10]]
    assert report["paraphrases"][0]["ids"] == [i for i, _ in served(queries[1], KeepFirst())[0][:10]]
    assert info["first_answer"]["name"] == "paraseek-starter-robust"
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path))) as c:  # no first-answer tower here
        assert_error_names(c.post("/v1/search", json={"query": "x", "expansion": expansion}),
                           ["body", "expansion", "lead_margin"], status=400)
        assert c.get("/v1/info").json()["first_answer"] is None


def test_hub_weight_orders_each_list_by_score_less_the_images_hubness(make_settings, starter_bank, direct,
                                                                     whole_photo_robust_bundle):
    """hub_weight: the query's and the expanded query's first 100 results ordered by score less the weight times
    each image's hubness against the caption bank, then kept as the request says; scores are the corrected
    ones, and the consistency report compares the corrected lists. A first-answer tower's lead keeps that
    tower's own scores (the bank's hubness is the served tower's). Without a caption bank the field is refused."""
    from fastapi.testclient import TestClient

    from paraseek.paraphrase.expansions import KeepFirst
    from paraseek.service.main import create_app

    enc, snap = direct
    bias = dict(zip(np.asarray(snap.ids).tolist(), starter_bank.hub_bias(np.asarray(snap.vectors())).tolist()))
    weight = 0.5

    def corrected(v):
        scores, ids = snap.search_ids(v[None], 100)
        pairs = [(int(i), float(s) - weight * bias[int(i)]) for i, s in zip(ids[0], scores[0]) if i >= 0]
        return sorted(pairs, key=lambda p: -p[1])

    def served(text, keep):
        v = enc.encode_text([text])[0]
        top = np.argsort(-(starter_bank.vectors @ v))[:6]
        e = (v + starter_bank.vectors[top].sum(axis=0)) / 7
        plain, expanded = corrected(v), corrected(e / np.linalg.norm(e))
        score = dict(expanded) | dict(plain[: keep.n])
        return [(i, score[i]) for i in keep.serve([i for i, _ in plain], [i for i, _ in expanded])]

    queries = ["a dog lying on a couch", "a puppy resting on a sofa", "a boat on the water", "a pizza with cheese",
               "a train at a station", "two cats on a bed"]
    expansion = {"method": "bank", "n": 6, "keep_first": 1, "keep_within": 3}
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path,
                                             first_answer_bundle=whole_photo_robust_bundle))) as c:
        answers = {(q, w): c.post("/v1/search", json={"query": q, "k": 10, "expansion": {**expansion, "hub_weight": w}})
                   .json() for q in queries for w in (0, weight)}
        led = c.post("/v1/search", json={"query": queries[2], "k": 10,
                                         "expansion": {**expansion, "hub_weight": weight, "lead_margin": 0}}).json()
        alone = c.post("/v1/search", json={"query": queries[3], "k": 10,  # method none: the correction alone
                                           "expansion": {"method": "none", "hub_weight": weight}}).json()
        report = c.post("/v1/search", json={"query": queries[0], "k": 10, "expansion": {**expansion, "hub_weight": weight},
                                            "consistency": {"paraphrases": [queries[1]], "k": 10}}).json()["consistency"]
        for bad in (-0.1, 3, "0.5"):
            assert_error_names(c.post("/v1/search", json={"query": "x", "expansion": {**expansion, "hub_weight": bad}}),
                               ["body", "expansion", "hub_weight"])
    changed = []
    for q in queries:
        want = served(q, KeepFirst(1, 3))
        body = answers[(q, weight)]
        assert [x["id"] for x in body["results"]] == [i for i, _ in want[:10]], q
        assert [x["score"] for x in body["results"]] == pytest.approx([s for _, s in want[:10]], abs=1e-4)
        changed.append([x["id"] for x in body["results"]] != [x["id"] for x in answers[(q, 0)]["results"]])
    assert any(changed)  # the weight moves lists here
    lead_scores, lead_ids = snap.search_ids(Encoder(whole_photo_robust_bundle).encode_text([queries[2]]), 1)
    rest = [(i, s) for i, s in served(queries[2], KeepFirst(1, 3)) if i != int(lead_ids[0][0])]
    want_alone = corrected(enc.encode_text([queries[3]])[0])[:10]
    assert [(x["id"], x["score"]) for x in alone["results"]] == [(i, pytest.approx(sc, abs=1e-4)) for i, sc in want_alone]
    want_led = [(int(lead_ids[0][0]), float(lead_scores[0][0]))] + rest[:9]  # the lead's raw score, then corrected ones
    assert [x["id"] for x in led["results"]] == [i for i, _ in want_led]
    assert [x["score"] for x in led["results"]] == pytest.approx([sc for _, sc in want_led], abs=1e-4)
    assert report["ids"] == [i for i, _ in served(queries[0], KeepFirst(1, 3))[:10]]
    assert report["paraphrases"][0]["ids"] == [i for i, _ in served(queries[1], KeepFirst(1, 3))[:10]]
    with TestClient(create_app(make_settings())) as c:  # no caption bank here
        assert_error_names(c.post("/v1/search", json={"query": "x", "expansion": {"method": "prf", "hub_weight": weight}}),
                           ["body", "expansion", "hub_weight"], status=400)


def test_a_default_hub_weight_builds_the_versions_hub_table_at_start(make_settings, starter_bank, direct):
    """A server whose default expansion has a hub_weight computes every image's hubness once, on a thread at
    start, and writes it under PARASEEK_HOME; the lists it serves are the ones per-image hubness gives."""
    import time

    from fastapi.testclient import TestClient

    from paraseek.paraphrase.hub_table import HubTable
    from paraseek.service.main import create_app

    _, snap = direct
    want = dict(zip(np.asarray(snap.ids).tolist(), starter_bank.hub_bias(np.asarray(snap.vectors())).tolist()))
    expansion = '{"method": "none", "hub_weight": 0.5}'
    settings = make_settings(caption_bank=starter_bank.path, default_expansion=expansion)
    folder = settings.home / "hub-tables"
    with TestClient(create_app(settings)) as c:
        deadline = time.time() + 60
        while c.get("/readyz").status_code != 200 or not list(folder.glob("*.npz")):
            assert time.time() < deadline, "no hub table within 60 s"
            time.sleep(0.1)
        served = c.post("/v1/search", json={"query": "a dog lying on a couch", "k": 10}).json()["results"]
    [path] = folder.glob("*.npz")
    table = HubTable.load(path, len(want))
    assert table is not None and table.ids.tolist() == sorted(want)
    np.testing.assert_allclose(table.bias, [want[i] for i in sorted(want)], rtol=1e-5)
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path))) as c:  # no default: per image
        again = c.post("/v1/search", json={"query": "a dog lying on a couch", "k": 10,
                                           "expansion": {"method": "none", "hub_weight": 0.5}}).json()["results"]
    assert [r["id"] for r in served] == [r["id"] for r in again]
    assert [r["score"] for r in served] == pytest.approx([r["score"] for r in again], abs=1e-5)


@pytest.mark.above_the_index
def test_a_first_answer_bundle_built_beside_the_server_is_served_once_in_place(make_settings, starter_bank,
                                                                              whole_photo_robust_bundle, tmp_path):
    """A first start's server answers before its first-answer bundle is built (``paraseek serve`` builds it
    in another process) and serves it once the build has moved it into place whole: /v1/info names it, and
    a request's lead_margin, refused before, is answered."""
    import os
    import shutil
    import time

    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    pending = tmp_path / "bundles" / "starter"
    lead = {"query": "a puppy resting on a sofa", "k": 3, "expansion": {"method": "bank", "n": 6, "lead_margin": 0.05}}
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path), first_answer_pending=pending)) as c:
        assert c.post("/v1/search", json={"query": "a dog on a couch", "k": 3}).status_code == 200
        assert c.get("/v1/info").json()["first_answer"] is None
        assert_error_names(c.post("/v1/search", json=lead), ["body", "expansion", "lead_margin"], status=400)
        shutil.copytree(whole_photo_robust_bundle, tmp_path / "staging")
        pending.parent.mkdir()
        os.replace(tmp_path / "staging", pending)
        deadline = time.monotonic() + 60
        while c.get("/v1/info").json()["first_answer"] is None:
            assert time.monotonic() < deadline, "the first-answer bundle was not served"
            time.sleep(0.2)
        assert c.get("/v1/info").json()["first_answer"]["name"] == "paraseek-starter-robust"
        assert c.post("/v1/search", json=lead).status_code == 200


def test_a_first_answer_bundle_of_another_image_space_is_refused_at_load(make_settings, tiny_clip):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    app = create_app(make_settings(first_answer_bundle=tiny_clip[0]))
    with TestClient(app) as c:
        assert c.get("/readyz").status_code == 503
    assert app.state.engine.load_error.startswith("BundleError")


@pytest.mark.above_the_index
@pytest.mark.quick
def test_strict_types_and_the_query_or_terms_rule_in_the_schema(client):
    for body, loc in (({"query": "x", "k": "5"}, ["body", "k"]), ({"query": "x", "k": True}, ["body", "k"]),
                      ({"terms": [{"text": "a dog", "weight": False}]}, ["body", "terms", 0, "weight"]),
                      ({"query": "x", "expansion": {"method": "wordnet", "n": "2"}}, ["body", "expansion", "n"])):
        r = client.post("/v1/search", json=body)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc, (body, r.text)
    assert client.post("/v1/search", json={"terms": [{"text": "a dog", "weight": 2}]}).status_code == 200  # ints are numbers
    schema = client.get("/openapi.json").json()
    request = schema["components"]["schemas"]["SearchRequest"]
    assert request["anyOf"] == [{"required": ["query"]}, {"required": ["terms"]}]
    search = schema["paths"]["/v1/search"]["post"]["responses"]
    assert {"200", "400", "413", "422", "502", "503"} <= set(search)
    admin = schema["paths"]["/v1/admin/reindex"]["post"]["responses"]
    assert {"202", "401", "403", "404", "422"} <= set(admin)


@pytest.mark.quick
def test_merged_index_searches_answer_each_request_as_if_alone(make_settings, direct):
    """Concurrent requests of different k (and offsets, and image queries) share index calls; each
    still gets exactly its own top k."""
    from paraseek.service.main import create_app

    app = create_app(make_settings(lru_size=0, max_wait_ms=20))
    engine = app.state.engine
    queries = [("a plate of food", 1), ("a red bus", 5), ("two dogs in the snow", 20), ("a kitchen", 3),
               ("people on a beach", 12), ("a cat on a sofa", 7)] * 2

    async def go():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return await asyncio.gather(*(c.post("/v1/search", json={"query": q, "k": k, "expansion": {"method": "none"}})
                                              for q, k in queries))

    responses = asyncio.run(go())
    enc, snap = direct
    for (q, k), r in zip(queries, responses):
        assert r.status_code == 200
        _, ids = snap.search_ids(enc.encode_text([q]), k)
        assert [x["id"] for x in r.json()["results"]] == ids[0].tolist()
    searches = {s.name.rsplit("_", 1)[1]: s.value for m in engine.metrics.index_batch_size.collect() for s in m.samples
                if s.name.endswith(("_count", "_sum"))}
    assert searches["count"] < len(queries)  # some of them did share a call


@pytest.mark.quick
def test_a_lone_request_encodes_and_searches_in_one_call_on_the_index_thread(make_settings, direct):
    """The only request in flight skips the hop between the stages: its encoder call runs on the
    index's thread, right before its search. With another request in flight it goes through the
    encoder stage (where it could merge with others). Both ways give the same answer."""
    import threading

    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    body = {"query": "a man riding a wave on a surfboard", "k": 8, "expansion": {"method": "none"},
            "consistency": {"paraphrases": ["a surfer on a wave"], "k": 8}}
    with TestClient(create_app(make_settings(lru_size=0))) as client:  # no cache: both requests encode
        engine = client.app.state.engine
        encoder = engine.require_active().encoder
        threads: list[str] = []
        encode = encoder.encode_text_detailed

        def recording_encode(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return encode(*args, **kwargs)

        encoder.encode_text_detailed = recording_encode
        alone = client.post("/v1/search", json=body).json()
        engine.in_flight += 1  # another request being answered
        beside = client.post("/v1/search", json={**body, "k": 7}).json()
        engine.in_flight -= 1
    assert threads[0].startswith("index") and threads[1].startswith("encoder")
    assert [r["id"] for r in alone["results"]][:7] == [r["id"] for r in beside["results"]]
    assert alone["consistency"]["paraphrases"][0]["ids"] == beside["consistency"]["paraphrases"][0]["ids"]
    enc, snap = direct
    _, ids = snap.search_ids(enc.encode_text([body["query"]]), 8)
    assert [r["id"] for r in alone["results"]] == ids[0].tolist()


def test_a_cheap_lone_request_runs_on_the_event_loop_once_its_calls_are_known_to_be_cheap(make_settings, direct, backend):
    """The first lone request for what is served runs on the index's thread and is timed; the next ones
    run on the event loop's thread while lone calls stay under PARASEEK_ALONE_ON_EVENT_LOOP_MS, and go
    back to the thread past it, with it 0, or while a call still runs on a batcher's thread. The
    answers are the same either way. Milvus searches wait on a socket: never on the event loop."""
    import asyncio
    import threading

    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    def where() -> str:
        try:
            asyncio.get_running_loop()
            return "loop"
        except RuntimeError:
            return threading.current_thread().name.split("_")[0]

    def run(limit_ms: float, busy: bool = False) -> tuple[list[str], list[list[int]]]:
        with TestClient(create_app(make_settings(lru_size=0, alone_on_event_loop_ms=limit_ms))) as client:
            engine = client.app.state.engine
            encoder = engine.require_active().encoder
            seen: list[str] = []
            encode = encoder.encode_text_detailed

            def recording_encode(*args, **kwargs):
                seen.append(where())
                return encode(*args, **kwargs)

            encoder.encode_text_detailed = recording_encode
            if busy:  # as if a request that timed out left its call on the encoder's thread
                engine.encoder_batcher._on_threads += 1
            answers = [client.post("/v1/search", json={"query": q, "k": 6, "expansion": {"method": "none"}}).json()
                       for q in ("a dog on a sofa", "a red double decker bus", "a plate of pasta")]
        return seen, [[r["id"] for r in a["results"]] for a in answers]

    seen, ids = run(60_000)  # far above any call's time, on a CI machine under load too (1 s was not)
    assert seen == (["index", "loop", "loop"] if backend == "faiss" else ["index"] * 3)
    enc, snap = direct
    for q, got in zip(("a dog on a sofa", "a red double decker bus", "a plate of pasta"), ids):
        assert got == snap.search_ids(enc.encode_text([q]), 6)[1][0].tolist()
    assert run(0)[0] == ["index"] * 3
    assert run(1e-6)[0] == ["index"] * 3  # the calls take longer than that
    assert run(60_000, busy=True)[0] == ["index"] * 3


@pytest.mark.quick
def test_requests_arriving_together_are_batched_not_run_one_by_one_on_the_event_loop(make_settings, backend):
    """Requests read in one pass of the event loop start their tasks one after another: the first is
    briefly the only one in flight. It must not take the event loop (each next one would find itself
    alone too, and the requests would run one at a time): at most one of them runs there, and the
    rest share encoder calls."""
    import asyncio

    from paraseek.service.main import create_app

    # a limit no lone call reaches, even on a loaded CI machine (at 1 s a cold first call once did, and
    # the second lone request rightly stayed off the event loop)
    app = create_app(make_settings(lru_size=0, alone_on_event_loop_ms=60_000))
    engine = app.state.engine
    on_loop: list[bool] = []

    async def go():
        async with app.router.lifespan_context(app):
            encoder = engine.require_active().encoder
            encode = encoder.encode_text_detailed

            def recording_encode(*args, **kwargs):
                try:
                    asyncio.get_running_loop()
                    on_loop.append(True)
                except RuntimeError:
                    on_loop.append(False)
                return encode(*args, **kwargs)

            encoder.encode_text_detailed = recording_encode
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                async def one(q: str):
                    return await c.post("/v1/search", json={"query": q, "k": 5, "expansion": {"method": "none"}})

                for q in ("a dog", "a cat"):  # lone requests: the second runs on the event loop (FAISS)
                    assert (await one(q)).status_code == 200
                return await asyncio.gather(*(one(f"a photo of a bus number {i}") for i in range(12)))

    responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses)
    assert on_loop[:2] == [False, backend == "faiss"]
    together = on_loop[2:]
    assert sum(together) <= 1 and len(together) < 12  # merged calls: fewer calls than requests


def test_a_search_that_waits_on_the_network_never_runs_on_the_event_loop(tmp_path):
    """Milvus answers over a socket: however fast its lone searches were, they stay off the event loop."""
    import gc
    import weakref
    from types import SimpleNamespace

    from paraseek.core.settings import Settings
    from paraseek.service.engine import SearchEngine
    from paraseek.service.prometheus import ServiceMetrics
    from paraseek.service.runtime import Active

    engine = SearchEngine(Settings(home=tmp_path), ServiceMetrics())
    engine.in_flight = 1
    for backend, on_loop in (("faiss", True), ("milvus", False)):
        active = Active(SimpleNamespace(), SimpleNamespace(backend=backend))
        engine._lone_call_took(active, 2.0)
        assert engine._alone_on_event_loop(active) is on_loop
        assert not engine._alone_on_event_loop(Active(SimpleNamespace(), SimpleNamespace(backend=backend)))  # another one
    served = weakref.ref(active)
    del active
    gc.collect()
    assert served() is None  # the timing does not keep a replaced encoder and snapshot alive


@pytest.mark.quick
def test_a_lone_request_searches_on_every_core_and_one_beside_others_on_one(make_settings):
    """A lone request's search runs after its encoder call has left every core idle, so it gets them
    all (an exact scan splits among them); a one-row search while others are in flight gets
    PARASEEK_FAISS_THREADS."""
    import os

    from fastapi.testclient import TestClient

    from paraseek.index.faiss_index import search_threads
    from paraseek.service.main import create_app

    with TestClient(create_app(make_settings(lru_size=0, faiss_threads=1))) as client:
        engine = client.app.state.engine
        snapshot = engine.require_active().snapshot
        seen: list[tuple[int, int]] = []
        search = snapshot.search_ids

        def recording_search(queries, k):
            seen.append((len(queries), search_threads()))
            return search(queries, k)

        snapshot.search_ids = recording_search
        assert client.post("/v1/search", json={"query": "a dog on a sofa", "expansion": {"method": "none"}}).status_code == 200
        engine.in_flight += 1  # another request being answered
        assert client.post("/v1/search", json={"query": "a cat on a sofa", "expansion": {"method": "none"}}).status_code == 200
        engine.in_flight -= 1
    assert seen == [(1, os.cpu_count()), (1, 1)]


@pytest.mark.quick
def test_metrics_the_dashboard_reads(client):
    """Stage times per stage, consistency reports, the serving snapshot, the breaker and the process."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[tuple[str, tuple], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}

    before = samples()
    r = client.post("/v1/search", json={"query": "a man riding a horse", "k": 5, "expansion": {"method": "prf", "m": 3},
                                        "consistency": {"paraphrases": ["a person on horseback"], "k": 5}})
    assert r.status_code == 200, r.text
    report = r.json()["consistency"]
    after = samples()

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    for stage in ("encode", "expand", "search", "fusion", "consistency"):
        assert grew("paraseek_stage_seconds_count", stage=stage) == 1, stage
    assert grew("paraseek_stage_seconds_count", stage="paraphrase") == 0  # no text was generated
    # prf's top-images lookup and the search itself each waited in the index batcher's queue
    assert grew("paraseek_batch_wait_seconds_count", stage="index") == 2
    assert grew("paraseek_consistency_mean_ao_count") == 1 and grew("paraseek_consistency_mean_ao_sum") == pytest.approx(report["mean_ao"])
    assert grew("paraseek_consistency_reports_total", stable=str(report["stable"]).lower()) == 1
    info = [labels for (name, labels), v in after.items() if name == "paraseek_snapshot_info" and v == 1]
    assert len(info) == 1 and dict(info[0])["version"] == r.json()["snapshot_version"]
    assert after[("paraseek_cache_breaker_state", ())] == 0.0
    assert after[("process_resident_memory_bytes", ())] > 10e6
    assert after[("paraseek_reindex_total", (("result", "failed"),))] == 0.0  # exported before the first job


@pytest.mark.parametrize("starter, head, method, n, rounds, within, blend, hub, lead", [
    ("robust", False, "bank", 96, 4, 7, 0.25, 0.75, False), ("robust", True, "bank", 96, 4, 7, 0.25, 0.75, False),
    ("robust", False, "bank", 96, 4, 7, 0.25, 0.75, True),
    ("plain", True, "head", 3, 0, 0, 0.3, 0.5, False), ("plain", False, "bank", 30, 1, 0, 0.0, 0.0, False)])
@pytest.mark.quick
def test_the_embedded_default_expansion_keeps_the_first_answer(starter, head, method, n, rounds, within, blend, hub,
                                                               lead, make_settings, starter_bank, starter_bundle, tmp_path):
    """Each starter's default is a valid request expansion that keeps the query's first result, and the
    server applies it when a request names none. The plain starter's is its bank's head, where the bank
    has one (the default bank gets the shipped one), its first answer the query's moved 0.3 of the way to
    the head's output; else one round of 30 bank captions. The robust starter's corrects hubs and keeps the
    first answer of its query moved 0.25 of the way within 7; where the plain starter is built it is the
    first-answer bundle, and the default stays the same (no lead_margin)."""
    import shutil

    from fastapi.testclient import TestClient

    from paraseek.paraphrase.caption_bank import CaptionBank
    from paraseek.service.main import create_app
    from paraseek.service.schemas import Expansion
    from paraseek.training.embedded import with_embedded_defaults
    from tests.paraphrase.test_query_head import random_head

    bank = starter_bank.path
    if head:
        bank = tmp_path / "bank"
        shutil.copytree(starter_bank.path, bank)
        CaptionBank.read(bank).with_head(random_head(dim=starter_bank.manifest.dim, hidden=16, scale=0.1))
    settings = make_settings(starter=starter, caption_bank=bank)
    if lead:  # a first start built the plain starter beside the robust one
        shutil.copytree(starter_bundle, settings.plain_starter_bundle_dir)
    settings = with_embedded_defaults(settings)
    expansion = Expansion.model_validate_json(settings.default_expansion)
    assert (expansion.method, expansion.n, expansion.rounds, expansion.keep_first, expansion.keep_within,
            expansion.keep_blend, expansion.hub_weight) == (method, n, rounds, 1, within, blend, hub)
    assert (expansion.lead_margin, settings.first_answer_bundle) == \
        (None, settings.plain_starter_bundle_dir if lead else None)
    with TestClient(create_app(settings)) as c:
        default = c.post("/v1/search", json={"query": "a kitchen with a stove"}).json()
        explicit = c.post("/v1/search", json={"query": "a kitchen with a stove",
                                              "expansion": expansion.model_dump()}).json()
        # the list whose first answer is kept always (no keep_within; keep_within's own test decides per query):
        # the query's own, or (keep_blend) the query moved that share of the way to the head's output, each
        # hub-corrected as the default is
        kept_query = {"method": "none"} if not blend else {"method": "head", "blend": blend}
        if not within:
            plain = c.post("/v1/search", json={"query": "a kitchen with a stove", "expansion":
                                               {**kept_query, "hub_weight": hub} if hub else kept_query}).json()
            assert default["results"][0]["id"] == plain["results"][0]["id"]
    assert default["results"] == explicit["results"]
