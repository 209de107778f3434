"""Evaluation fixtures: the starter's whole-photo image side (tests/whole_photo_starter.py). The harness's
tests index photos several times over and test what it computes from the vectors, not the default's quality
(tests/training/test_starter.py measures that)."""

from tests.whole_photo_starter import whole_photo_bank, whole_photo_bundle, whole_photo_encoder  # noqa: F401  (fixtures)
