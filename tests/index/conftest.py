"""Index fixtures: the starter's whole-photo image side (tests/whole_photo_starter.py)."""

from tests.whole_photo_starter import whole_photo_bank, whole_photo_bundle, whole_photo_encoder  # noqa: F401  (fixtures)
