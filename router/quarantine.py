"""Requests that keep failing instances are not sent to another one.

A request is known by what it asks (its prompt and sampling parameters, not its id or seed, so a
client resending it is the same request). Each instance that failed while running it (the call
broke, the node died or gave up) is recorded; once ``max_failures`` distinct instances have, the
request is quarantined for ``ttl_s``: it and its resends are refused (400,
``request_quarantined``) before they reach a node, and it does not fall back to a decode node
either. Without this, one request that crashes the engine it lands on walks the whole pool
(a prefill retry on each node, then the fallback on each decode node).

A failure the request caused and a node reported (INVALID_ARGUMENT, or ABORTED: "the request
failed in the engine") is never retried at all (``router.flow``); this catches what a node could
not report because it died.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.sampling_params import SamplingParams
from router.errors import RouterError


@dataclass
class _Record:
    instances: set[str] = field(default_factory=set)
    since: float = 0.0  # first failure, then the start of the quarantine


class Quarantine:
    """Failures per request; bounded (the oldest records are forgotten past ``capacity``)."""

    def __init__(
        self,
        max_failures: int = 3,
        ttl_s: float = 600.0,
        capacity: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_failures < 1 or ttl_s <= 0 or capacity < 1:
            raise ValueError("need max_failures >= 1, ttl_s > 0 and capacity >= 1")
        self.max_failures = max_failures
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.clock = clock
        self._records: OrderedDict[bytes, _Record] = OrderedDict()

    @staticmethod
    def key(prompt_token_ids: list[int], params: SamplingParams) -> bytes:
        """What identifies a request here: its prompt and parameters (seed aside)."""
        digest = hashlib.sha256(repr(dataclasses.replace(params, seed=None)).encode())
        digest.update(array.array("q", prompt_token_ids).tobytes())
        return digest.digest()

    def failed(self, key: bytes, instance_id: str) -> None:
        """``instance_id`` failed while running the request ``key``."""
        record = self._live(key)
        if record is None:
            record = self._records[key] = _Record(since=self.clock())
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        if len(record.instances) < self.max_failures:
            record.instances.add(instance_id)
            if len(record.instances) == self.max_failures:
                record.since = self.clock()  # quarantined from now

    def check(self, key: bytes) -> None:
        """Raise a 400 (``request_quarantined``) when the request is quarantined."""
        record = self._live(key)
        if record is not None and len(record.instances) >= self.max_failures:
            raise RouterError(
                f"this request failed {len(record.instances)} instances; it is quarantined"
                f" for {self.ttl_s:g} s and will not be retried",
                code="request_quarantined",
                grpc_code=grpc.StatusCode.FAILED_PRECONDITION,
            )

    def _live(self, key: bytes) -> _Record | None:
        record = self._records.get(key)
        if record is not None and self.clock() - record.since > self.ttl_s:
            del self._records[key]
            return None
        return record
