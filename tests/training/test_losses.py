"""Losses against hand-computed values."""

import math

import pytest
import torch
import torch.nn.functional as F

from paraseek.training.losses import (Temperature, anchor_loss, difference_loss, info_nce, multi_positive_loss,
                             paraclip_loss, wise_ft)


pytestmark = pytest.mark.quick


def test_info_nce_hand_computed():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # logits = a a^T / 0.5 = [[2, 0], [0, 2]]: each row CE = -log(e^2 / (e^2 + 1))
    expected = -math.log(math.exp(2) / (math.exp(2) + 1))
    assert float(info_nce(a, a, 0.5)) == pytest.approx(expected)
    b = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # positives swapped: every positive logit is 0, negatives 2
    assert float(info_nce(a, b, 0.5)) == pytest.approx(-math.log(1 / (1 + math.exp(2))))


def test_info_nce_is_symmetric_in_its_arguments():
    torch.manual_seed(0)
    a, b = F.normalize(torch.randn(5, 8), dim=-1), F.normalize(torch.randn(5, 8), dim=-1)
    assert float(info_nce(a, b, 0.1)) == pytest.approx(float(info_nce(b, a, 0.1)), rel=1e-6)


def test_paraclip_is_sum_of_terms_and_ablations():
    torch.manual_seed(1)
    img, x, x1, x2 = (F.normalize(torch.randn(4, 6), dim=-1) for _ in range(4))
    total, parts = paraclip_loss(img, x, x1, x2, 0.1)
    assert parts["l1"] == pytest.approx(float(info_nce(img, x2, 0.1)))
    assert parts["l2"] == pytest.approx(float(info_nce(x, x1, 0.1)))
    assert parts["l3"] == pytest.approx(float(info_nce(x1, x2, 0.1)))
    assert float(total) == pytest.approx(sum(parts.values()))
    only_l1, p = paraclip_loss(img, x, x1, x2, 0.1, l1_text="x", use_l2=False, use_l3=False)
    assert set(p) == {"l1"} and float(only_l1) == pytest.approx(float(info_nce(img, x, 0.1)))
    with pytest.raises(ValueError, match="switched off"):
        paraclip_loss(img, x, x1, x2, 0.1, use_l1=False, use_l2=False, use_l3=False)
    with pytest.raises(ValueError, match="l1_text"):
        paraclip_loss(img, x, x1, x2, 0.1, l1_text="x3")


def test_multi_positive_hand_computed():
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    texts = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    owner = torch.tensor([0, 0, 1])
    # image 0 logits (t=1): [1, 1, 0]; target [.5, .5, 0] -> -log(e/(2e+1))
    # image 1 logits: [0, 0, 1]; target [0, 0, 1] -> -log(e/(e+2))
    e = math.e
    expected = (-math.log(e / (2 * e + 1)) - math.log(e / (e + 2))) / 2
    assert float(multi_positive_loss(image, texts, owner, 1.0)) == pytest.approx(expected)
    # one positive per image reduces to the image-to-text half of InfoNCE
    a = F.normalize(torch.randn(3, 4), dim=-1)
    one = multi_positive_loss(a, a, torch.arange(3), 0.2)
    assert float(one) == pytest.approx(float(F.cross_entropy(a @ a.T / 0.2, torch.arange(3))))


def test_difference_loss_uses_normalised_difference():
    i1 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    i2 = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    delta = F.normalize(i1 - i2, dim=-1)
    assert float(difference_loss(i1, i2, delta, 0.1)) == pytest.approx(float(info_nce(delta, delta, 0.1)))


def test_anchor_and_temperature_and_wise_ft():
    v = F.normalize(torch.tensor([[1.0, 1.0]]), dim=-1)
    assert float(anchor_loss(v, v)) == pytest.approx(0.0, abs=1e-6)
    assert float(anchor_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]))) == pytest.approx(1.0)
    t = Temperature(0.07, learnable=True)
    assert float(t().detach()) == pytest.approx(0.07) and t.log_t.requires_grad
    assert list(Temperature(0.07).parameters()) == []  # fixed: a buffer, not trained
    mixed = wise_ft({"w": torch.zeros(2)}, {"w": torch.ones(2)}, 0.25)
    assert mixed["w"].tolist() == [0.25, 0.25]
    with pytest.raises(ValueError):
        wise_ft({"w": torch.zeros(1)}, {"w": torch.ones(1)}, 1.5)


def test_relation_loss_is_zero_for_the_same_structure_and_grows_with_a_change():
    from paraseek.training.losses import relation_loss

    torch.manual_seed(0)
    a = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    rotation = torch.linalg.qr(torch.randn(16, 16))[0]
    assert float(relation_loss(a @ rotation, a)) == pytest.approx(0.0, abs=1e-10)  # a rotation keeps every cosine
    b = torch.nn.functional.normalize(a + 0.02 * torch.randn(8, 16), dim=-1)
    c = torch.nn.functional.normalize(a + 1.0 * torch.randn(8, 16), dim=-1)
    assert 0 < float(relation_loss(b, a)) < float(relation_loss(c, a))
    assert float(relation_loss(a[:1], a[:1])) == 0.0


def test_cosent_loss_hand_computed_and_zero_only_for_the_gold_order():
    from paraseek.training.losses import cosent_loss

    def unit(angles):
        return torch.stack([torch.cos(torch.tensor(angles)), torch.sin(torch.tensor(angles))], -1)

    a = unit([0.0, 0.0, 0.0])
    b = unit([0.0, 0.8, 1.4])  # cosines 1 > cos(0.8) > cos(1.4)
    cos = torch.cos(torch.tensor([0.0, 0.8, 1.4]))
    gold = torch.tensor([5.0, 3.0, 1.0])
    # gold order: every term exp(20 (cos_j - cos_i)) with score_i > score_j is small
    want = math.log(1 + sum(math.exp(20 * float(cos[j] - cos[i])) for i, j in ((0, 1), (0, 2), (1, 2))))
    assert float(cosent_loss(a, b, gold)) == pytest.approx(want, rel=1e-4)
    assert float(cosent_loss(a, b, gold)) < 0.01
    assert float(cosent_loss(a, b, gold.flip(0))) > 10  # the reverse order is penalised
    assert float(cosent_loss(a, b, torch.tensor([2.0, 2.0, 2.0]))) == pytest.approx(0.0)  # ties rank nothing
    tuned = b.clone().requires_grad_()
    cosent_loss(a, tuned, gold.flip(0)).backward()  # the gradient step lifts the low-cosine, high-score pair
    stepped = F.normalize(tuned.detach() - 0.01 * tuned.grad, dim=-1)
    assert float((a[2] * stepped[2]).sum()) > float(cos[2])
