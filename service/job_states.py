"""The states of an admin reindex job: one home for the service (its schemas and job manager) and for the
admin client, which reads them without importing the service's schemas (and with them the index and
numpy: a second of `paraseek admin`'s start)."""

from __future__ import annotations

from typing import Literal

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
FINISHED: tuple[JobState, ...] = ("succeeded", "failed", "cancelled")  # the states a job ends in
