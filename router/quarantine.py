"""Requests that keep failing instances are not sent to another one.

A request is known by what it asks (its prompt and sampling parameters, not its id or seed, so a
client resending it is the same request). Each instance that failed while running it (the call
broke, the node died or gave up) is recorded; once ``max_failures`` distinct instances have
within ``window_s`` of each other, the request is quarantined for ``ttl_s``: it and its resends
are refused (400, ``request_quarantined``) before they reach a node, and it does not fall back
to a decode node either. Without this, one request that crashes the engine it lands on walks the
whole pool (a prefill retry on each node, then the fallback on each decode node) — in seconds,
or tens of seconds when it hangs each node until the stream's deadline.

The window is what keeps an innocent request out: a crash, a network cut or a drain fails every
request its node holds, and a prompt many clients send (a benchmark's, a shared system prompt)
meets several such faults over minutes. Counted over the quarantine's whole 10 minutes, a
cluster that scaled down twice and lost a node was enough to refuse such a prompt for everyone
(seen in the compose test's partition phase: 39 of 816 requests refused). The window alone is
not enough: on a fast machine the compose test's decode crash, prefill crash and network cut
fall within one minute, and a prompt in flight at each was refused (8 of 1,110). So a request
that *finishes* clears its record (``succeeded``): a prompt that was served whole after failing
does not kill engines, and only failures since its last success count. A request of death never
finishes, so its failures keep adding up, its resends' too.

A failure the request caused and a node reported (INVALID_ARGUMENT, or ABORTED: "the request
failed in the engine") is never retried at all (``router.flow``); this catches what a node could
not report because it died.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.sampling_params import SamplingParams
from router.errors import RouterError

logger = logging.getLogger(__name__)


@dataclass
class _Record:
    failures: dict[str, float] = field(default_factory=dict)  # instance → when it failed
    since: float | None = None  # the start of the quarantine; None: not quarantined


class Quarantine:
    """Failures per request; bounded (the oldest records are forgotten past ``capacity``)."""

    def __init__(
        self,
        max_failures: int = 3,
        ttl_s: float = 600.0,
        capacity: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = 60.0,
    ) -> None:
        if max_failures < 1 or ttl_s <= 0 or capacity < 1 or window_s <= 0:
            raise ValueError("need max_failures >= 1, ttl_s > 0, window_s > 0 and capacity >= 1")
        self.max_failures = max_failures
        self.ttl_s = ttl_s
        self.window_s = window_s
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
        now = self.clock()
        record = self._live(key)
        if record is None:
            record = self._records[key] = _Record()
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        if record.since is not None:
            return  # quarantined already
        record.failures = {i: t for i, t in record.failures.items() if now - t <= self.window_s}
        record.failures[instance_id] = now
        if len(record.failures) >= self.max_failures:
            record.since = now  # quarantined from now
            logger.warning(
                "request %s quarantined for %g s: it failed instances %s within %g s",
                key.hex()[:16],
                self.ttl_s,
                ", ".join(sorted(record.failures)),
                self.window_s,
            )

    def succeeded(self, key: bytes) -> None:
        """The request ``key`` finished: what failed under it before was not its doing, so its
        failures are forgotten (a quarantine, once begun, runs its course)."""
        record = self._records.get(key)
        if record is not None and record.since is None:
            del self._records[key]

    def check(self, key: bytes) -> None:
        """Raise a 400 (``request_quarantined``) when the request is quarantined."""
        record = self._live(key)
        if record is not None and record.since is not None:
            raise RouterError(
                f"this request failed {len(record.failures)} instances; it is quarantined"
                f" for {self.ttl_s:g} s and will not be retried",
                code="request_quarantined",
                grpc_code=grpc.StatusCode.FAILED_PRECONDITION,
            )

    def _live(self, key: bytes) -> _Record | None:
        """The request's record, if it still matters: quarantined less than ``ttl_s`` ago, or
        with a failure within the window."""
        record = self._records.get(key)
        if record is None:
            return None
        now = self.clock()
        if record.since is not None:
            expired = now - record.since > self.ttl_s
        else:
            expired = all(now - t > self.window_s for t in record.failures.values())
        if expired:
            del self._records[key]
            return None
        return record
