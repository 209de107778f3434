"""A new expansion method is one class and one ``register`` call: the request schema accepts it, the
OpenAPI schema and /v1/info (the search page's list) name it, the engine runs it through its batched
lookups, and the evaluation harness takes it as ``--expansion``."""

import numpy as np
import pytest

from paraseek.core.encoder import Encoder, l2_normalize
from paraseek.index.snapshot import Snapshot
from paraseek.paraphrase.expansions import EXPANSIONS, ExpansionParams, VectorExpansion, register, unregister


class NearestCaption(VectorExpansion):
    """The query moved halfway to its single nearest bank caption."""

    name = "nearest-caption"
    label = "nearest caption"
    spec_help = "nearest-caption"

    async def expand(self, queries, p, lookups):
        bank = await lookups.caption_bank()
        rows, _ = await lookups.bank_neighbours(bank, queries, 1)
        return l2_normalize(queries + bank.vectors[rows[:, 0]]), bank.texts_of(rows[0])

    def from_spec(self, args):
        return ExpansionParams(n=1)

    def spec_label(self, p):
        return "nearest-caption"


@pytest.fixture()
def nearest_caption():
    method = register(NearestCaption())
    yield method
    unregister(method.name)


def test_a_registered_method_is_served_listed_and_validated(nearest_caption, make_settings, starter_bank, starter_bundle,
                                                            demo_snapshot):
    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    enc, snap = Encoder(starter_bundle), Snapshot.load(demo_snapshot)
    with TestClient(create_app(make_settings(caption_bank=starter_bank.path))) as c:
        r = c.post("/v1/search", json={"query": "a dog on a beach", "k": 5, "expansion": {"method": "nearest-caption"}})
        assert r.status_code == 200, r.text
        q = enc.encode_text(["a dog on a beach"])[0]
        nearest = int(np.argmax(starter_bank.vectors @ q))
        assert r.json()["expansions"] == [starter_bank.texts[nearest]]
        _, ids = snap.search_ids(l2_normalize(q + starter_bank.vectors[nearest])[None], 5)
        assert [x["id"] for x in r.json()["results"]] == ids[0].tolist()

        # a consistency report is compared under the same expansion, as for bank and prf
        report = c.post("/v1/search", json={"query": "a dog on a beach", "expansion": {"method": "nearest-caption"},
                                            "consistency": {"paraphrases": ["a dog at the seaside"]}}).json()["consistency"]
        assert report["expansion"] == "nearest-caption"

        listed = {m["name"]: m for m in c.get("/v1/info").json()["expansions"]}
        assert set(listed) == set(EXPANSIONS) and listed["nearest-caption"]["kind"] == "vectors"
        schema = c.get("/openapi.json").json()["components"]["schemas"]["Expansion"]["properties"]["method"]
        assert schema["enum"] == [*EXPANSIONS, "none"]

        unknown = c.post("/v1/search", json={"query": "a dog", "expansion": {"method": "farthest-caption"}})
        assert unknown.status_code == 422
        detail = unknown.json()["detail"][0]
        assert detail["loc"] == ["body", "expansion", "method"] and "nearest-caption" in detail["msg"]
        # the method's own parameter rules come from the registry: vector methods fuse by mean here
        bad = c.post("/v1/search", json={"query": "a dog", "expansion": {"method": "nearest-caption", "fusion": "rrf"}})
        assert bad.status_code == 422


@pytest.mark.quick
def test_the_evaluation_harness_takes_a_registered_method(nearest_caption, starter_bank, starter_bundle, demo_snapshot):
    from paraseek.evaluation.expansion import parse_expansion, spec_help

    enc, snap = Encoder(starter_bundle), Snapshot.load(demo_snapshot)
    exp = parse_expansion("nearest-caption", enc, snap, bank=starter_bank.path)
    assert exp.label == "nearest-caption" and "nearest-caption" in spec_help()
    q = enc.encode_text(["a red bus", "a cat on a bed"])
    nearest = np.argmax(q @ starter_bank.vectors.T, axis=1)
    np.testing.assert_allclose(exp.expand(["a red bus", "a cat on a bed"], q), l2_normalize(q + starter_bank.vectors[nearest]),
                               atol=2e-4)  # the loaded bank stores its vectors in fp16


@pytest.mark.quick
def test_the_registry_refuses_a_taken_name_and_names_the_methods():
    from paraseek.paraphrase.expansions import BankExpansion, expansion_method

    with pytest.raises(ValueError, match="exists"):
        register(BankExpansion())
    with pytest.raises(ValueError, match="bank, head, wordnet, ppdb, prf"):
        expansion_method("thesaurus")
