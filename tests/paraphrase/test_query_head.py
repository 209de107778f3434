"""The query head: its numpy forward, its file, its place in a caption bank, and expansion method 'head'."""

import asyncio
import math

import numpy as np
import pytest

from paraseek.paraphrase import caption_bank as caption_bank_module
from paraseek.paraphrase.caption_bank import CaptionBank, CaptionBankError, with_shipped_head
from paraseek.paraphrase.expansions import ExpansionParams, expansion_method
from paraseek.paraphrase.query_head import HEAD_FILE, HeadTraining, QueryHead, QueryHeadError, gelu_tanh
from tests.paraphrase.test_caption_bank import TEXTS, FakeEncoder


pytestmark = pytest.mark.quick


def random_head(dim=4, hidden=6, layers=1, seed=0, scale=0.5) -> QueryHead:
    rng = np.random.default_rng(seed)
    widths = [dim] + [hidden] * layers + [dim]
    weights = [rng.normal(0, scale, (o, i)).astype(np.float32) for i, o in zip(widths, widths[1:])]
    biases = [rng.normal(0, scale, o).astype(np.float32) for o in widths[1:]]
    return QueryHead(weights, biases, {"seed": seed})


def test_gelu_tanh_is_close_to_the_exact_gelu():
    x = np.linspace(-5, 5, 101)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    assert np.abs(gelu_tanh(x) - exact).max() < 1e-3
    assert gelu_tanh(np.array([0.0]))[0] == 0.0
    # float32 stays float32: a float64 activation made the next layer convert its weights on every call
    assert gelu_tanh(np.ones(3, np.float32)).dtype == np.float32


def test_forward_is_the_residual_mlp_normalised():
    head = random_head(layers=2)
    q = np.array([[0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]], np.float32)
    w, b = head.weights, head.biases
    h = gelu_tanh(gelu_tanh(q @ w[0].T + b[0]) @ w[1].T + b[1]) @ w[2].T + b[2]
    expected = (q + h) / np.linalg.norm(q + h, axis=1, keepdims=True)
    assert head(q) == pytest.approx(expected, abs=1e-6) and head(q).dtype == np.float32
    assert head(q[0]) == pytest.approx(expected[0], abs=1e-6)  # one vector in, one out
    assert np.linalg.norm(head(q), axis=1) == pytest.approx([1, 1])
    with pytest.raises(QueryHeadError, match="takes 4-dimensional vectors, not 3"):
        head(np.ones((1, 3), np.float32))


def test_blend_moves_the_query_a_share_of_the_way_to_the_heads_output():
    head = random_head(layers=2, scale=2.0)
    q = np.array([[0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]], np.float32)
    full = head(q)
    half = head(q, blend=0.5)
    expected = (q + 0.5 * (full - q)) / np.linalg.norm(q + 0.5 * (full - q), axis=1, keepdims=True)
    assert half == pytest.approx(expected, abs=1e-6) and half.dtype == np.float32
    assert head(q, blend=1.0) == pytest.approx(full)
    # a smaller share stays nearer the query: the cosine to it falls as the share grows
    cos = [float(np.sum(head(q, blend=b)[0] * q[0])) for b in (0.1, 0.5, 1.0)]
    assert cos[0] > cos[1] > cos[2]
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(QueryHeadError, match="blend is a share of the head's move"):
            head(q, blend=bad)


def test_a_zero_last_layer_is_the_identity():
    head = random_head()
    identity = QueryHead([head.weights[0], np.zeros_like(head.weights[1])], [head.biases[0], np.zeros_like(head.biases[1])])
    q = np.array([[0.6, 0.8, 0.0, 0.0]], np.float32)
    assert identity(q) == pytest.approx(q)


def test_write_and_read_keep_weights_in_float16_and_the_config(tmp_path):
    head = random_head(layers=2)
    path = head.write(tmp_path)
    assert path == tmp_path / HEAD_FILE and not list(tmp_path.glob("*.tmp*"))
    with np.load(path) as z:
        assert z["weight_0"].dtype == np.float16
    back = QueryHead.read(tmp_path)
    assert back.config == {"seed": 0} and len(back.weights) == 3
    q = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
    assert back(q) == pytest.approx(head(q), abs=2e-3)  # float16 weights, float32 arithmetic


def test_malformed_heads_are_refused(tmp_path):
    head = random_head()
    with pytest.raises(QueryHeadError, match="do not chain"):
        QueryHead([head.weights[0], head.weights[0]], head.biases)
    with pytest.raises(QueryHeadError, match="must keep them"):
        QueryHead([head.weights[0]], [head.biases[0]])
    with pytest.raises(QueryHeadError, match="one bias per weight"):
        QueryHead(head.weights, head.biases[:1])
    (tmp_path / HEAD_FILE).write_bytes(b"not a zip")
    with pytest.raises(QueryHeadError, match="unreadable"):
        QueryHead.read(tmp_path)


def test_training_settings_are_checked():
    with pytest.raises(ValueError, match="at least 1"):
        HeadTraining(rounds=0)
    with pytest.raises(ValueError, match="below 0.5"):
        HeadTraining(held_out=0.5)


