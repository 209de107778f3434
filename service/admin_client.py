"""A client of a running service's admin API (``/v1/admin/*``), for scripts, cron jobs and the
``paraseek admin`` commands: start a reindex and wait for it, list and cancel jobs, roll back.

It speaks only HTTP (httpx, from the ``serve`` extra) and returns the service's JSON as it is. What the
service refuses comes back as ``AdminRequestError`` (a ``UserError``: the command was wrong) with the
service's own message and the offending field; a service that cannot be reached, or answers 5xx, as
``Unavailable`` (retry later).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from paraseek.core.errors import Unavailable, UserError
from paraseek.service.job_states import FINISHED


class AdminRequestError(UserError):
    """The service refused the request (4xx): ``status`` and the service's message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _message(response) -> str:
    """The service's explanation: FastAPI's ``detail`` (a string, or validation errors naming their
    field), else the body's start."""
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    if isinstance(detail, list):  # validation errors: "body.source: Field required"
        return "; ".join(".".join(str(part) for part in item.get("loc", [])) + f": {item.get('msg', '')}" for item in detail)
    if detail:
        return str(detail)
    return response.text[:300] or response.reason_phrase


class AdminClient:
    """``url``: the service's base URL; ``token``: its ``PARASEEK_ADMIN_TOKEN``. ``client``: an
    ``httpx.Client`` to send through instead of a new one (a test's ``TestClient``, a proxy setup)."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 30.0, client=None):
        if client is None:
            import httpx  # lazily: the serve extra

            client = httpx.Client(base_url=url, timeout=timeout)
        self._http = client
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs) -> Any:
        import httpx

        try:
            response = self._http.request(method, path, headers=self._headers, **kwargs)
        except httpx.TransportError as exc:  # refused, timed out, DNS: nothing the command can fix
            raise Unavailable(f"{self.url} did not answer ({type(exc).__name__}: {exc})") from exc
        if response.status_code >= 500:
            raise Unavailable(f"{self.url} answered {response.status_code}: {_message(response)}")
        if response.status_code == 404 and "disabled" in response.text:
            raise AdminRequestError(404, f"{_message(response)} (the service was started without PARASEEK_ADMIN_TOKEN)")
        if response.status_code >= 400:
            raise AdminRequestError(response.status_code, _message(response))
        return response.json()

    def reindex(self, source: str, **options) -> dict:
        """Start a reindex (``POST /v1/admin/reindex``): ``source`` and the request's other fields
        (``images``, ``bundle``, ``index_type``, ``index_params``, ``reuse``, ``checksum``, ``dry_run``);
        fields left None are not sent. The job, queued or running."""
        body = {"source": source, **{k: v for k, v in options.items() if v is not None}}
        return self._call("POST", "/v1/admin/reindex", json=body)

    def jobs(self, states: Iterable[str] = ()) -> list[dict]:
        """The jobs the service remembers, newest first; only those in ``states`` when given."""
        return self._call("GET", "/v1/admin/jobs", params=[("state", s) for s in states])

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/admin/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict:
        """Cancel a queued or running job: a queued one comes back cancelled, a running one still
        running (it stops at its next photo or phase: ``wait`` for it)."""
        return self._call("POST", f"/v1/admin/jobs/{job_id}/cancel")

    def wait(self, job_id: str, *, poll_s: float = 1.0, timeout_s: float | None = None,
             on_update: Callable[[dict], None] | None = None) -> dict:
        """Poll the job until it has ended and return it. ``on_update(job)`` sees each poll's answer
        (a progress display). ``timeout_s``: give up waiting (``TimeoutError``; the job goes on)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if on_update is not None:
                on_update(job)
            if job["state"] in FINISHED:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job['state']} after {timeout_s:g} s (it goes on)")
            time.sleep(poll_s)

    def versions(self) -> dict:
        """The published versions, oldest first, which one is current and which one this server serves."""
        return self._call("GET", "/v1/admin/versions")

    def activate(self, version: str | None = None, *, previous: bool = False) -> dict:
        """Serve a published version and make it current; ``previous=True`` rolls back."""
        body: dict[str, Any] = {"previous": True} if previous else {"version": version}
        return self._call("POST", "/v1/admin/activate", json=body)

    def reload(self, bundle: str, precision: str | None = None) -> dict:
        """Serve another bundle (same image space) over the served version."""
        body = {"bundle": bundle, **({"precision": precision} if precision else {})}
        return self._call("POST", "/v1/admin/reload", json=body)
