"""Property: any Unicode string in any text field of a search gets a 200, or a 4xx whose ``loc``
names that field; never a 5xx."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paraseek.service.main import create_app

# any code point, lone surrogates, controls and zero-width characters included
ANY_TEXT = st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=40)
FIELDS = {
    "query": (lambda t: {"query": t}, ["body", "query"]),
    "terms": (lambda t: {"terms": [{"text": t}]}, ["body", "terms", 0, "text"]),
    "paraphrases": (lambda t: {"query": "a dog", "consistency": {"paraphrases": [t]}}, ["body", "consistency", "paraphrases", 0]),
}


@pytest.fixture(scope="module")
def text_client(starter_bundle, demo_snapshot, tmp_path_factory):
    from paraseek.core.settings import Settings

    home = tmp_path_factory.mktemp("text-home")
    with TestClient(create_app(Settings(bundle=starter_bundle, snapshot=demo_snapshot, log_json=False, home=home))) as c:
        yield c


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_any_unicode_in_any_text_field(text_client, field):
    make, loc = FIELDS[field]

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(text=ANY_TEXT)
    def check(text):
        # json.dumps escapes lone surrogates as \udxxx, as a hostile client would send them
        body = json.dumps(make(text))
        r = text_client.post("/v1/search", content=body, headers={"content-type": "application/json"})
        assert r.status_code < 500, (text, r.text)
        if r.status_code != 200:
            assert 400 <= r.status_code < 500
            assert r.json()["detail"][0]["loc"][: len(loc)] == loc, (text, r.text)

    check()
