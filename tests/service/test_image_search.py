"""Image queries (upload, base64, more like this), paging, and the OpenAI-compatible embeddings route."""

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from paraseek.core.demo import GALLERY_DIR
from paraseek.core.encoder import Encoder
from paraseek.index.snapshot import Snapshot
from tests.service.conftest import assert_error_names

# every test that serves a snapshot in-process runs on FAISS and on the same snapshot copied into Milvus Lite
BOTH_BACKENDS = True
ON_MILVUS_SERVER = True  # and on a real Milvus 2.3.5 standalone server (the run's shared one)

PHOTO_ID = 790
PHOTO = GALLERY_DIR / "000000000790.jpg"


@pytest.fixture()
def direct(starter_bundle, demo_snapshot):
    return Encoder(starter_bundle), Snapshot.load(demo_snapshot)


def _ids(response) -> list[int]:
    return [r["id"] for r in response.json()["results"]]


@pytest.mark.quick
def test_uploaded_image_finds_itself_and_matches_the_image_tower(client, direct):
    data = PHOTO.read_bytes()
    r = client.post("/v1/search/image", files={"image": ("photo.jpg", data, "image/jpeg")}, data={"k": "5"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["results"][0]["id"] == PHOTO_ID and body["results"][0]["score"] == pytest.approx(1.0, abs=1e-4)
    enc, snap = direct
    with Image.open(PHOTO) as im:
        _, expected = snap.search_ids(enc.encode_images([im]), 5)
    assert _ids(r) == expected[0].tolist()
    # the same file as base64 JSON, and as a data URL, gives the same list
    b64 = base64.b64encode(data).decode()
    assert _ids(client.post("/v1/search/image", json={"image": b64, "k": 5})) == _ids(r)
    assert _ids(client.post("/v1/search/image", json={"image": "data:image/jpeg;base64," + b64, "k": 5})) == _ids(r)


@pytest.mark.quick
def test_more_like_this_uses_the_stored_vector_and_leaves_the_image_out(client, direct):
    r = client.post("/v1/search/similar", json={"id": PHOTO_ID, "k": 4})
    assert r.status_code == 200
    _, snap = direct
    _, expected = snap.search_ids(snap.vectors_of([PHOTO_ID]), 5)
    assert _ids(r) == [i for i in expected[0].tolist() if i != PHOTO_ID][:4]
    with_self = client.post("/v1/search/similar", json={"id": PHOTO_ID, "k": 4, "include_self": True})
    assert _ids(with_self)[0] == PHOTO_ID
    missing = client.post("/v1/search/similar", json={"id": 1, "k": 4})
    assert missing.status_code == 404 and missing.json()["detail"][0]["loc"] == ["body", "id"]


@pytest.mark.quick
def test_pages_continue_the_ranking(client):
    full = client.post("/v1/search", json={"query": "a dog", "k": 12}).json()["results"]
    page2 = client.post("/v1/search", json={"query": "a dog", "k": 4, "offset": 4}).json()["results"]
    assert [(r["id"], r["rank"]) for r in page2] == [(r["id"], r["rank"]) for r in full[4:8]]
    image_page = client.post("/v1/search/image", json={"image": base64.b64encode(PHOTO.read_bytes()).decode(),
                                                       "k": 3, "offset": 1}).json()["results"]
    assert image_page[0]["rank"] == 2 and PHOTO_ID not in [r["id"] for r in image_page]
    r = client.post("/v1/search", json={"query": "a dog", "k": 600, "offset": 600})
    assert r.status_code == 422 and "offset + k" in r.text


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares a huge canvas but holds almost no data (a decompression bomb's shape)."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


BAD_UPLOADS = [  # (files, form data, JSON body, status, loc)
    ({"image": ("notes.txt", b"just some text", "text/plain")}, None, None, 422, ["body", "image"]),
    ({"image": ("empty.jpg", b"", "image/jpeg")}, None, None, 422, ["body", "image"]),
    ({"image": ("bomb.png", _png_header_only(30000, 30000), "image/png")}, None, None, 413, ["body", "image"]),
    ({"picture": ("x.jpg", b"x", "image/jpeg")}, None, None, 422, ["body", "image"]),
    ({"image": ("x.jpg", b"x", "image/jpeg")}, {"k": "ten"}, None, 422, ["body", "k"]),
    ({"image": ("x.jpg", b"x", "image/jpeg")}, {"k": "0"}, None, 422, ["body", "k"]),
    # a field sent twice is ambiguous (schemathesis's negative fuzzing sent k as an array)
    ({"image": ("x.jpg", b"x", "image/jpeg")}, {"k": ["3", "5"]}, None, 422, ["body", "k"]),
    ({"image": ("x.jpg", b"x", "image/jpeg")}, {"filter": ["{}", "{}"]}, None, 422, ["body", "filter"]),
    (None, None, {"image": "not base64!"}, 422, ["body", "image"]),
    (None, None, {"image": "aGVsbG8=", "k": 5, "colour": "red"}, 422, ["body", "colour"]),
    (None, None, {"k": 5}, 422, ["body", "image"]),
]


@pytest.mark.above_the_index
@pytest.mark.quick
def test_bad_uploads_name_the_field(client, subtests):
    for case, (files, data, json, status, loc) in enumerate(BAD_UPLOADS):
        with subtests.test(case=case):
            assert_error_names(client.post("/v1/search/image", files=files, data=data, json=json), loc, status, whole=True)


@pytest.mark.above_the_index
def test_upload_limits(make_settings):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    big = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 300, 3), dtype=np.uint8)).save(big, "PNG")
    with TestClient(create_app(make_settings(max_upload_bytes=64 * 1024, max_image_pixels=200 * 200))) as c:
        too_big = c.post("/v1/search/image", files={"image": ("big.png", big.getvalue(), "image/png")})
        assert too_big.status_code == 413  # 270 KB over the 64 KB upload limit
        small = io.BytesIO()
        Image.fromarray(np.zeros((250, 250, 3), np.uint8)).save(small, "PNG")
        too_many_pixels = c.post("/v1/search/image", files={"image": ("s.png", small.getvalue(), "image/png")})
        assert too_many_pixels.status_code == 413 and "62500 pixels" in too_many_pixels.json()["detail"][0]["msg"]
        # the text routes keep their own (smaller) limit
        assert c.post("/v1/search", content=b'{"query": "' + b"a" * 300_000 + b'"}',
                      headers={"content-type": "application/json"}).status_code == 413
    with TestClient(create_app(make_settings())) as c:
        wrong_type = c.post("/v1/search/image", content=b"abc", headers={"content-type": "text/plain"})
        assert wrong_type.status_code == 415


