"""The LLM paraphrase client's failures as a client sees them, and its on-disk cache shared by writers."""

import pytest

from paraseek.paraphrase.llm import ChatClient, JsonlCache, LLMError

pytestmark = pytest.mark.quick


def test_a_failing_endpoint_is_reported_without_its_address_or_credentials(caplog):
    from paraseek.loadtests.net import free_port

    url = f"http://user:s3cret@127.0.0.1:{free_port()}/v1"  # nothing listens there
    client = ChatClient(url, "some-model", api_key="sk-key", retries=1, timeout=2)
    with pytest.raises(LLMError) as failed:
        client.complete("Paraphrase: a dog")
    message = str(failed.value)
    assert message == "LLM endpoint failed after 2 attempts: ConnectError"
    assert "s3cret" not in caplog.text and "127.0.0.1" in caplog.text  # the log says where, without the password


def test_writers_sharing_the_file_keep_each_others_answers_through_a_compaction(tmp_path):
    path = tmp_path / "llm.jsonl"
    a, b = JsonlCache(path, max_entries=3), JsonlCache(path, max_entries=3)
    for n in range(1, 6):
        a.put(f"a{n}", "x")
    b.put("b1", "from b")  # appended between a's lines
    a.put("a6", "x")
    a.put("a7", "x")  # a's seventh line: the file (8 lines) is compacted to its newest three, then a7 appended
    fresh = JsonlCache(path, max_entries=3)
    assert fresh.get("b1") == "from b" and fresh.get("a7") == "x" and fresh.get("a6") == "x"
    assert len(path.read_text().splitlines()) == 4
