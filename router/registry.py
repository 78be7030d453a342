"""The instance registry: which prefill and decode nodes exist, how loaded and how healthy.

Two ways in:

- *registered* instances call ``RouterService.Register`` and then ``Heartbeat`` with a fresh
  LoadReport; one silent for ``heartbeat_timeout_s`` is dropped (``expire``), and it must
  Register again (its Heartbeat answers ``known=false``).
- *static* instances come from flags (``--prefill``/``--decode``); they are never dropped, and
  a poller (``router.static_pool``) refreshes their load and health.

An instance that fails a call (UNAVAILABLE, connection reset) is *suspect* for a short cooldown:
balancers skip it, so one dead node costs each request at most one retry. Load used for
balancing is the node's last report combined with what the router itself has in flight there
(``inflight`` / ``inflight_tokens``), which is fresh between reports.

All methods are synchronous and run on the router's event loop; no locking.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve_proto import pdserve_pb2 as pb


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # serves both Prefill and Decode

    @classmethod
    def from_proto(cls, role: int) -> Role:
        try:
            return _ROLE_FROM_PROTO[role]
        except KeyError:
            raise ValueError(f"unknown role {role}") from None

    def serves(self, wanted: Role) -> bool:
        return self is wanted or self is Role.COLOCATED


_ROLE_FROM_PROTO = {
    pb.ROLE_PREFILL: Role.PREFILL,
    pb.ROLE_DECODE: Role.DECODE,
    pb.ROLE_COLOCATED: Role.COLOCATED,
}


@dataclass(frozen=True)
class Load:
    """The balancing-relevant part of a node's LoadReport."""

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    queued_prompt_tokens: int = 0
    max_num_seqs: int = 0
    draining: bool = False

    @classmethod
    def from_proto(cls, report: pb.LoadReport) -> Load:
        return cls(
            num_waiting=report.num_waiting,
            num_running=report.num_running,
            kv_usage=min(max(report.kv_usage, 0.0), 1.0),
            num_free_blocks=report.num_free_blocks,
            num_total_blocks=report.num_total_blocks,
            queued_prompt_tokens=report.queued_prompt_tokens,
            max_num_seqs=report.max_num_seqs,
            draining=report.draining,
        )


@dataclass(eq=False)
class Instance:
    """One node as the router sees it. Identity is the object (``eq=False``): a re-registered
    node is a new Instance, so per-instance state held elsewhere (affinity) starts fresh."""

    instance_id: str
    role: Role
    address: str
    static: bool = False
    model: str = ""
    fingerprint: str = ""
    load: Load = field(default_factory=Load)
    last_seen_s: float = 0.0
    healthy: bool = True
    suspect_until_s: float = 0.0
    inflight: int = 0  # router requests in flight on this instance
    inflight_tokens: int = 0  # their prompt tokens

    def available(self, now_s: float) -> bool:
        """Can take a new request: healthy, not draining, not suspect."""
        return self.healthy and not self.load.draining and now_s >= self.suspect_until_s

    def state(self, now_s: float) -> str:
        """``ready`` | ``draining`` | ``suspect`` | ``unhealthy`` (for metrics and /health)."""
        if not self.healthy:
            return "unhealthy"
        if now_s < self.suspect_until_s:
            return "suspect"
        return "draining" if self.load.draining else "ready"


class RegistrationRefused(ValueError):
    """Register was refused (model or KV layout fingerprint mismatch)."""