@pytest.mark.above_the_index
def test_embeddings_match_the_encoder_and_decode_from_base64(client, direct):
    enc, _ = direct
    models = client.get("/v1/models").json()
    name = models["data"][0]["id"]
    assert name == enc.name and models["data"][0]["dimensions"] == enc.dim
    texts = ["a cat on a mat", "two dogs playing in the snow"]
    r = client.post("/v1/embeddings", json={"input": texts, "model": name})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["model"] == name
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    expected = enc.encode_text(texts)
    np.testing.assert_allclose(np.array([d["embedding"] for d in body["data"]]), expected, atol=1e-5)
    tokens = int(enc.tokenize(texts).attention_mask.sum())
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # base64 is what OpenAI's clients ask for by default: little-endian float32
    b = client.post("/v1/embeddings", json={"input": texts[0], "model": name, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[0], atol=1e-5)


BAD_EMBEDDING_BODIES = [  # (body, status, loc)
    ({"input": "a cat", "model": "text-embedding-3-small"}, 404, ["body", "model"]),
    ({"input": [1, 2, 3], "model": "paraseek-starter"}, 422, ["body", "input"]),
    ({"input": [], "model": "paraseek-starter"}, 422, ["body", "input"]),
    ({"input": ["ok", " "], "model": "paraseek-starter"}, 422, ["body", "input", 1]),
    ({"input": "a cat", "model": "paraseek-starter", "encoding_format": "hex"}, 422, ["body", "encoding_format"]),
    ({"input": "a cat", "model": "paraseek-starter", "dimensions": 7}, 422, ["body", "dimensions"]),
    ({"input": "a" * 1001, "model": "paraseek-starter"}, 422, ["body", "input", 0]),
    ({"model": "paraseek-starter"}, 422, ["body", "input"]),
]


@pytest.mark.above_the_index
@pytest.mark.quick
def test_embeddings_bad_input_names_the_field(client, subtests):
    for case, (body, status, loc) in enumerate(BAD_EMBEDDING_BODIES):
        with subtests.test(case=case):
            assert_error_names(client.post("/v1/embeddings", json=body), loc, status)


@pytest.mark.above_the_index
def test_embeddings_by_the_first_answer_tower_when_named(make_settings, whole_photo_robust_bundle, direct):
    """A server with a first-answer bundle lists it after the served one and embeds with it by name, so the
    plain starter's sentence embeddings stay a call away beside a robust ranking. Each tower's vectors are
    its own, the cache keeping them apart; an unknown name is a 404 naming both."""
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    enc, _ = direct
    lead = Encoder(whole_photo_robust_bundle)
    assert lead.name != enc.name
    texts = ["a dog lying on a couch", "a boat on the water"]
    with TestClient(create_app(make_settings(first_answer_bundle=whole_photo_robust_bundle))) as c:
        models = c.get("/v1/models").json()["data"]
        embedded = {name: c.post("/v1/embeddings", json={"input": texts, "model": name}).json()
                    for name in (lead.name, enc.name, f"{lead.name}:{lead.version}")}  # the served tower after the other's
        unknown = c.post("/v1/embeddings", json={"input": texts, "model": "text-embedding-3-small"})
    assert [(m["id"], m["role"], m["dimensions"]) for m in models] == [(enc.name, "served", enc.dim),
                                                                       (lead.name, "first_answer", lead.dim)]
    for name, tower in ((lead.name, lead), (enc.name, enc), (f"{lead.name}:{lead.version}", lead)):
        body = embedded[name]
        assert body["model"] == tower.name
        np.testing.assert_allclose(np.array([d["embedding"] for d in body["data"]]), tower.encode_text(texts), atol=1e-5)
        assert body["usage"]["prompt_tokens"] == int(tower.tokenize(texts).attention_mask.sum())
    assert not np.allclose([d["embedding"] for d in embedded[enc.name]["data"]],
                           [d["embedding"] for d in embedded[lead.name]["data"]], atol=1e-3)  # two towers, two answers
    assert_error_names(unknown, ["body", "model"], 404)
    assert enc.name in unknown.text and lead.name in unknown.text


@pytest.mark.above_the_index
@pytest.mark.quick
def test_embeddings_share_the_cache_with_search(client):
    name = client.get("/v1/models").json()["data"][0]["id"]
    client.post("/v1/embeddings", json={"input": "a red bus on a street", "model": name})
    metrics = client.get("/metrics").text
    before = _counter(metrics, 'paraseek_cache_total{cache="embedding",result="hit"')
    client.post("/v1/search", json={"query": "a red bus on a street", "k": 3, "expansion": {"method": "none"}})
    after = _counter(client.get("/metrics").text, 'paraseek_cache_total{cache="embedding",result="hit"')
    assert after == before + 1


def _counter(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


@pytest.mark.above_the_index
def test_openai_client_embeds_through_the_service(uvicorn_server, demo_snapshot, direct):
    """OpenAI's own client (base64 by default, float when asked) against a real server."""
    from openai import OpenAI

    url = uvicorn_server(demo_snapshot)
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    enc, _ = direct
    assert [m.id for m in client.models.list()] == [enc.name]
    texts = ["a kitchen with a stove", "people on a beach"]
    default = client.embeddings.create(model=enc.name, input=texts)
    as_float = client.embeddings.create(model=enc.name, input=texts[0], encoding_format="float")
    expected = enc.encode_text(texts)
    np.testing.assert_allclose(np.array([d.embedding for d in default.data]), expected, atol=1e-5)
    np.testing.assert_allclose(as_float.data[0].embedding, expected[0], atol=1e-5)
    assert default.usage.prompt_tokens == int(enc.tokenize(texts).attention_mask.sum())
