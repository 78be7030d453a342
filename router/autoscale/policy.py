"""Autoscaling decisions: how many prefill (N) and decode (M) instances the live load needs.

Pure logic: observations in, decisions out. No I/O and no clock of its own (``now_s`` is passed
in), so every rule is unit-testable; ``router/autoscale/loop.py`` feeds it and hands its
decisions to an actuator (``router/autoscale/actuator.py``; back ends in ``launcher/actuators.py``).

NOTE on the policy. Each pool's size is the largest of a few *requirements*, each the number of
instances that keeps one signal under its watermark (DistServe sizes each phase's pool from its
own throughput at the SLO; Dynamo's planner does the same from measured load):

    prefill  model    ceil(arrival_rate × mean_prompt_tokens / (capacity × utilization))
             backlog  ceil(queued_prompt_tokens / (capacity × ttft_budget_s × utilization))
    decode   model    ceil(arrival_rate × mean_output_tokens / (capacity × utilization))
             memory   ceil(Σ kv_usage / kv_watermark)
             batch    ceil(Σ (running + waiting) / (max_num_seqs × batch_watermark))
    both     SLO      current + 1 while the pool's p90 (TTFT / ITL) breaks its SLO with work pending

``capacity`` is tokens/s per instance: the configured figure, raised by the highest rate an
instance reported while saturated (prefill: a queue; decode: a full batch). Without either,
the model term is skipped and the backlog term uses a fixed per-instance token budget.

Hysteresis: the requirements are computed twice, with high watermarks (scale up) and low ones
(scale down). Up, straight to the high requirement, once ``up_cooldown_s`` has passed since the
pool's last change; down, by one instance, only when even the low requirement is below the
current size continuously for ``down_delay_s`` and ``down_cooldown_s`` has passed; hold in
between. While instances the actuator started have not registered yet (``pending``), the pool
does not grow again - they are capacity already on its way - unless ``startup_grace_s`` passes.
A size outside ``[min, max]`` is corrected at once (below min: at most once per up-cooldown, so a
node that keeps crashing is not restarted in a tight loop).

GPUs, not instances, are what a cluster can afford: an instance of a pool takes that pool's
tensor-parallel size in GPUs (``prefill_gpus``/``decode_gpus``), and with a ``gpu_budget`` a pool
grows only into the GPUs the other pool leaves free. When both want more in the same decision,
the one further below its need (wanted / current) is served first.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve_proto.nodes import NodeLoad


class Pool(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


def tokens_per_s(pool: Pool, load: NodeLoad) -> float:
    """What an instance of ``pool`` produces: prompt tokens (prefill) or output tokens (decode)
    per second."""
    return load.prefill_tokens_per_s if pool is Pool.PREFILL else load.decode_tokens_per_s


@dataclass(frozen=True)
class PoolObservation:
    """A pool right now. ``target``: instances the actuator keeps (running or starting);
    ``ready``: of those, how many the router can route to; ``loads``: the ready ones' last
    reported loads (the registry's)."""

    target: int
    ready: int
    loads: tuple[NodeLoad, ...] = ()

    @property
    def pending(self) -> int:
        return max(0, self.target - self.ready)


@dataclass(frozen=True)
class TrafficSnapshot:
    """Cumulative router counters at ``time_s``: requests arrived, requests completed, and the
    prompt / output tokens of the completed ones."""

    time_s: float
    arrivals: float
    completed: float
    prompt_tokens: float
    output_tokens: float


class Traffic(NamedTuple):
    """Smoothed traffic: arrival rate (req/s) and mean prompt / output length (tokens)."""

    arrival_rate: float
    mean_prompt_tokens: float
    mean_output_tokens: float


class TrafficEstimator:
    """Exponentially weighted rates from successive snapshots (half-life ``halflife_s``)."""

    def __init__(self, halflife_s: float = 10.0) -> None:
        if halflife_s <= 0:
            raise ValueError("halflife_s must be > 0")
        self.halflife_s = halflife_s
        self._last: TrafficSnapshot | None = None
        self.traffic = Traffic(0.0, 0.0, 0.0)

    def update(self, snapshot: TrafficSnapshot) -> Traffic:
        """Fold in ``snapshot`` (time must increase; a repeated time is ignored)."""
        last = self._last
        if last is not None and snapshot.time_s <= last.time_s:
            return self.traffic
        self._last = snapshot
        if last is None:
            return self.traffic
        dt = snapshot.time_s - last.time_s
        alpha = 1.0 - 0.5 ** (dt / self.halflife_s)
        rate = max(0.0, snapshot.arrivals - last.arrivals) / dt
        done = snapshot.completed - last.completed
        prompt, output = self.traffic.mean_prompt_tokens, self.traffic.mean_output_tokens
        if done > 0:
            new_prompt = (snapshot.prompt_tokens - last.prompt_tokens) / done
            new_output = (snapshot.output_tokens - last.output_tokens) / done
            prompt = new_prompt if prompt == 0 else prompt + alpha * (new_prompt - prompt)
            output = new_output if output == 0 else output + alpha * (new_output - output)
        arrival = self.traffic.arrival_rate + alpha * (rate - self.traffic.arrival_rate)
        self.traffic = Traffic(arrival, prompt, output)
        return self.traffic


@dataclass(frozen=True)
class Watermarks:
    """How hard an instance may be driven. ``utilization``: fraction of measured capacity;
    ``kv_usage``: fraction of KV blocks in use; ``batch``: (running + waiting) / max_num_seqs;
    ``slo``: fraction of an SLO the pool's p90 may reach."""

    utilization: float
    kv_usage: float
    batch: float
    slo: float

    def __post_init__(self) -> None:
        for name in ("utilization", "kv_usage", "batch", "slo"):
            if not getattr(self, name) > 0:
                raise ValueError(f"watermark {name} must be > 0")


@dataclass(frozen=True)
class PoolLimits:
    """Bounds of one pool's size; ``initial`` is where it starts (default ``minimum``)."""

    minimum: int = 1
    maximum: int = 4
    initial: int | None = None

    def __post_init__(self) -> None:
        start = self.start
        if not 1 <= self.minimum <= start <= self.maximum:
            raise ValueError(f"need 1 <= min <= initial <= max, got {self}")

    @property
    def start(self) -> int:
        return self.minimum if self.initial is None else self.initial

    def clamp(self, count: int) -> int:
        return min(self.maximum, max(self.minimum, count))


@dataclass(frozen=True)
class AutoscalerConfig:
    """Policy knobs (see the module NOTE). Times in seconds, SLOs in ms, capacities tokens/s."""

    prefill: PoolLimits = field(default_factory=PoolLimits)
    decode: PoolLimits = field(default_factory=PoolLimits)
    up: Watermarks = Watermarks(utilization=0.8, kv_usage=0.8, batch=0.8, slo=1.0)
    down: Watermarks = Watermarks(utilization=0.5, kv_usage=0.4, batch=0.4, slo=0.6)
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    # The queue a prefill instance may hold: in seconds of its work (the TTFT SLO when one is
    # set), and in tokens while its capacity is still unknown.
    ttft_budget_s: float = 1.0
    queue_tokens_per_instance: int = 4096
    prefill_capacity: float | None = None
    decode_capacity: float | None = None
    up_cooldown_s: float = 20.0
    down_cooldown_s: float = 60.0
    down_delay_s: float = 30.0
    startup_grace_s: float = 300.0
    # GPUs an instance of each pool takes (its tensor-parallel size), and how many there are
    # (None: instances are bounded by the pools' maxima only)
    prefill_gpus: int = 1
    decode_gpus: int = 1
    gpu_budget: int | None = None

    def __post_init__(self) -> None:
        if self.prefill_gpus < 1 or self.decode_gpus < 1:
            raise ValueError("GPUs per instance must be >= 1")
        floor = self.prefill.minimum * self.prefill_gpus + self.decode.minimum * self.decode_gpus
        if self.gpu_budget is not None and floor > self.gpu_budget:
            raise ValueError(
                f"the pools' minima take {floor} GPUs ({self.prefill.minimum} prefill x"
                f" {self.prefill_gpus} + {self.decode.minimum} decode x {self.decode_gpus}),"
                f" more than the GPU budget {self.gpu_budget}"
            )
        times = ("up_cooldown_s", "down_cooldown_s", "down_delay_s", "startup_grace_s")
        if any(getattr(self, name) < 0 for name in times):
            raise ValueError(f"{', '.join(times)} must be >= 0")
        if self.ttft_budget_s <= 0 or self.queue_tokens_per_instance < 1:
            raise ValueError("ttft_budget_s must be > 0 and queue_tokens_per_instance >= 1")
        marks = ("utilization", "kv_usage", "batch", "slo")
        if any(getattr(self.down, m) > getattr(self.up, m) for m in marks):
            raise ValueError("down watermarks must not exceed up watermarks (hysteresis)")

    def limits(self, pool: Pool) -> PoolLimits:
        return self.prefill if pool is Pool.PREFILL else self.decode

    def slo_ms(self, pool: Pool) -> float | None:
        return self.ttft_slo_ms if pool is Pool.PREFILL else self.itl_slo_ms

    def seed_capacity(self, pool: Pool) -> float | None:
        return self.prefill_capacity if pool is Pool.PREFILL else self.decode_capacity

    def gpus_per_instance(self, pool: Pool) -> int:
        return self.prefill_gpus if pool is Pool.PREFILL else self.decode_gpus


class ScaleDecision(NamedTuple):
    """Resize ``pool`` from ``current`` to ``target`` instances, because of ``reason``."""

    pool: Pool
    current: int
    target: int
    reason: str


class Requirement(NamedTuple):
    instances: int
    reason: str


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)  # 2.0000000001 instances is 2


