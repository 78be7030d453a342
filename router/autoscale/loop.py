"""The autoscale loop inside the router: observe → decide → actuate, every ``interval_s``.

Each tick observes

- traffic, from the router's own cumulative counters: requests arrived (finished + in flight),
  requests completed, and their prompt / output tokens (``router.metrics``);
- each pool: its ready instances (the registry's candidates: healthy, not draining) and each
  one's last reported ``NodeLoad`` - queue, KV usage, running requests, TTFT/ITL p90, tokens/s -
  as the registry holds it (nodes send it with every heartbeat; the loop asks nobody itself);

then asks :class:`router.autoscale.policy.Autoscaler` what to change and hands that to the actuator.
On a scale-down the least busy instances the actuator may choose are deregistered first - out
of routing - and only then stopped; a stopped node drains (finishes what it runs) before it
exits, so no request is dropped. The loop also exports ``pdserve_autoscaler_*`` metrics on the
router's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from router.autoscale.actuator import Actuator, ActuatorError
from router.autoscale.config import AutoscaleSettings, build_actuator
from router.autoscale.policy import (
    Autoscaler,
    Pool,
    PoolObservation,
    ScaleDecision,
    TrafficSnapshot,
)
from router.metrics import RouterMetrics
from router.node_clients import NodeTLS
from router.registry import Instance, Registry, Role

logger = logging.getLogger(__name__)


def _sum(metric: Counter | Gauge, suffix: str = "_total") -> float:
    """A metric's samples named ``*suffix`` summed over all label values."""
    return sum(
        sample.value
        for family in metric.collect()
        for sample in family.samples
        if sample.name.endswith(suffix)
    )


def traffic_snapshot(metrics: RouterMetrics, now_s: float) -> TrafficSnapshot:
    """The router's cumulative request and token counters at ``now_s``."""
    finished = completed = 0.0
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                finished += sample.value
                completed += sample.value if sample.labels.get("status") == "ok" else 0.0
    return TrafficSnapshot(
        time_s=now_s,
        arrivals=finished + _sum(metrics.inflight, suffix=""),
        completed=completed,
        prompt_tokens=_sum(metrics.prompt_tokens),
        output_tokens=_sum(metrics.output_tokens),
    )


def _busyness(instance: Instance) -> tuple[int, int]:
    """Sort key, least busy first."""
    return instance.load.num_running + instance.load.num_waiting, instance.inflight


class AutoscaleLoop:
    """Runs an :class:`Autoscaler` against a registry and an actuator (one per router)."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        actuator: Actuator,
        registry: Registry,
        metrics: RouterMetrics,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.autoscaler = autoscaler
        self.actuator = actuator
        self.registry = registry
        self.metrics = metrics
        self.interval_s = interval_s
        self.clock = clock
        self.history: deque[ScaleDecision] = deque(maxlen=256)
        self._task: asyncio.Task[None] | None = None
        r = metrics.registry
        self._target = Gauge("pdserve_autoscaler_target_instances", "Pool size asked of the "
                             "actuator", ["pool"], registry=r)  # fmt: skip
        self._changes = Counter("pdserve_autoscaler_changes", "Pool size changes",
                                ["pool", "direction"], registry=r)  # fmt: skip

    async def start(self) -> None:
        """Bring each pool up to its initial size, then run :meth:`step` in the background."""
        for pool in Pool:
            try:
                await self._initial_size(pool)
            except ActuatorError as exc:  # e.g. the API server is down: the ticks retry
                logger.error("autoscale %s: cannot set the initial size: %s", pool.value, exc)
        self._task = asyncio.create_task(self._run(), name="autoscale-loop")

    async def _initial_size(self, pool: Pool) -> None:
        limits = self.autoscaler.config.limits(pool)
        current = await self.actuator.current(pool)
        if current < limits.start:
            logger.info("autoscale %s: starting %d instance(s)", pool.value, limits.start)
            await self.actuator.scale(pool, limits.start)
        self._target.labels(pool.value).set(max(current, limits.start))

    async def stop(self) -> None:
        """Stop deciding, then close the actuator (the local one stops its nodes)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.actuator.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception:  # one bad tick must not end autoscaling
                logger.exception("autoscale step failed")

    async def step(self) -> list[ScaleDecision]:
        """One observe → decide → actuate round; returns the changes it made."""
        observed = {pool: await self.observe(pool) for pool in Pool}
        now = self.clock()
        decisions = self.autoscaler.decide(
            now,
            traffic_snapshot(self.metrics, now),
            {pool: obs for pool, (obs, _) in observed.items()},
        )
        applied = []
        for decision in decisions:
            if await self._apply(decision, observed[decision.pool][1]):
                applied.append(decision)
        return applied

    async def observe(self, pool: Pool) -> tuple[PoolObservation, list[Instance]]:
        """The pool's observation (from the registry's loads) and its ready instances."""
        role = Role(pool.value)
        ready = [i for i in self.registry.candidates(role) if i.role is role]
        target = await self.actuator.current(pool)
        loads = tuple(instance.load for instance in ready)
        return PoolObservation(target, len(ready), loads), ready

    async def _apply(self, decision: ScaleDecision, ready: list[Instance]) -> bool:
        """Carry out one decision; False (logged) when the actuator failed."""
        pool, victims = decision.pool, list[str]()
        if decision.target < decision.current:
            ranked = [instance.address for instance in sorted(ready, key=_busyness)]
            count = decision.current - decision.target
            victims = self.actuator.choose_victims(pool, count, ranked)
            self._unroute(Role(pool.value), victims)
        try:
            await self.actuator.scale(pool, decision.target, victims)
        except ActuatorError as exc:
            logger.error("autoscale %s to %d failed: %s", pool.value, decision.target, exc)
            return False
        logger.info("autoscale %s %d -> %d: %s", pool.value, decision.current,
                    decision.target, decision.reason)  # fmt: skip
        self.history.append(decision)
        self._target.labels(pool.value).set(decision.target)
        direction = "up" if decision.target > decision.current else "down"
        self._changes.labels(pool.value, direction).inc()
        return True

    def _unroute(self, role: Role, addresses: list[str]) -> None:
        """Take instances out of routing before they are stopped (in-flight work goes on)."""
        for instance in self.registry.instances(role):
            if instance.address in addresses and instance.role is role:
                self.registry.deregister(instance.instance_id)


async def start_autoscaler(
    settings: AutoscaleSettings,
    registry: Registry,
    metrics: RouterMetrics,
    router_grpc: str,
    model: str,
    node_key: str | None = None,
    node_tls: NodeTLS | None = None,
) -> AutoscaleLoop:
    """Build the actuator and the loop, bring the pools to their initial size, start ticking."""
    actuator = build_actuator(settings, router_grpc, model, node_key, node_tls)
    loop = AutoscaleLoop(
        Autoscaler(settings.policy), actuator, registry, metrics, settings.interval_s
    )
    await loop.start()
    return loop
