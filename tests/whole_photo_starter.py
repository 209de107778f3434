"""The starter of the service, index and load-test tests: the root conftest's
``whole_photo_starter_bundle`` (one classifier pass per photo instead of the shipped ten) under the
names the other fixtures take.

Their conftests import these fixtures, so there ``starter_bundle``, ``starter_encoder`` and
``starter_bank``, and every fixture built on them (the demo snapshot, an app's settings), are the
whole-photo starter's. Its text tower is the shipped one; only image vectors and the image space
differ. Each override is a fixture of its own, cached apart from the root's."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", name="starter_bundle")
def whole_photo_bundle(whole_photo_starter_bundle) -> Path:
    return whole_photo_starter_bundle


@pytest.fixture(scope="session", name="starter_encoder")
def whole_photo_encoder(starter_bundle):
    from paraseek.core.encoder import Encoder

    return Encoder(starter_bundle, memory_arena=False)  # as the root's: no session-long activation arena


@pytest.fixture(scope="session", name="starter_bank")
def whole_photo_bank(starter_encoder, tmp_path_factory):
    from tests.conftest import small_caption_bank

    return small_caption_bank(starter_encoder, tmp_path_factory)


@pytest.fixture(scope="session")
def whole_photo_robust_bundle(tmp_path_factory) -> Path:
    """The robust starter over the same whole-photo image side: a second text tower of the served image
    space (a first-answer bundle, ``PARASEEK_FIRST_ANSWER_BUNDLE``) whose answers differ from the plain one's."""
    from paraseek.training.export.starter import ROBUST_LAYERS, build_starter
    from tests.conftest import built_once

    return built_once(tmp_path_factory, "starter-robust-whole-photo",
                      lambda out: build_starter(out, int8=True, crop_grid=0, tuned_layers=ROBUST_LAYERS))