def saturated(pool: Pool, load: NodeLoad) -> bool:
    """Whether ``load``'s token rate shows the instance's capacity (it had more work queued
    than it could take at once)."""
    if pool is Pool.PREFILL:
        return load.num_waiting > 0 or load.queued_prompt_tokens > 0
    full = load.max_num_seqs and load.num_running >= load.max_num_seqs
    return bool(load.num_waiting > 0 or full)


def _p90(pool: Pool, loads: tuple[NodeLoad, ...]) -> float:
    """The worst instance's p90 latency of the pool's SLO metric (0: no samples)."""
    values = [x.ttft_p90_ms if pool is Pool.PREFILL else x.itl_p90_ms for x in loads]
    return max(values, default=0.0)


def _work_pending(pool: Pool, loads: tuple[NodeLoad, ...]) -> bool:
    if pool is Pool.PREFILL:
        return any(x.num_waiting or x.queued_prompt_tokens for x in loads)
    return any(x.num_waiting or x.num_running for x in loads)


def requirements(
    pool: Pool,
    loads: tuple[NodeLoad, ...],
    traffic: Traffic,
    capacity: float | None,
    marks: Watermarks,
    config: AutoscalerConfig,
) -> list[Requirement]:
    """Instances each signal asks for under ``marks`` (the SLO term is handled by the caller).

    Pure; ``capacity`` is tokens/s per instance or None when unknown.
    """
    found: list[Requirement] = []
    if pool is Pool.PREFILL:
        demand = traffic.arrival_rate * traffic.mean_prompt_tokens
        queued = sum(x.queued_prompt_tokens for x in loads)
        if capacity:
            budget_s = config.ttft_slo_ms / 1e3 if config.ttft_slo_ms else config.ttft_budget_s
            budget = capacity * budget_s
        else:
            budget = config.queue_tokens_per_instance
        found.append(Requirement(_ceil(queued / (budget * marks.utilization)), "prompt backlog"))
    else:
        demand = traffic.arrival_rate * traffic.mean_output_tokens
        kv = sum(x.kv_usage for x in loads)
        found.append(Requirement(_ceil(kv / marks.kv_usage), "KV usage"))
        seqs = sum(x.num_running + x.num_waiting for x in loads)
        slots = max((x.max_num_seqs for x in loads), default=0)
        if slots:
            found.append(Requirement(_ceil(seqs / (slots * marks.batch)), "running requests"))
    if capacity:
        found.append(Requirement(_ceil(demand / (capacity * marks.utilization)), "throughput"))
    return found


