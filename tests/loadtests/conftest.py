from tests.service.conftest import demo_snapshot, uvicorn_server  # noqa: F401  (shared fixtures)
from tests.whole_photo_starter import whole_photo_bank, whole_photo_bundle, whole_photo_encoder  # noqa: F401  (fixtures)
