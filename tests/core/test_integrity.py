"""Checksums with a record of what was verified: unchanged files are not hashed again, changed ones are."""

import json
import os
import time

import pytest

from paraseek.core.errors import UserError
from paraseek.core.integrity import VERIFIED, checksums, record_verified, verify_checksums

pytestmark = pytest.mark.quick


OLD_NS = time.time_ns() - 3600 * 10**9  # an hour ago: past the racy window of any record taken now


@pytest.fixture
def folder(tmp_path):
    for name, body in (("big.bin", os.urandom(1 << 16)), ("small.json", b'{"a": 1}')):
        (tmp_path / name).write_bytes(body)
        os.utime(tmp_path / name, ns=(OLD_NS, OLD_NS))
    return tmp_path


def verify(folder, digests, **kw):
    return verify_checksums(folder, digests, "test folder", UserError, **kw)


def test_a_recorded_unchanged_folder_is_not_hashed_again(folder):
    digests = checksums(folder, ["big.bin", "small.json"])
    assert record_verified(folder, digests)
    assert verify(folder, digests) == []
    assert verify(folder, digests, trust_unchanged=False) == ["big.bin", "small.json"]


def test_without_a_record_every_file_is_hashed_and_the_pass_is_recorded(folder):
    digests = checksums(folder, ["big.bin", "small.json"])
    assert verify(folder, digests) == ["big.bin", "small.json"]
    assert set(json.loads((folder / VERIFIED).read_text())["files"]) == {"big.bin", "small.json"}
    assert verify(folder, digests) == []


def test_a_file_altered_in_place_is_caught_even_with_its_times_put_back(folder):
    digests = checksums(folder, ["big.bin", "small.json"])
    record_verified(folder, digests)
    with open(folder / "big.bin", "r+b") as f:  # same size, one byte differs
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    os.utime(folder / "big.bin", ns=(OLD_NS, OLD_NS))  # mtime restored; ctime cannot be
    with pytest.raises(UserError, match="'big.bin' does not match its sha256"):
        verify(folder, digests)


def test_a_replaced_file_is_hashed_again(folder):
    digests = checksums(folder, ["big.bin", "small.json"])
    record_verified(folder, digests)
    body = (folder / "small.json").read_bytes()
    (folder / "small.json").unlink()
    (folder / "small.json").write_bytes(body)  # same content, a new inode
    os.utime(folder / "small.json", ns=(OLD_NS, OLD_NS))
    assert verify(folder, digests) == ["small.json"]


def test_a_file_written_just_before_its_record_is_not_trusted(folder):
    (folder / "small.json").write_bytes(b'{"a": 2}')  # mtime now: within the racy window of a record taken now
    digests = checksums(folder, ["big.bin", "small.json"])
    record_verified(folder, digests)
    assert verify(folder, digests) == ["small.json"]


def test_a_record_of_other_content_or_a_damaged_record_trusts_nothing(folder):
    digests = checksums(folder, ["big.bin", "small.json"])
    record_verified(folder, {**digests, "big.bin": "0" * 64})  # a record for another manifest
    assert verify(folder, digests) == ["big.bin"]
    (folder / VERIFIED).write_text("{not json")
    assert verify(folder, digests) == ["big.bin", "small.json"]
    assert verify(folder, digests) == []  # the damaged record was replaced


def test_a_missing_file_is_named_whatever_the_record_says(folder):
    digests = checksums(folder, ["big.bin", "small.json"])
    record_verified(folder, digests)
    (folder / "big.bin").unlink()
    with pytest.raises(UserError, match="'big.bin' is missing"):
        verify(folder, digests)