class PoolController:
    """Sizing state of one pool: last change, how long it has looked oversized, capacity."""

    def __init__(self, pool: Pool, config: AutoscalerConfig) -> None:
        self.pool = pool
        self.config = config
        self.limits = config.limits(pool)
        self.capacity = config.seed_capacity(pool)
        self.last_change_s = -math.inf
        self.low_since_s: float | None = None
        self.pending_since_s: float | None = None

    def observe_capacity(self, loads: tuple[NodeLoad, ...]) -> None:
        """Raise the capacity estimate to what a saturated instance just delivered."""
        rates = [tokens_per_s(self.pool, x) for x in loads if saturated(self.pool, x)]
        rates = [rate for rate in rates if rate > 0]
        if rates:
            self.capacity = max(self.capacity or 0.0, *rates)

    def decide(
        self, now_s: float, obs: PoolObservation, traffic: Traffic, afford: int | None = None
    ) -> ScaleDecision | None:
        """The change this pool needs now, or None to hold. Updates the controller's state.
        ``afford``: the most instances the GPU budget leaves this pool (None: no budget)."""
        self.observe_capacity(obs.loads)
        current = obs.target
        if current > self.limits.maximum:
            return self._change(now_s, current, self.limits.maximum, "above max")
        if current < self.limits.minimum:  # a crash loop restarts at most once per cooldown
            if now_s - self.last_change_s < self.config.up_cooldown_s:
                return None
            return self._change(now_s, current, self.limits.minimum, "below min")
        if self._waiting_for_pending(now_s, obs):
            self.low_since_s = None
            return None
        up = self.up_requirement(obs, traffic)
        grow_to = min(up.instances, self.limits.maximum)
        reason = up.reason
        if afford is not None and grow_to > afford:
            grow_to = afford
            reason += f" (capped by the GPU budget of {self.config.gpu_budget})"
        if grow_to > current and now_s - self.last_change_s >= self.config.up_cooldown_s:
            return self._change(now_s, current, grow_to, reason)
        if up.instances > current or current <= self.limits.minimum:
            self.low_since_s = None  # busy (or at max, or cooling down), or nothing to shed
            return None
        if not self._oversized(obs, traffic):
            self.low_since_s = None
            return None
        return self._maybe_shrink(now_s, current)

    def _waiting_for_pending(self, now_s: float, obs: PoolObservation) -> bool:
        """True while started instances are still on their way (within the start-up grace)."""
        if obs.pending == 0:
            self.pending_since_s = None
            return False
        if self.pending_since_s is None:
            self.pending_since_s = now_s
        return now_s - self.pending_since_s < self.config.startup_grace_s

    def up_requirement(self, obs: PoolObservation, traffic: Traffic) -> Requirement:
        found = requirements(
            self.pool, obs.loads, traffic, self.capacity, self.config.up, self.config
        )
        slo = self.config.slo_ms(self.pool)
        p90 = _p90(self.pool, obs.loads)
        if slo and p90 > slo * self.config.up.slo and _work_pending(self.pool, obs.loads):
            metric = "TTFT" if self.pool is Pool.PREFILL else "ITL"
            found.append(Requirement(obs.target + 1, f"{metric} p90 {p90:.0f} ms > SLO {slo:g}"))
        return max(found, key=lambda r: r.instances, default=Requirement(0, "idle"))

    def _oversized(self, obs: PoolObservation, traffic: Traffic) -> bool:
        """Even at the low watermarks fewer instances would do, and latency has headroom."""
        found = requirements(
            self.pool, obs.loads, traffic, self.capacity, self.config.down, self.config
        )
        if any(r.instances >= obs.target for r in found):
            return False
        slo = self.config.slo_ms(self.pool)
        return not (slo and _p90(self.pool, obs.loads) > slo * self.config.down.slo)

    def _maybe_shrink(self, now_s: float, current: int) -> ScaleDecision | None:
        if self.low_since_s is None:
            self.low_since_s = now_s
        calm_for = now_s - self.low_since_s
        if (
            calm_for >= self.config.down_delay_s
            and now_s - self.last_change_s >= self.config.down_cooldown_s
        ):
            return self._change(now_s, current, current - 1, f"underused for {calm_for:.0f} s")
        return None

    def _change(self, now_s: float, current: int, target: int, reason: str) -> ScaleDecision:
        self.last_change_s = now_s
        self.low_since_s = None
        return ScaleDecision(self.pool, current, target, reason)


