"""``paraseek index build|update|copy --hub-table`` and ``paraseek index hub-table``: a version's hub table
written where servers read it, before the version is published. ``paraseek index versions|activate|prune``:
listing the published versions, rolling back to one while servers follow, removing old ones."""

import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from paraseek.cli import app
from paraseek.index import cli as index_cli
from paraseek.paraphrase.hub_table import HubTable, hub_table_key, hub_table_path, version_identity
from tests.conftest import fresh_prefix

runner = CliRunner()
HUB_DEFAULT = '{"method": "none", "hub_weight": 0.5}'


@pytest.fixture()
def env(tmp_path, monkeypatch, starter_bundle, starter_bank):
    """Settings a server and the CLI share: a home, the serving bundle and its bank; unit vectors of its space."""
    monkeypatch.setenv("PARASEEK_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PARASEEK_BUNDLE", str(starter_bundle))
    monkeypatch.setenv("PARASEEK_CAPTION_BANK", str(starter_bank.path))
    monkeypatch.delenv("PARASEEK_DEFAULT_EXPANSION", raising=False)
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(120, starter_bank.manifest.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    np.save(tmp_path / "v.npy", vectors)
    return tmp_path


def build(env, *extra):
    return runner.invoke(app, ["index", "build", "--embeddings", str(env / "v.npy"), "--out", str(env / "snap"), *extra])


def manifest_of(env, version=None):
    info = runner.invoke(app, ["index", "info", str(env / "snap")] + (["--version", version] if version else []))
    return json.loads(info.output)


def table_path(env, manifest, bank):
    return hub_table_path(env / "home" / "hub-tables", hub_table_key(version_identity(SimpleNamespace(**manifest)), bank))


def test_a_default_hub_weight_writes_the_table_before_the_version_is_published(env, starter_bank, monkeypatch):
    monkeypatch.setenv("PARASEEK_DEFAULT_EXPANSION", HUB_DEFAULT)
    current_when_written = []
    real = index_cli.hub_table_for

    def recording(home, snapshot, bank, **options):
        current_when_written.append((env / "snap" / "current").is_file())
        return real(home, snapshot, bank, **options)

    monkeypatch.setattr(index_cli, "hub_table_for", recording)
    r = build(env)
    assert r.exit_code == 0, r.output
    manifest = manifest_of(env)
    assert f"hub table of {manifest['version']}: 120 images" in r.output and "computed in" in r.output
    assert current_when_written == [False]  # no server could load the version without its table
    table = HubTable.load(table_path(env, manifest, starter_bank), 120)
    assert table is not None and table.ids.tolist() == list(range(120))
    np.testing.assert_allclose(table.bias, starter_bank.hub_bias(np.load(env / "v.npy")), rtol=1e-5)

    r = build(env, "--no-hub-table")  # asked not to: the next version has none
    assert r.exit_code == 0 and "hub table" not in r.output
    assert not table_path(env, manifest_of(env), starter_bank).exists()

    r = runner.invoke(app, ["index", "hub-table", str(env / "snap")])  # written afterwards for the current version
    assert r.exit_code == 0, r.output
    assert f"hub table of {manifest_of(env)['version']}: 120 images" in r.output
    assert table_path(env, manifest_of(env), starter_bank).is_file()
    again = runner.invoke(app, ["index", "hub-table", str(env / "snap"), "--version", manifest["version"]])
    assert again.exit_code == 0 and "already written" in again.output


@pytest.mark.quick
def test_update_and_copy_publish_their_versions_with_a_table(env, starter_bank, monkeypatch):
    """Every command that publishes a version writes its table first: an update's version and a copy's."""
    monkeypatch.setenv("PARASEEK_DEFAULT_EXPANSION", HUB_DEFAULT)
    assert build(env).exit_code == 0
    first = manifest_of(env)["version"]
    published_when_written = []
    real = index_cli.hub_table_for

    def recording(home, snapshot, bank, **options):
        root = snapshot.path.parent.parent  # <root>/versions/<version>
        published_when_written.append((root / "current").is_file() and (root / "current").read_text().strip())
        return real(home, snapshot, bank, **options)

    monkeypatch.setattr(index_cli, "hub_table_for", recording)
    r = runner.invoke(app, ["index", "update", str(env / "snap"), "--remove", "3", "--remove", "7"])
    assert r.exit_code == 0, r.output
    updated = manifest_of(env)
    assert updated["parent"] == first and f"hub table of {updated['version']}: 118 images" in r.output
    assert published_when_written == [first]  # the update's table was written while its parent still served
    table = HubTable.load(table_path(env, updated, starter_bank), 118)
    assert table is not None and 3 not in table.ids and 7 not in table.ids
    vectors = np.load(env / "v.npy")
    np.testing.assert_allclose(table.bias, starter_bank.hub_bias(vectors[table.ids]), rtol=1e-5)

    r = runner.invoke(app, ["index", "copy", str(env / "snap"), "--backend", "faiss", "--out", str(env / "copy")])
    assert r.exit_code == 0, r.output
    copied = json.loads(runner.invoke(app, ["index", "info", str(env / "copy")]).output)
    assert f"hub table of {copied['version']}: 118 images" in r.output and published_when_written[-1] is False
    assert table_path(env, copied, starter_bank).is_file()

    r = runner.invoke(app, ["index", "update", str(env / "snap"), "--remove", "4", "--no-hub-table"])
    assert r.exit_code == 0 and "hub table" not in r.output
    assert manifest_of(env)["count"] == 117 and not table_path(env, manifest_of(env), starter_bank).exists()


def test_milvus_versions_are_published_with_their_table(env, starter_bank, monkeypatch, milvus_lite_uri):
    """The same on a Milvus collection: a copy into it and an update of it each write the table first."""
    from paraseek.index.milvus_store import MilvusStore

    monkeypatch.setenv("PARASEEK_DEFAULT_EXPANSION", HUB_DEFAULT)
    assert build(env, "--no-hub-table").exit_code == 0
    prefix = fresh_prefix()
    milvus = ["--backend", "milvus", "--uri", milvus_lite_uri, "--collection", prefix]
    current_when_written = []
    real = index_cli.hub_table_for

    def recording(home, snapshot, bank, **options):
        current_when_written.append(MilvusStore(milvus_lite_uri, prefix=prefix).current_version())
        return real(home, snapshot, bank, **options)

    monkeypatch.setattr(index_cli, "hub_table_for", recording)
    r = runner.invoke(app, ["index", "copy", str(env / "snap"), *milvus])
    assert r.exit_code == 0, r.output
    copied = MilvusStore(milvus_lite_uri, prefix=prefix).manifest()
    assert f"hub table of {copied.version}: 120 images" in r.output and current_when_written == [None]
    r = runner.invoke(app, ["index", "update", *milvus, "--remove", "3"])
    assert r.exit_code == 0, r.output
    updated = MilvusStore(milvus_lite_uri, prefix=prefix).manifest()
    assert updated.parent == copied.version and current_when_written == [None, copied.version]
    table = HubTable.load(hub_table_path(env / "home" / "hub-tables", hub_table_key(version_identity(updated), starter_bank)), 119)
    assert table is not None and 3 not in table.ids
    np.testing.assert_allclose(table.bias, starter_bank.hub_bias(np.load(env / "v.npy")[table.ids]), rtol=1e-5)


@pytest.mark.quick
def test_a_refused_table_leaves_update_and_copy_unwritten(env, monkeypatch):
    assert build(env).exit_code == 0
    before = manifest_of(env)["version"]
    monkeypatch.setenv("PARASEEK_CAPTION_BANK", str(env / "no-bank"))
    r = runner.invoke(app, ["index", "update", str(env / "snap"), "--remove", "3", "--hub-table"])
    assert r.exit_code == 2 and "--hub-table" in r.output and "manifest.json is missing" in r.output
    assert manifest_of(env)["version"] == before
    assert [p.name for p in (env / "snap" / "versions").iterdir()] == [before]  # nothing staged or left behind
    r = runner.invoke(app, ["index", "copy", str(env / "snap"), "--backend", "faiss", "--out", str(env / "copy"),
                            "--hub-table"])
    assert r.exit_code == 2 and "manifest.json is missing" in r.output and not (env / "copy").exists()


@pytest.mark.quick
def test_no_default_hub_weight_writes_no_table_unless_asked(env, starter_bank):
    r = build(env)
    assert r.exit_code == 0, r.output
    assert "hub table" not in r.output and not (env / "home" / "hub-tables").exists()
    r = build(env, "--hub-table")
    assert r.exit_code == 0 and f"hub table of {manifest_of(env)['version']}" in r.output
    assert table_path(env, manifest_of(env), starter_bank).is_file()


@pytest.mark.quick
def test_a_hub_table_without_its_bank_is_refused_before_the_build(env, monkeypatch):
    monkeypatch.setenv("PARASEEK_CAPTION_BANK", str(env / "no-bank"))
    r = build(env, "--hub-table")
    assert r.exit_code == 2 and "--hub-table" in r.output and "manifest.json is missing" in r.output
    assert not (env / "snap").exists()  # nothing was built
    r = build(env, "--hub-table", "--image-space", "another/space")
    assert r.exit_code == 2 and "no-bank" in r.output

    monkeypatch.setenv("PARASEEK_DEFAULT_EXPANSION", HUB_DEFAULT)  # the default only: noted, and the version published
    r = build(env)
    assert r.exit_code == 0 and "no hub table written" in r.output and (env / "snap" / "current").is_file()
    r = runner.invoke(app, ["index", "hub-table", str(env / "snap")])
    assert r.exit_code == 2 and "manifest.json is missing" in r.output


@pytest.mark.quick
def test_a_folder_that_refuses_the_table_is_said_and_the_version_still_published(env, monkeypatch):
    """The CLI's job is the file: where PARASEEK_HUB_TABLES cannot hold it, the user is told (a server would
    only log it), a build still publishes (servers then compute the table) and `index hub-table` fails."""
    refusing = env / "refusing"
    refusing.write_text("a file where the folder would be")
    monkeypatch.setenv("PARASEEK_HUB_TABLES", str(refusing))
    r = build(env, "--hub-table")
    assert r.exit_code == 0, r.output
    version = manifest_of(env)["version"]
    assert f"hub table of {version} not written to {refusing}" in r.output and "servers compute it" in r.output
    assert "computed in" not in r.output and (env / "snap" / "current").read_text().strip() == version
    r = runner.invoke(app, ["index", "hub-table", str(env / "snap")])
    assert r.exit_code == 2 and f"hub table of {version} not written to {refusing}" in r.output


@pytest.mark.quick
def test_a_bank_of_another_image_space_is_not_the_versions(env, monkeypatch):
    r = build(env, "--hub-table", "--image-space", "another/space")
    assert r.exit_code == 2 and "image space" in r.output and not (env / "snap").exists()
    monkeypatch.setenv("PARASEEK_DEFAULT_EXPANSION", HUB_DEFAULT)
    r = build(env, "--image-space", "another/space")
    assert r.exit_code == 0 and "no hub table written" in r.output


def test_a_server_reads_the_table_the_build_wrote(env, monkeypatch):
    """The user's path: build with the server's settings, then serve (a replica with a home of its own and the
    tables on the shared volume, PARASEEK_HUB_TABLES); the server computes nothing."""
    from fastapi.testclient import TestClient

    from paraseek.core.settings import Settings
    from paraseek.service.main import create_app

    monkeypatch.setenv("PARASEEK_DEFAULT_EXPANSION", HUB_DEFAULT)
    monkeypatch.setenv("PARASEEK_HUB_TABLES", str(env / "shared" / "hub-tables"))
    assert build(env).exit_code == 0
    assert len(list((env / "shared" / "hub-tables").glob("*.npz"))) == 1

    real = HubTable.compute.__func__

    def only_the_cli(cls, bank, contents):  # the CLI runs in this process too; the server builds on "hub-table"
        if threading.current_thread().name == "hub-table":
            raise AssertionError("the server computed the table the build wrote")
        return real(cls, bank, contents)

    monkeypatch.setattr(HubTable, "compute", classmethod(only_the_cli))
    settings = Settings(home=env / "replica", snapshot=env / "snap", precision="fp32", log_json=False, snapshot_poll_s=0.2)

    def served_table(c, version):
        deadline = time.time() + 60
        while (info := c.get("/v1/info").json()["snapshot"])["version"] != version or info["hub_table"] in (None, "building"):
            assert time.time() < deadline, f"{version} not served with a hub table within 60 s"
            time.sleep(0.1)
        return info["hub_table"]

    with TestClient(create_app(settings)) as c:
        assert served_table(c, manifest_of(env)["version"]) == "ready"
        assert len(c.post("/v1/search", json={"query": "a dog on a couch", "k": 3}).json()["results"]) == 3
        assert build(env).exit_code == 0  # a new version published while it serves: read at its swap
        assert served_table(c, manifest_of(env)["version"]) == "ready"


def versions_of(env, *store):
    r = runner.invoke(app, ["index", "versions", *(store or [str(env / "snap")]), "--json"])
    assert r.exit_code == 0, r.output
    return [json.loads(line) for line in r.output.splitlines()]


def current_of(env, *store):
    return [v["version"] for v in versions_of(env, *store) if v["current"]]


def test_versions_list_what_activate_rolls_back_to_and_prune_removes(env):
    for _ in range(3):
        assert build(env).exit_code == 0
    v1, v2, v3 = (v["version"] for v in versions_of(env))
    assert current_of(env) == [v3]
    listed = runner.invoke(app, ["index", "versions", str(env / "snap")])
    assert listed.exit_code == 0 and all(v in listed.output for v in (v1, v2, v3)) and "* current" in listed.output

    r = runner.invoke(app, ["index", "activate", str(env / "snap"), "--previous"])  # builds have no parent
    assert r.exit_code == 0 and f"current: {v2} (120 images" in r.output and f"was {v3}" in r.output
    assert current_of(env) == [v2] and (env / "snap" / "current").read_text().strip() == v2
    assert runner.invoke(app, ["index", "activate", str(env / "snap"), "--version", v3]).exit_code == 0  # forward again
    assert current_of(env) == [v3]
    again = runner.invoke(app, ["index", "activate", str(env / "snap"), "--version", v3])
    assert again.exit_code == 0 and "already current" in again.output

    for wrong, says in ((["--version", "v0009-20261122T080000Z"], "no published version"), ([], "one of the two"),
                        (["--version", v1, "--previous"], "one of the two")):
        r = runner.invoke(app, ["index", "activate", str(env / "snap"), *wrong])
        assert r.exit_code == 2 and says in r.output, r.output
    assert current_of(env) == [v3]

    r = runner.invoke(app, ["index", "update", str(env / "snap"), "--remove", "5"])
    assert r.exit_code == 0, r.output
    v4 = current_of(env)[0]
    r = runner.invoke(app, ["index", "prune", str(env / "snap"), "--keep", "2"])
    assert r.exit_code == 0 and f"removed 2 version(s): {v1}, {v2}; 2 kept" in r.output, r.output
    assert [v["version"] for v in versions_of(env)] == [v3, v4]
    r = runner.invoke(app, ["index", "activate", str(env / "snap"), "--previous"])  # an update's parent
    assert r.exit_code == 0 and current_of(env) == [v3]
    r = runner.invoke(app, ["index", "activate", str(env / "snap"), "--previous"])
    assert r.exit_code == 2 and "oldest published version" in r.output and current_of(env) == [v3]
    r = runner.invoke(app, ["index", "prune", str(env / "snap"), "--keep", "2"])
    assert r.exit_code == 0 and "removed 0 version(s); 2 kept" in r.output

    assert build(env, "--image-space", "another/space").exit_code == 0  # current now: servers of the bundle refuse it
    other = current_of(env)[0]
    assert runner.invoke(app, ["index", "activate", str(env / "snap"), "--version", v4]).exit_code == 0
    r = runner.invoke(app, ["index", "activate", str(env / "snap"), "--version", other])
    assert r.exit_code == 2 and "image space 'another/space'" in r.output and current_of(env) == [v4]


def test_a_rollback_is_served_with_its_table(env, starter_bank, monkeypatch):
    """A server following ``current`` serves the version rolled back to, its hub table read back, not computed."""
    from fastapi.testclient import TestClient

    from paraseek.core.settings import Settings
    from paraseek.service.main import create_app

    monkeypatch.setenv("PARASEEK_DEFAULT_EXPANSION", HUB_DEFAULT)
    monkeypatch.setenv("PARASEEK_HUB_TABLES", str(env / "shared" / "hub-tables"))  # the replicas' shared volume
    assert build(env).exit_code == 0 and build(env).exit_code == 0
    first, second = (v["version"] for v in versions_of(env))

    def computed_again(cls, bank, contents):
        raise AssertionError("a table the builds wrote was computed again")

    monkeypatch.setattr(HubTable, "compute", classmethod(computed_again))
    settings = Settings(home=env / "replica", snapshot=env / "snap", precision="fp32", log_json=False, snapshot_poll_s=0.2)
    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/info").json()["snapshot"]["version"] == second
        r = runner.invoke(app, ["index", "activate", str(env / "snap"), "--previous"])  # no table work: never waits
        assert r.exit_code == 0 and "hub table" not in r.output
        deadline = time.time() + 30
        while (info := c.get("/v1/info").json()["snapshot"])["version"] != first or info["hub_table"] != "ready":
            assert time.time() < deadline, f"{first} not served with its table within 30 s: {info}"
            time.sleep(0.1)


@pytest.mark.quick
def test_activate_with_hub_table_writes_a_missing_table_first(env, starter_bank, monkeypatch):
    assert build(env).exit_code == 0 and build(env).exit_code == 0
    first, _ = (v["version"] for v in versions_of(env))
    assert not table_path(env, manifest_of(env, first), starter_bank).exists()  # no hub_weight: built without
    current_when_written = []
    real = index_cli.hub_table_for

    def recording(home, snapshot, bank, **options):
        current_when_written.append((env / "snap" / "current").read_text().strip())
        return real(home, snapshot, bank, **options)

    monkeypatch.setattr(index_cli, "hub_table_for", recording)
    r = runner.invoke(app, ["index", "activate", str(env / "snap"), "--previous", "--hub-table"])
    assert r.exit_code == 0 and f"hub table of {first}: 120 images" in r.output and "computed in" in r.output
    assert current_when_written != [first] and current_of(env) == [first]  # written while the other version served
    assert table_path(env, manifest_of(env, first), starter_bank).is_file()


def test_versions_and_rollback_on_a_milvus_collection(env, milvus_lite_uri):
    milvus = ["--backend", "milvus", "--uri", milvus_lite_uri, "--collection", fresh_prefix()]
    assert build(env).exit_code == 0
    for _ in range(2):
        assert runner.invoke(app, ["index", "copy", str(env / "snap"), *milvus]).exit_code == 0
    r = runner.invoke(app, ["index", "versions", *milvus])
    assert r.exit_code == 0 and "milvus" in r.output
    first, second = (v["version"] for v in versions_of(env, *milvus))
    assert current_of(env, *milvus) == [second]
    r = runner.invoke(app, ["index", "activate", *milvus, "--previous"])
    assert r.exit_code == 0 and current_of(env, *milvus) == [first]
    r = runner.invoke(app, ["index", "prune", *milvus, "--keep", "2"])
    assert r.exit_code == 0 and "removed 0 version(s)" in r.output
