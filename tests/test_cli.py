"""The paraseek CLI as users run it (in-process through typer's runner)."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from paraseek.cli import app

runner = CliRunner()


@pytest.fixture()
def home(tmp_path, monkeypatch, starter_bundle):
    monkeypatch.setenv("PARASEEK_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PARASEEK_STARTER", "plain")
    shutil.copytree(starter_bundle, tmp_path / "home" / "bundles" / "starter")
    return tmp_path / "home"


def test_demo_is_the_embedded_default(home):
    result = runner.invoke(app, ["demo", "a plate of food on a table", "-k", "2"])
    assert result.exit_code == 0, result.output
    assert "rank" in result.output and ".jpg" in result.output
    assert (home / "snapshots" / "demo" / "current").is_file()
    info = runner.invoke(app, ["index", "info"])
    assert json.loads(info.output)["count"] == 76


def test_index_build_and_search_json(home, shared_data, tmp_path):
    out = tmp_path / "snap"
    r = runner.invoke(app, ["index", "build", str(shared_data / "coco-mini/captions_val2017.json"), "--out", str(out),
                            "--type", "hnsw", "--params", '{"ef_search": 64}'])
    assert r.exit_code == 0, r.output
    assert "159 images" in r.output and "recall@10" in r.output and "reused" not in r.output
    again = runner.invoke(app, ["index", "build", str(shared_data / "coco-mini/captions_val2017.json"), "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert "159 vectors reused from" in again.output and "0 images encoded" in again.output  # the photos are unchanged
    plan = runner.invoke(app, ["index", "build", str(shared_data / "coco-mini/captions_val2017.json"), "--out", str(out),
                               "--dry-run"])
    assert plan.exit_code == 0 and "dry run: nothing changed since" in plan.output, plan.output
    by_bytes = runner.invoke(app, ["index", "build", str(shared_data / "coco-mini/captions_val2017.json"), "--out", str(out),
                                   "--dry-run", "--checksum"])  # every photo hashed: the same bytes as recorded
    assert by_bytes.exit_code == 0 and "dry run: nothing changed since" in by_bytes.output, by_bytes.output
    other = runner.invoke(app, ["index", "build", str(shared_data / "coco-mini/captions_val2017.json"), "--out", str(out),
                                "--type", "flat", "--dry-run"])  # another index type: a new version, every vector reused
    assert other.exit_code == 0 and "159 vectors would be reused" in other.output and "0 images would be encoded" in other.output
    assert len(list((out / "versions").iterdir())) == 2  # a dry run writes nothing
    same = runner.invoke(app, ["index", "build", str(shared_data / "coco-mini/captions_val2017.json"), "--out", str(out)])
    assert same.exit_code == 0 and "nothing changed since" in same.output and "it stays current" in same.output, same.output
    assert len(list((out / "versions").iterdir())) == 2  # no third version
    r = runner.invoke(app, ["index", "search", "two giraffes", "--snapshot", str(out), "-k", "4", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert rows[0]["query"] == "two giraffes" and len(rows[0]["results"]) == 4


def test_index_build_says_which_files_stay_skipped_when_nothing_changed(home, shared_data, tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    for path in sorted((shared_data / "coco-mini/val2017").glob("*.jpg"))[:3]:
        shutil.copy(path, photos / path.name)
    (photos / "broken.jpg").write_bytes(b"not a jpeg")
    args = ["index", "build", str(photos), "--out", str(tmp_path / "snap")]
    first = runner.invoke(app, args)
    assert first.exit_code == 0 and "published" in first.output and "skipped broken.jpg: " in first.output, first.output
    plan = runner.invoke(app, [*args, "--dry-run"])
    assert plan.exit_code == 0 and "stay current (3 images; 1 file it could not decode stays skipped)" in plan.output, plan.output
    same = runner.invoke(app, args)  # the broken file is still there: still named, though nothing is decoded again
    assert same.exit_code == 0 and "it stays current" in same.output, same.output
    assert "skipped broken.jpg: could not be decoded when v0001-" in same.output, same.output


@pytest.mark.quick
def test_models_info_verifies(home):
    r = runner.invoke(app, ["models", "info"])
    assert r.exit_code == 0 and json.loads(r.output)["name"] == "paraseek-starter"
    (home / "bundles" / "starter" / "text.onnx").write_bytes(b"broken")
    r = runner.invoke(app, ["models", "info"])
    assert r.exit_code == 2 and "text.onnx" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["index", "build", "/nonexistent/folder"], "does not exist"),
        (["index", "search", "x", "--snapshot", "/nonexistent"], "neither a snapshot"),
        (["index", "build", "pyproject.toml"], "neither an image folder"),
        (["index", "search", "   "], "empty"),
        (["index", "build", ".", "--type", "kdtree"], "type"),
        (["index", "build", "--embeddings", "v.npy", "--reencode"], "--reencode goes with an image source"),
        (["index", "build", "--embeddings", "v.npy", "--dry-run"], "--dry-run goes with an image source"),
        (["index", "build", ".", "--checksum", "--reencode"], "--checksum compares photos for reuse"),
        (["index", "build", "--embeddings", "v.npy", "--checksum"], "--checksum compares photos for reuse"),
    ],
)
def test_bad_input_gives_message_and_exit_2(home, args, message):
    if args[:2] == ["index", "search"] and args[2] == "   ":
        runner.invoke(app, ["demo", "x", "-k", "1"])
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_index_update_add_remove_retrain(home, shared_data, tmp_path):
    out = tmp_path / "snap"
    coco = shared_data / "coco-mini"
    r = runner.invoke(app, ["index", "build", str(coco / "captions_train2017.json"), "--out", str(out), "--type", "ivf_flat"])
    assert r.exit_code == 0, r.output
    first = json.loads(runner.invoke(app, ["index", "info", str(out)]).output)
    some_id = json.loads(runner.invoke(app, ["index", "search", "a dog", "--snapshot", str(out), "-k", "1", "--json"]).output)[0]["results"][0]["id"]
    r = runner.invoke(app, ["index", "update", str(out), "--remove", str(some_id)])
    assert r.exit_code == 0, r.output
    removed = json.loads(runner.invoke(app, ["index", "info", str(out)]).output)
    assert removed["count"] == first["count"] - 1 and removed["parent"] == first["version"]
    assert removed["index"]["nlist"] == first["index"]["nlist"]  # quantiser kept
    r = runner.invoke(app, ["index", "update", str(out), "--retrain"])
    assert r.exit_code == 0, r.output
    retrained = json.loads(runner.invoke(app, ["index", "info", str(out)]).output)
    assert retrained["count"] == removed["count"] and retrained["parent"] == removed["version"]
    assert retrained["recall_at_10"] is not None
    report = json.loads((out / "versions" / retrained["version"] / "report.json").read_text())
    assert report["retrained"] is True and report["index_rebuilt"] is True
    r = runner.invoke(app, ["index", "update", str(out)])
    assert r.exit_code == 2 and "nothing to do" in r.output


def test_export_openclip_and_export_hf_from_the_cli(tiny_clip, tmp_path):
    from paraseek.core.encoder import Encoder
    from tests.conftest import TINY_CLIP_CONFIG
    from paraseek.training.export.hf_text import minilm_dir

    _, _, ckpt = tiny_clip
    out = tmp_path / "clip"
    r = runner.invoke(app, ["models", "export-openclip", "--model-config", str(TINY_CLIP_CONFIG), "--pretrained", str(ckpt),
                            "--out", str(out), "--int8"])
    assert r.exit_code == 0, r.output
    assert "int8 text tower: cosine vs fp32 mean" in r.output
    enc = Encoder(out, precision="int8")
    assert enc.has_image_tower and enc.encode_text(["a red bus"]).shape == (1, enc.dim)

    text = tmp_path / "minilm"
    r = runner.invoke(app, ["models", "export-hf", str(minilm_dir()), "--out", str(text), "--image-space", "text/test"])
    assert r.exit_code == 0, r.output
    enc = Encoder(text)
    assert enc.image_space == "text/test" and not enc.has_image_tower and enc.dim == 384
    r = runner.invoke(app, ["models", "export-openclip", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "model name or --model-config" in r.output


def test_an_unreachable_milvus_is_an_outage_not_a_usage_error():
    """Exit 69 (EX_UNAVAILABLE: retry later), not 2: the command was right, the database did not answer."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = runner.invoke(app, ["index", "info", "--backend", "milvus", "--uri", f"http://127.0.0.1:{port}", "--collection", "x"])
    assert out.exit_code == 69, out.output
    assert "unavailable (retry later)" in out.output and "Traceback" not in out.output
    bad = runner.invoke(app, ["index", "info", "snapshots/x", "--backend", "milvus", "--uri", f"http://127.0.0.1:{port}"])
    assert bad.exit_code == 2 and "FAISS snapshot folder" in bad.output  # a usage error stays one


