from tests.service.conftest import demo_snapshot, uvicorn_server  # noqa: F401  (shared fixtures)
