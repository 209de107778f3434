"""Contrastive objectives of ParaCLIP, LaCLIP and PC-CLIP, an anchor term, and WiSE-FT.

All embeddings are L2-normalised before they get here; ``temperature`` divides the cosine logits.
"""

from __future__ import annotations

import math

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import torch
import torch.nn.functional as F
from torch import nn


class Temperature(nn.Module):
    """Fixed or learnable temperature (learnable: log-parametrised, clamped as in CLIP)."""

    def __init__(self, value: float = 0.07, learnable: bool = False, min_value: float = 0.01):
        super().__init__()
        self.min_value = min_value
        log_t = torch.tensor(math.log(value))
        if learnable:
            self.log_t = nn.Parameter(log_t)
        else:
            self.register_buffer("log_t", log_t)

    def forward(self) -> torch.Tensor:
        return self.log_t.exp().clamp(min=self.min_value)


def info_nce(a: torch.Tensor, b: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """Symmetric InfoNCE: row i of ``a`` and row i of ``b`` are positives, every other row a negative.
    = (CE(a b^T / t, I) + CE(b a^T / t, I)) / 2."""
    logits = a @ b.T / temperature
    target = torch.arange(len(a), device=a.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def paraclip_loss(
    image: torch.Tensor, x: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, temperature, *,
    l1_text: str = "x2", use_l1: bool = True, use_l2: bool = True, use_l3: bool = True,
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> tuple[torch.Tensor, dict[str, float]]:
    """ParaCLIP: L1(X_I, X''_T) + L2(X_T, X'_T) + L3(X'_T, X''_T).

    ``x``: captions, ``x1``: their paraphrases x', ``x2``: paraphrases of x' avoiding its words (x'').
    Ablations: ``l1_text`` picks which texts L1 pairs with the images (x, x1 or x2), and each term can
    be switched off or weighted (``weights`` of L1, L2, L3). Text rows beyond ``len(image)`` are paraphrase sets without a photo: they take part
    in L2 and L3 only.
    """
    texts = {"x": x, "x1": x1, "x2": x2}
    if l1_text not in texts:
        raise ValueError(f"l1_text must be one of {sorted(texts)}, not {l1_text!r}")
    parts: dict[str, torch.Tensor] = {}
    if use_l1:
        parts["l1"] = info_nce(image, texts[l1_text][: len(image)], temperature)
    if use_l2:
        parts["l2"] = info_nce(x, x1, temperature)
    if use_l3:
        parts["l3"] = info_nce(x1, x2, temperature)
    if not parts:
        raise ValueError("every ParaCLIP term is switched off")
    weight = dict(zip(("l1", "l2", "l3"), weights))
    total = torch.stack([weight[name] * term for name, term in parts.items()]).sum()
    return total, {k: float(v.detach()) for k, v in parts.items()}


def multi_positive_loss(image: torch.Tensor, texts: torch.Tensor, owner: torch.Tensor, temperature) -> torch.Tensor:
    """LaCLIP's multi-positive contrastive loss: each image's positives are all texts it owns (its
    caption and rewrites). The target distribution spreads evenly over the positives:
    loss = mean_i CE(softmax(image_i texts^T / t), uniform over {j: owner_j = i})."""
    logits = image @ texts.T / temperature
    positives = (owner[None, :] == torch.arange(len(image), device=image.device)[:, None]).float()
    if (positives.sum(1) == 0).any():
        raise ValueError("every image needs at least one text")
    target = positives / positives.sum(1, keepdim=True)
    return -(target * F.log_softmax(logits, dim=1)).sum(1).mean()


def difference_loss(image1: torch.Tensor, image2: torch.Tensor, difference_text: torch.Tensor, temperature) -> torch.Tensor:
    """PC-CLIP: align g(I1) - g(I2) (normalised) with f(text describing the difference), InfoNCE over
    the batch of pairs."""
    delta = F.normalize(image1 - image2, dim=-1)
    return info_nce(delta, difference_text, temperature)


def anchor_loss(tuned: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Keeps the tuned tower close to the original one: mean (1 - cosine) between their embeddings."""
    return (1 - (tuned * original).sum(-1)).mean()


def relation_loss(tuned: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Similarity-structure distillation: mean squared difference between the off-diagonal cosines of
    the tuned rows and of the original tower's rows of the same texts."""
    n = len(tuned)
    if n < 2:
        return tuned.sum() * 0
    off = ~torch.eye(n, dtype=torch.bool, device=tuned.device)
    return ((tuned @ tuned.T - original @ original.T)[off] ** 2).mean()


def cosent_loss(a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor, scale: float = 20.0) -> torch.Tensor:
    """CoSENT: every two pairs whose gold scores differ are ranked by their cosines, the higher-scored
    pair's cosine above the other's; log(1 + sum over those (i, j) of exp(scale * (cos_j - cos_i)))."""
    cos = (a * b).sum(-1) * scale
    wrong = (cos[None, :] - cos[:, None])[scores[:, None] > scores[None, :]]  # cos_j - cos_i where score_i > score_j
    return torch.logsumexp(torch.cat([wrong.new_zeros(1), wrong]), dim=0)


@torch.no_grad()
def wise_ft(original: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """WiSE-FT weight interpolation: (1 - alpha) * original + alpha * tuned (alpha = 1: tuned as is)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"wise_ft alpha must be in [0, 1], not {alpha}")
    out = {}
    for name, t in tuned.items():
        o = original[name]
        out[name] = ((1 - alpha) * o.float() + alpha * t.float()).to(t.dtype) if t.is_floating_point() else t.clone()
    return out
