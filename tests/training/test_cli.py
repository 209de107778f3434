"""`paraseek models ...` commands not covered where their library code is tested."""

import pytest
from typer.testing import CliRunner

from paraseek.cli import app
from paraseek.paraphrase.caption_bank import CaptionBank

pytestmark = pytest.mark.quick


def test_build_bank_leaves_the_held_out_pairs_texts_out(starter_bundle, tmp_path):
    (tmp_path / "mine.txt").write_text("a dog asleep\nA bus stop\na kitten\na cat on a bed\n")
    (tmp_path / "pairs.tsv").write_text("caption1\tcaption2\na bus stop\ta stop for buses\na kitten \ta young cat\n")
    r = CliRunner().invoke(app, ["models", "build-bank", "--bundle", str(starter_bundle), "--captions",
                                 str(tmp_path / "mine.txt"), "--hold-out", str(tmp_path / "pairs.tsv"), "--out", str(tmp_path / "bank")])
    assert r.exit_code == 0, r.output
    assert "2 captions left out" in r.output
    assert CaptionBank.read(tmp_path / "bank").texts == ["a dog asleep", "a cat on a bed"]
    (tmp_path / "all.tsv").write_text("caption1\tcaption2\na dog asleep\ta cat on a bed\na bus stop\ta kitten\n")
    r = CliRunner().invoke(app, ["models", "build-bank", "--bundle", str(starter_bundle), "--captions",
                                 str(tmp_path / "mine.txt"), "--hold-out", str(tmp_path / "all.tsv"), "--out", str(tmp_path / "b2")])
    assert r.exit_code == 2 and "--hold-out" in r.output and not (tmp_path / "b2").exists()
