"""The service's own errors: what a route turns into a 4xx, and a swap that lost a race."""

from __future__ import annotations

from paraseek.core.errors import UserError


class StaleSwap(RuntimeError):
    """What a swap meant to replace is no longer what is served (-> 409, or a failed job)."""


class RequestError(UserError):
    """A well-formed request that cannot be answered as asked (-> 4xx naming ``field``)."""

    def __init__(self, field: str, message: str, status: int = 422):
        super().__init__(message)
        self.field = field
        self.status = status
