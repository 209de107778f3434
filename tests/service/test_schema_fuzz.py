"""Schemathesis over the service's own OpenAPI schema, in process, bounded: with and without the
admin token, no input may produce a 5xx, and every response must match the documented schema
(status codes, bodies, content types, headers).

Not checked: that every schema-valid request is accepted. Some rules are cross-field ("paraphrases"
or "auto", "expansion" needs "query") or about Unicode categories, which JSON Schema cannot state
exactly; the service rejects those with a 422 naming the field."""

from __future__ import annotations

import signal

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from paraseek.loadtests.server import start_server
from tests.service.conftest import ADMIN_TOKEN


@pytest.fixture(scope="module")
def fuzz_server(starter_bundle, demo_snapshot, tmp_path_factory, shared_data):
    """``paraseek serve`` on loopback, as the fuzzing in the issue ran it."""
    home = tmp_path_factory.mktemp("fuzz-home")
    # the reindex root is an empty folder: fuzzed admin calls can never start a real build
    root = tmp_path_factory.mktemp("fuzz-root")
    env = {"PARASEEK_BUNDLE": str(starter_bundle), "PARASEEK_SNAPSHOT": str(demo_snapshot),
           "PARASEEK_ADMIN_TOKEN": ADMIN_TOKEN, "PARASEEK_HOME": str(home), "PARASEEK_REINDEX_ROOT": str(root),
           "PARASEEK_LOG_JSON": "false", "NLTK_DATA": str(shared_data / "nltk_data")}
    proc, url = start_server(env, log=home / "server.log")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server + "/openapi.json")


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def sends_what_it_generated(case) -> bool:
    """False for a multipart body with a field generated as an empty array: no such field is sent, so
    the request is valid after all and 'schema-violating request accepted' would be a false alarm."""
    return not (case.media_type == "multipart/form-data" and isinstance(case.body, dict) and any(v == [] for v in case.body.values()))


def fuzz_every_operation(schema, subtests, headers: dict[str, str] | None = None) -> int:
    """Each operation, as a subtest, fuzzed with schema-valid and schema-violating requests by plain
    Hypothesis over schemathesis's case strategies (its pytest plugin reads pytest internals that pytest
    9.2 removed). Returns how many operations ran."""
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        negative = operation.as_strategy(GenerationMode.NEGATIVE).filter(sends_what_it_generated)
        strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), negative)

        @FUZZ
        @given(case=strategy)
        def check(case):
            response = case.call(headers=headers)
            assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
            case.validate_response(response, excluded_checks=[positive_data_acceptance])

        with subtests.test(operation=operation.label):
            check()
    return len(operations)


def test_no_5xx_and_schema_conformance_anonymous(api_schema, subtests):
    assert fuzz_every_operation(api_schema, subtests) >= 10


def test_no_5xx_and_schema_conformance_with_admin_token(api_schema, subtests):
    admin = api_schema.include(path_regex="^/v1/admin")
    assert fuzz_every_operation(admin, subtests, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) >= 2