class Registry:
    """Instances by id. ``model`` is the served model; a node serving another is refused."""

    def __init__(
        self,
        model: str,
        heartbeat_interval_s: float = 2.0,
        heartbeat_timeout_s: float = 10.0,
        suspect_cooldown_s: float = 5.0,
        model_aliases: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < heartbeat_interval_s < heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        self.model = model
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.suspect_cooldown_s = suspect_cooldown_s
        self._model_names = {model, *model_aliases}
        self._clock = clock
        self._instances: dict[str, Instance] = {}

    # -- membership --------------------------------------------------------------------------
    def register(
        self,
        instance_id: str,
        role: Role,
        address: str,
        model: str = "",
        fingerprint: str = "",
        load: Load | None = None,
    ) -> Instance:
        """Add (or replace) a registered instance; raises RegistrationRefused on a mismatch.

        A previous entry with the same id, or with the same role and address (a restarted
        node on a reused port), is replaced.
        """
        if not instance_id or not address:
            raise RegistrationRefused("instance_id and address are required")
        if model and model not in self._model_names:
            raise RegistrationRefused(f"router serves {self.model!r}, node serves {model!r}")
        self._check_fingerprint(fingerprint, instance_id)
        for old in list(self._instances.values()):
            if old.instance_id == instance_id or (old.address == address and old.role is role):
                del self._instances[old.instance_id]
        instance = Instance(instance_id, role, address, model=model, fingerprint=fingerprint)
        instance.load = load or Load()
        instance.last_seen_s = self._clock()
        self._instances[instance_id] = instance
        return instance

    def _check_fingerprint(self, fingerprint: str, instance_id: str) -> None:
        """Every instance must share one KV layout, or decode nodes cannot read prefill KV."""
        if not fingerprint:
            return
        others = {
            i.fingerprint
            for i in self._instances.values()
            if i.fingerprint and i.instance_id != instance_id
        }
        if others and fingerprint not in others:
            raise RegistrationRefused(
                f"KV layout fingerprint {fingerprint!r} differs from the pool's {sorted(others)}"
            )

    def add_static(self, role: Role, address: str) -> Instance:
        """Add an instance from the command line (never expires; polled for load/health)."""
        instance = Instance(f"static-{role.value}-{address}", role, address, static=True)
        instance.last_seen_s = self._clock()
        self._instances[instance.instance_id] = instance
        return instance

    def heartbeat(self, instance_id: str, load: Load | None) -> bool:
        """Refresh a registered instance; False if unknown (it must Register again)."""
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        instance.last_seen_s = self._clock()
        if load is not None:
            instance.load = load
        instance.healthy = True
        return True

    def deregister(self, instance_id: str) -> Instance | None:
        """Remove an instance; returns it, or None if it was unknown."""
        return self._instances.pop(instance_id, None)

    def expire(self) -> list[Instance]:
        """Drop registered instances silent for longer than the heartbeat timeout."""
        deadline = self._clock() - self.heartbeat_timeout_s
        dropped = [i for i in self._instances.values() if not i.static and i.last_seen_s < deadline]
        for instance in dropped:
            del self._instances[instance.instance_id]
        return dropped

    # -- health ------------------------------------------------------------------------------
    def mark_failed(self, instance: Instance) -> None:
        """A call to ``instance`` failed at the transport level: skip it for a cooldown."""
        instance.suspect_until_s = self._clock() + self.suspect_cooldown_s

    def update_static(self, instance: Instance, load: Load | None) -> None:
        """Result of polling a static instance: its load, or None when the poll failed."""
        instance.healthy = load is not None
        if load is not None:
            instance.load = load
            instance.last_seen_s = self._clock()

    # -- queries -----------------------------------------------------------------------------
    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def instances(self, role: Role | None = None) -> list[Instance]:
        """All known instances (any state) serving ``role`` (None: every instance)."""
        items = self._instances.values()
        return [i for i in items if role is None or i.role.serves(role)]

    def candidates(self, role: Role, exclude: frozenset[str] = frozenset()) -> list[Instance]:
        """Instances that can take a new ``role`` request now, minus ``exclude`` (ids)."""
        now = self._clock()
        return [
            i for i in self.instances(role) if i.available(now) and i.instance_id not in exclude
        ]

    def uses_address(self, address: str) -> bool:
        return any(i.address == address for i in self._instances.values())

    def state_counts(self) -> dict[tuple[str, str], int]:
        """Number of instances per (pool, state); a colocated instance counts in both pools."""
        now = self._clock()
        counts: dict[tuple[str, str], int] = {}
        for role in (Role.PREFILL, Role.DECODE):
            for instance in self.instances(role):
                key = (role.value, instance.state(now))
                counts[key] = counts.get(key, 0) + 1
        return counts

    @staticmethod
    @contextmanager
    def track(instance: Instance, prompt_tokens: int = 0) -> Iterator[None]:
        """Count a call as in flight on ``instance`` for its duration."""
        instance.inflight += 1
        instance.inflight_tokens += prompt_tokens
        try:
            yield
        finally:
            instance.inflight -= 1
            instance.inflight_tokens -= prompt_tokens