def test_a_bank_keeps_its_head_until_its_vectors_are_rewritten(tmp_path):
    enc = FakeEncoder()
    bank = CaptionBank.build(enc, TEXTS, tmp_path / "bank")
    assert bank.head is None and CaptionBank.load(tmp_path / "bank", enc).head is None
    bank.with_head(random_head())
    loaded = CaptionBank.load(tmp_path / "bank", enc)
    assert loaded.head is not None and loaded.head.config == {"seed": 0}
    with pytest.raises(CaptionBankError, match="does not fit a bank of 4"):
        bank.with_head(random_head(dim=3))
    CaptionBank.build(enc, TEXTS[:3], tmp_path / "bank")  # new vectors: the head trained on the old ones goes
    assert not (tmp_path / "bank" / HEAD_FILE).exists()
    assert CaptionBank.load(tmp_path / "bank", enc).head is None


def test_the_shipped_head_joins_only_the_bank_it_was_trained_on(tmp_path, monkeypatch):
    enc = FakeEncoder(name="shipped")
    bank = CaptionBank.build(enc, TEXTS, tmp_path / "bank")
    ship = tmp_path / "ship"
    ship.mkdir()
    monkeypatch.setattr(caption_bank_module, "SHIPPED_VECTORS", ship)
    manifest = type("M", (), {"name": "shipped", "version": "1"})()
    enc.manifest = manifest
    assert with_shipped_head(bank, enc).head is None  # the package ships none for this bundle
    np.save(ship / "shipped-v1.bank.npy", bank.vectors.astype(np.float16)[::-1])  # other vectors
    random_head().write(ship)
    (ship / HEAD_FILE).rename(ship / f"shipped-v1.{HEAD_FILE}")
    assert with_shipped_head(bank, enc).head is None
    np.save(ship / "shipped-v1.bank.npy", bank.vectors.astype(np.float16))
    added = with_shipped_head(bank, enc)
    assert added.head is not None and (tmp_path / "bank" / HEAD_FILE).is_file()


def test_a_shipped_head_learnt_from_a_teacher_joins_any_bank_of_its_bundle(tmp_path, monkeypatch):
    """A teacher's head is a function of the two towers, not of the bank's vectors: it needs no shipped
    vectors to match, only the bundle's name and version."""
    enc = FakeEncoder(name="shipped")
    enc.manifest = type("M", (), {"name": "shipped", "version": "1"})()
    bank = CaptionBank.build(enc, TEXTS[:3], tmp_path / "bank")
    ship = tmp_path / "ship"
    ship.mkdir()
    monkeypatch.setattr(caption_bank_module, "SHIPPED_VECTORS", ship)
    taught = random_head()
    QueryHead(taught.weights, taught.biases, {"teacher": "robust v1 + its head@0.5"}).write(ship)
    (ship / HEAD_FILE).rename(ship / f"shipped-v1.{HEAD_FILE}")
    added = with_shipped_head(bank, enc)
    assert added.head is not None and added.head.config["teacher"] == "robust v1 + its head@0.5"
    assert CaptionBank.load(tmp_path / "bank", enc).head is not None
    enc.manifest = type("M", (), {"name": "shipped", "version": "2"})()  # another release: no head of its own
    assert with_shipped_head(CaptionBank.build(enc, TEXTS, tmp_path / "other"), enc).head is None


class BankLookups:
    """``Lookups`` straight on the bank (the service's batcher and the harness do the same lookup)."""

    def __init__(self, bank):
        self.bank, self.calls = bank, 0

    async def caption_bank(self):
        return self.bank

    async def bank_neighbours(self, bank, queries, n):
        self.calls += 1
        return bank.neighbours(queries, n)


def test_head_expansion_applies_the_head_then_its_bank_rounds(tmp_path):
    enc = FakeEncoder()
    bank = CaptionBank.build(enc, TEXTS, tmp_path / "bank").with_head(random_head())
    method = expansion_method("head")
    q = enc.encode_text(["a cat on the sea", "bananas"])
    lookups = BankLookups(bank)
    moved, texts = asyncio.run(method.expand(q, method.from_spec([]), lookups))
    assert moved == pytest.approx(bank.head(q)) and texts == [] and lookups.calls == 0  # no lookup at all
    p = method.from_spec(["1", "2"])
    assert (p.rounds, p.n) == (1, 2) and method.spec_label(p) == "head+bank2"
    moved, texts = asyncio.run(method.expand(q, p, lookups))
    rows, _ = bank.neighbours(bank.head(q), 2)
    assert moved == pytest.approx(bank.fuse(bank.head(q), rows, None)) and texts == bank.texts_of(rows[0])
    assert method.spec_label(method.from_spec([])) == "head" and method.spec_label(method.from_spec(["3"])) == "head+bank64-x3"
    method.check(ExpansionParams(rounds=0))
    p = method.from_spec(["0", "64", "0.5"])
    assert p.blend == 0.5 and method.spec_label(p) == "head@0.5"
    assert method.spec_label(method.from_spec(["1", "8", "0.25"])) == "head@0.25+bank8"
    before = lookups.calls
    moved, _ = asyncio.run(method.expand(q, p, lookups))
    assert moved == pytest.approx(bank.head(q, 0.5)) and lookups.calls == before  # the blend needs no lookup either
    with pytest.raises(ValueError, match="blend is a share of the head's move"):
        method.check(ExpansionParams(rounds=0, blend=1.5))
    with pytest.raises(ValueError, match="rounds is 0 to 4"):
        method.check(ExpansionParams(rounds=5))
    headless = CaptionBank.build(enc, TEXTS, tmp_path / "headless")
    with pytest.raises(CaptionBankError, match="no query head: train one with `paraseek models train-head`"):
        asyncio.run(method.expand(q, p, BankLookups(headless)))
