"""A query head: a small residual MLP on a query vector, ``normalise(q + MLP(q))``, trained from a caption
bank (``paraseek models train-head``, ``paraseek.training.query_head``) to output what the bank's mean
shift would (``n`` neighbours, ``rounds`` rounds) without looking the bank up. It lives in the bank's
folder (``head.npz``), since it imitates that bank in that bundle's text space; expansion method
``head`` applies it, optionally followed by bank rounds. Serving runs this numpy forward; training runs
the same arithmetic in torch (GELU in its tanh form on both sides, so the two agree to float rounding).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paraseek.core.encoder import l2_normalize
from paraseek.core.errors import UserError

HEAD_FILE = "head.npz"


@dataclass(frozen=True)
class HeadTraining:
    """How a head is trained (``paraseek.training.query_head``; the defaults are the starter's head, whose
    sweep is in loadtests/results/robust_starter.md). Torch-free, so the CLI reads its defaults."""

    neighbours: int = 64  # the mean shift it imitates: the served default's
    rounds: int = 3
    hidden: int = 1024
    layers: int = 2  # hidden layers; more stopped paying on the starter
    steps: int = 6000
    batch: int = 512
    lr: float = 1e-3
    weight_decay: float = 1e-4
    held_out: float = 0.02
    seed: int = 0

    def __post_init__(self):
        if min(self.neighbours, self.rounds, self.hidden, self.layers, self.steps, self.batch) < 1:
            raise ValueError("neighbours, rounds, hidden, layers, steps and batch must be at least 1")
        if not 0 <= self.held_out < 0.5:
            raise ValueError("held_out is a fraction below 0.5")


class QueryHeadError(UserError):
    """The head file is missing, malformed, or does not fit the bank's vectors."""


def check_blend(blend: float) -> None:
    """The one rule for a head's ``blend`` (the request schema states it as its field's bounds)."""
    if not 0 < blend <= 1:
        raise QueryHeadError(f"blend is a share of the head's move, in (0, 1], not {blend}")


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # a Python float: a numpy float64 would promote float32 arrays


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (torch's ``gelu(approximate="tanh")``): numpy has no erf. Keeps x's dtype."""
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))))


@dataclass(frozen=True)
class QueryHead:
    weights: list[np.ndarray]  # each (out, in), float32, as torch's nn.Linear stores them
    biases: list[np.ndarray]
    config: dict = field(default_factory=dict)  # how it was trained (neighbours, rounds, steps, loss, ...)

    def __post_init__(self):
        if not self.weights or len(self.weights) != len(self.biases):
            raise QueryHeadError("a query head needs one bias per weight, at least one layer")
        dim = self.weights[0].shape[1]
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            if w.ndim != 2 or b.shape != (w.shape[0],) or (i and w.shape[1] != self.weights[i - 1].shape[0]):
                raise QueryHeadError(f"query head layer {i}: shapes {w.shape} and {b.shape} do not chain")
        if self.weights[-1].shape[0] != dim:
            raise QueryHeadError(f"query head maps {dim} dimensions to {self.weights[-1].shape[0]}: it must keep them")

    @property
    def dim(self) -> int:
        return int(self.weights[0].shape[1])

    @property
    def digest(self) -> str:
        """sha256 of the float16 weights as ``write`` stores them: which head this is, whatever file holds it."""
        h = hashlib.sha256()
        for a in (*self.weights, *self.biases):
            h.update(np.ascontiguousarray(a, dtype=np.float16).tobytes())
        return h.hexdigest()

    def __call__(self, queries: np.ndarray, blend: float = 1.0) -> np.ndarray:
        """The moved queries, normalised; (Q, d) or (d,) as given. ``blend`` < 1 moves them only that share of
        the way to the head's output (``normalise(q + blend * (head(q) - q))``): the bank's mean shift blurs the
        precise first answer, and a part of the move keeps more of it (the trade is in robust_starter.md)."""
        check_blend(blend)
        q = np.atleast_2d(queries).astype(np.float32)
        if q.shape[1] != self.dim:
            raise QueryHeadError(f"query head takes {self.dim}-dimensional vectors, not {q.shape[1]}")
        h = q
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = h @ w.T + b
            if i < len(self.weights) - 1:
                h = gelu_tanh(h)
        moved = l2_normalize(q + h)
        if blend != 1:
            start = l2_normalize(q)
            moved = l2_normalize(start + blend * (moved - start))
        return moved[0] if np.ndim(queries) == 1 else moved

    def write(self, folder: str | Path) -> Path:
        """``folder/head.npz``: float16 weights (half the size; the forward runs in float32) and the config."""
        path = Path(folder) / HEAD_FILE
        arrays: dict[str, np.ndarray] = {f"weight_{i}": w.astype(np.float16) for i, w in enumerate(self.weights)}
        arrays |= {f"bias_{i}": b.astype(np.float16) for i, b in enumerate(self.biases)}
        arrays["config"] = np.array(json.dumps(self.config))
        tmp = path.with_name(HEAD_FILE + ".tmp.npz")
        np.savez(tmp, **arrays)  # type: ignore[arg-type]  # the stub reads **arrays as allow_pickle
        os.replace(tmp, path)  # a reader sees the old head or the new one, never half of one
        return path

    @classmethod
    def read(cls, path: str | Path) -> QueryHead:
        """A head as ``write`` stores it (``path``: the file or its folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / HEAD_FILE
        try:
            with np.load(path, allow_pickle=False) as z:
                layers = sum(1 for k in z.files if k.startswith("weight_"))
                weights = [z[f"weight_{i}"].astype(np.float32) for i in range(layers)]
                biases = [z[f"bias_{i}"].astype(np.float32) for i in range(layers)]
                config = json.loads(str(z["config"])) if "config" in z.files else {}
        except (OSError, KeyError, ValueError) as exc:
            raise QueryHeadError(f"query head {path} is unreadable: {exc}") from exc
        return cls(weights, biases, config)