@pytest.mark.quick
def test_the_top_level_lists_each_layers_command_by_its_own_help_line():
    """`paraseek --help` lists the layers' commands without importing them (LAYER_COMMANDS): each help
    line there is the command's own, and each command runs with its own parameters once loaded."""
    import inspect

    import typer.main

    from paraseek.cli import LAYER_COMMANDS, LayerCommand

    wide = {"COLUMNS": "400"}  # rich wraps at the terminal's width
    listed = runner.invoke(app, ["--help"], env=wide)
    assert listed.exit_code == 0, listed.output
    group = typer.main.get_command(app)
    for name, (_target, help_line) in LAYER_COMMANDS.items():
        assert help_line in listed.output
        command = group.commands[name]  # type: ignore[attr-defined]
        assert isinstance(command, LayerCommand)
        assert " ".join(inspect.cleandoc(command.loaded.help or "").split("\n\n")[0].split()) == help_line, name
        usage = runner.invoke(app, [name, "--help"], env=wide)
        assert usage.exit_code == 0 and f"Usage: root {name}" in usage.output, usage.output
        assert "--install-completion" not in usage.output  # registered as a subcommand, not a program
    recipes = runner.invoke(app, ["train", "--list"])
    assert recipes.exit_code == 0 and "paraclip-starter-cpu" in recipes.output.split()


@pytest.mark.quick
@pytest.mark.parametrize("token", ["change-me", " Change-Me ", "secret"])
def test_serve_refuses_a_placeholder_admin_token_before_starting_anything(token, tmp_path):
    refused = runner.invoke(app, ["serve", "--port", "1"], env={"PARASEEK_ADMIN_TOKEN": token, "PARASEEK_HOME": str(tmp_path)})
    assert refused.exit_code == 2
    assert "PARASEEK_ADMIN_TOKEN is a placeholder, not a secret" in refused.output
    assert not any(tmp_path.iterdir())  # nothing built: it stopped at reading its settings