class Autoscaler:
    """Both pools' controllers plus the traffic estimate; one per router."""

    def __init__(self, config: AutoscalerConfig, halflife_s: float = 10.0) -> None:
        self.config = config
        self.traffic = TrafficEstimator(halflife_s)
        self.pools = {pool: PoolController(pool, config) for pool in Pool}

    def decide(
        self, now_s: float, snapshot: TrafficSnapshot, observations: dict[Pool, PoolObservation]
    ) -> list[ScaleDecision]:
        """The changes to make now (possibly none), one per pool at most."""
        traffic = self.traffic.update(snapshot)
        decisions = []
        sizes = {pool: obs.target for pool, obs in observations.items()}
        for pool in self._by_need(observations, traffic):
            obs = observations[pool]
            decision = self.pools[pool].decide(now_s, obs, traffic, self._afford(pool, sizes))
            if decision is not None:
                decisions.append(decision)
                sizes[pool] = decision.target
        return decisions

    def _afford(self, pool: Pool, sizes: dict[Pool, int]) -> int | None:
        """Instances of ``pool`` the GPU budget allows next to the other pools' ``sizes``."""
        budget = self.config.gpu_budget
        if budget is None:
            return None
        others = sum(n * self.config.gpus_per_instance(p) for p, n in sizes.items() if p != pool)
        return max(0, budget - others) // self.config.gpus_per_instance(pool)

    def _by_need(self, observations: dict[Pool, PoolObservation], traffic: Traffic) -> list[Pool]:
        """The pools, the one furthest below what it wants first (it gets free GPUs first)."""
        if self.config.gpu_budget is None:
            return list(observations)

        def need(pool: Pool) -> float:
            obs = observations[pool]
            wanted = self.pools[pool].up_requirement(obs, traffic).instances
            return wanted / max(1, obs.target)

        return sorted(observations, key=need, reverse=True)
