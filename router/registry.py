"""The instance registry: which prefill and decode nodes exist, how loaded and how healthy.

Two ways in:

- *registered* instances call ``RouterService.Register`` and then ``Heartbeat`` with a fresh
  LoadReport; one silent for ``heartbeat_timeout_s`` is dropped (``expire``), and it must
  Register again (its Heartbeat answers ``known=false``).
- *static* instances come from flags (``--prefill``/``--decode``); they are never dropped, and
  a poller (``router.maintenance``) asks them for their NodeInfo once, then for their load and
  health.

The pool has one layout. Every instance reports a ``NodeInfo``: a node whose KV fingerprint
differs from the instances' already there is refused (its KV could not be shared), and so is
one that the router's own ``--block-size`` / ``--max-model-len`` rule out. The router takes its
block size (for prefix-affinity hashes) and its context limit from the instances
(``block_size``, ``max_model_len``).

An instance that fails a call (UNAVAILABLE, connection reset) is *suspect* for a short cooldown:
balancers skip it, so one dead node costs each request at most one retry. One that holds
requests while its engine loop stands still for ``progress_timeout_s`` is *stalled*
(``pdserve_proto.progress``): out of routing and /ready until its loop turns again;
:meth:`Registry.mark_stalled` *loses* it (``Instance.lose``: its ``on_lost`` callbacks run), by
which the flows with calls on it move their requests elsewhere; so does dropping a silent
instance. Load used for balancing is the node's last report combined with what the router
itself has in flight there (``inflight`` / ``inflight_tokens``), which is fresh between
reports.

All methods are synchronous and run on the router's event loop; no locking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve_proto.nodes import NodeInfo, NodeLoad, Role
from pdserve_proto.progress import ProgressWatch

FULL_KV_USAGE = 0.9  # a node this full may keep a request waiting for blocks (not stuck)


@dataclass(eq=False)
class Instance:
    """One node as the router sees it. Identity is the object (``eq=False``): a re-registered
    node is a new Instance, so per-instance state held elsewhere (affinity) starts fresh.
    ``info`` is None only for a static instance not yet asked for it."""

    instance_id: str
    role: Role
    address: str
    static: bool = False
    info: NodeInfo | None = None
    load: NodeLoad = field(default_factory=NodeLoad)
    last_seen_s: float = 0.0
    healthy: bool = True
    suspect_until_s: float = 0.0
    inflight: int = 0  # router requests in flight on this instance
    inflight_tokens: int = 0  # their prompt tokens
    # a call on it was given up (no token in time) since its last report: its silence counts
    # as a stall though no call waits on it any more (``stalled_for``)
    abandoned: bool = False
    progress: ProgressWatch | None = None  # None: not watched (set by the registry)
    lost: bool = False  # stalled or dropped: the calls running on it move elsewhere
    # called once when it is lost (``lose``): each running call's way to give up at once
    on_lost: set[Callable[[], None]] = field(default_factory=set)

    def lose(self) -> None:
        """Stalled or dropped: every call waiting on it is told (once)."""
        if not self.lost:
            self.lost = True
            for callback in list(self.on_lost):
                callback()

    def available(self, now_s: float) -> bool:
        """Can take a new request: healthy, not draining, not suspect, not stalled."""
        return (
            self.healthy
            and not self.load.draining
            and now_s >= self.suspect_until_s
            and not self.stalled(now_s)
        )

    def stalled(self, now_s: float) -> bool:
        """Has held requests while its engine loop stood still for the progress timeout
        (``pdserve_proto.progress``)."""
        return self.progress is not None and self.stalled_for(now_s) >= self.progress.timeout_s

    def stalled_for(self, now_s: float) -> float:
        """Seconds it has held requests while its engine loop stood still (0: live or idle);
        silence while the router has calls on it counts too (a node frozen right after a
        report that found it idle), and so does silence since a call on it was given up (the
        flow's per-token deadline moved its requests before a maintenance round saw it)."""
        if self.progress is None:
            return 0.0
        owes = self.inflight > 0 or self.abandoned
        silent = now_s - self.last_seen_s if owes else 0.0
        return max(silent, self.progress.stalled_for(now_s))

    def state(self, now_s: float) -> str:
        """``ready`` | ``draining`` | ``suspect`` | ``stalled`` | ``unhealthy`` (for metrics and
        /health)."""
        if not self.healthy:
            return "unhealthy"
        if self.stalled(now_s):
            return "stalled"
        if now_s < self.suspect_until_s:
            return "suspect"
        return "draining" if self.load.draining else "ready"


class RegistrationRefused(ValueError):
    """A node the router cannot pool: another model, another KV layout than the instances it
    has, or a block size / max_model_len its flags rule out. ``public``: what the node is told
    (never the pool's fingerprint: a caller probing with a bogus one must not learn the right
    one); the full message is for the router's log."""

    def __init__(self, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.public = public or message


class Registry:
    """Instances by id, and the layout they share.

    ``model`` is the served model (a node serving another is refused). ``block_size`` and
    ``max_model_len`` are the router's own settings, if any: a node with another block size, or
    a shorter context than ``max_model_len``, is refused (never silently served).
    """

    def __init__(
        self,
        model: str,
        heartbeat_interval_s: float = 2.0,
        heartbeat_timeout_s: float = 10.0,
        suspect_cooldown_s: float = 5.0,
        model_aliases: frozenset[str] = frozenset(),
        block_size: int | None = None,
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        progress_timeout_s: float = 10.0,
    ) -> None:
        if not 0 < heartbeat_interval_s < heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if progress_timeout_s <= 0:
            raise ValueError("need progress_timeout_s > 0")
        self.model = model
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.suspect_cooldown_s = suspect_cooldown_s
        self.progress_timeout_s = progress_timeout_s
        self.expected_block_size = block_size
        self.max_model_len_cap = max_model_len
        self._model_names = {model, *model_aliases}
        self._clock = clock
        self._instances: dict[str, Instance] = {}

    # -- membership --------------------------------------------------------------------------
    def register(
        self,
        instance_id: str,
        role: Role,
        address: str,
        info: NodeInfo,
        load: NodeLoad | None = None,
    ) -> Instance:
        """Add (or replace) a registered instance; raises RegistrationRefused when it cannot
        join the pool, ValueError when the request is incomplete.

        A previous entry with the same id, or with the same role and address (a restarted
        node on a reused port), is replaced.
        """
        if not instance_id or not address:
            raise ValueError("instance_id and address are required")
        replaced = [
            old
            for old in self._instances.values()
            if old.instance_id == instance_id or (old.address == address and old.role is role)
        ]
        self._admit(instance_id, info, others=self._others(replaced))
        for old in replaced:
            del self._instances[old.instance_id]
        instance = Instance(instance_id, role, address, info=info)
        self._seen(instance, load or NodeLoad())
        self._instances[instance_id] = instance
        return instance

    def _seen(self, instance: Instance, load: NodeLoad) -> None:
        """A report from ``instance`` now: its load, its progress, and a stall that ended."""
        now = instance.last_seen_s = self._clock()
        instance.load = load
        instance.abandoned = False
        if instance.progress is None:
            instance.progress = ProgressWatch(self.progress_timeout_s, now)
        instance.progress.observe(load, now)
        if instance.lost and not instance.stalled(now):
            instance.lost = False  # live again: new calls may rely on it

    def _others(self, excluded: list[Instance]) -> list[Instance]:
        return [i for i in self._instances.values() if i.info is not None and i not in excluded]

    def _admit(self, name: str, info: NodeInfo, others: list[Instance]) -> None:
        """Raise RegistrationRefused unless a node with ``info`` fits the pool of ``others``."""
        if info.model and info.model not in self._model_names:
            raise RegistrationRefused(f"router serves {self.model!r}, {name} serves {info.model!r}")
        pool = sorted({i.info.fingerprint for i in others if i.info is not None})
        if pool and info.fingerprint not in pool:
            # Every instance must share one KV layout, or decode nodes cannot read prefill KV.
            why = "another model config, dtype, block size or cache shape"
            raise RegistrationRefused(
                f"{name}'s KV layout fingerprint {info.fingerprint!r} differs from the pool's"
                f" {', '.join(map(repr, pool))}: {why}",
                public=f"{name}'s KV layout fingerprint {info.fingerprint!r} differs from the"
                f" pool's: {why} (the router's log names both)",
            )
        wanted = self.expected_block_size
        if wanted is not None and info.block_size != wanted:
            raise RegistrationRefused(
                f"{name} has block size {info.block_size}; the router's --block-size is {wanted}"
            )
        cap = self.max_model_len_cap
        if cap is not None and info.max_model_len < cap:
            raise RegistrationRefused(
                f"{name} has max_model_len {info.max_model_len}, below the router's"
                f" --max-model-len {cap}: it could not serve every request the router admits"
            )

    def add_static(self, role: Role, address: str) -> Instance:
        """Add an instance from the command line (never expires; polled for load/health, and
        once for its ``NodeInfo``)."""
        instance = Instance(f"static-{role.value}-{address}", role, address, static=True)
        self._seen(instance, NodeLoad())
        self._instances[instance.instance_id] = instance
        return instance

    def describe_static(self, instance: Instance, info: NodeInfo) -> None:
        """Record what a static instance serves; raises RegistrationRefused (it stays
        unpooled: no info) when it does not fit the pool."""
        self._admit(instance.address, info, others=self._others([instance]))
        instance.info = info

    def heartbeat(self, instance_id: str, load: NodeLoad | None) -> bool:
        """Refresh a registered instance; False if unknown (it must Register again)."""
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        self._seen(instance, instance.load if load is None else load)
        instance.healthy = True
        return True

    def deregister(self, instance_id: str) -> Instance | None:
        """Remove an instance; returns it, or None if it was unknown."""
        return self._instances.pop(instance_id, None)

    def drop_if_silent(self, instance: Instance) -> bool:
        """Drop a registered instance found gone (its port refuses connections) unless it sent a
        heartbeat within the last interval (then it lives, and its channel only blinked): its
        calls move elsewhere (``Instance.lose``); a live node registers again at its next
        heartbeat. False if kept (or static: polled, never dropped)."""
        if instance.static or self._instances.get(instance.instance_id) is not instance:
            return False
        if self._clock() - instance.last_seen_s <= self.heartbeat_interval_s:
            return False
        del self._instances[instance.instance_id]
        instance.lose()
        return True

    def expire(self) -> list[Instance]:
        """Drop registered instances silent for longer than the heartbeat timeout."""
        deadline = self._clock() - self.heartbeat_timeout_s
        dropped = [i for i in self._instances.values() if not i.static and i.last_seen_s < deadline]
        for instance in dropped:
            del self._instances[instance.instance_id]
            instance.lose()
        return dropped

    def mark_stalled(self) -> list[tuple[Instance, float]]:
        """Instances that stalled since the last call, each with the seconds it has been
        stalled (see the module doc); each is lost (``Instance.lose``), so the flows running
        calls on it move their requests elsewhere."""
        now = self._clock()
        stalled = [i for i in self._instances.values() if i.stalled(now) and not i.lost]
        for instance in stalled:
            instance.lose()
        return [(i, i.stalled_for(now)) for i in stalled]

    def live_and_full(self, instance: Instance) -> bool:
        """Whether a request on ``instance`` that gets no token may just be waiting for a seat
        or for blocks: the instance is still known, its loop turns, its last report is fresh,
        and every seat is taken or its KV cache nearly full."""
        now = self._clock()
        current = self._instances.get(instance.instance_id)  # a re-registration replaces it
        if current is None or current.stalled(now):
            return False
        if now - current.last_seen_s > self.progress_timeout_s:
            return False
        load = current.load
        return load.num_running >= load.max_num_seqs > 0 or load.kv_usage >= FULL_KV_USAGE

    # -- the pool's layout -------------------------------------------------------------------
    def max_model_len(self) -> int | None:
        """Longest prompt + output the router admits: the shortest context of the nodes it
        knows (so a request fits whichever node runs it), capped by its own
        ``--max-model-len``; None while no node has said (and no cap is set)."""
        lengths = [i.info.max_model_len for i in self._instances.values() if i.info is not None]
        if self.max_model_len_cap is not None:
            lengths.append(self.max_model_len_cap)
        return min(lengths, default=None)

    def block_size(self) -> int | None:
        """The pool's KV block size (one fingerprint, so one block size); the router's
        ``--block-size`` while no node has said; else None."""
        for instance in self._instances.values():
            if instance.info is not None:
                return instance.info.block_size
        return self.expected_block_size

    # -- health ------------------------------------------------------------------------------
    def mark_failed(self, instance: Instance) -> None:
        """A call to ``instance`` failed at the transport level: skip it for a cooldown."""
        instance.suspect_until_s = self._clock() + self.suspect_cooldown_s

    def gave_up_on(self, instance: Instance) -> None:
        """A call on ``instance`` was given up (no token in time, or its stream ended early):
        skip it for a cooldown, and until it reports again its silence counts as a stall."""
        self.mark_failed(instance)
        instance.abandoned = True

    def update_static(self, instance: Instance, load: NodeLoad | None) -> None:
        """Result of polling a static instance: its load, or None when the poll failed (or it
        does not fit the pool)."""
        instance.healthy = load is not None
        if load is not None:
            self._seen(instance, load)

    # -- queries -----------------------------------------------------------------------------
    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def instances(self, role: Role | None = None) -> list[Instance]:
        """All known instances (any state) serving ``role`` (None: every instance)."""
        items = self._instances.values()
        return [i for i in items if role is None or i.role.serves(role)]

    def candidates(
        self, role: Role, exclude: frozenset[str] = frozenset(), lora: str = ""
    ) -> list[Instance]:
        """Instances that can take a new ``role`` request now, minus ``exclude`` (ids); with
        ``lora``, only those serving that adapter."""
        now = self._clock()
        return [
            i
            for i in self.instances(role)
            if i.available(now)
            and i.instance_id not in exclude
            and (not lora or lora in i.load.lora_adapters)
        ]

    def lora_adapters(self) -> set[str]:
        """The LoRA adapters some registered instance serves (by name)."""
        return {name for i in self._instances.values() for name in i.load.lora_adapters}

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
