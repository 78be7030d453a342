"""Autoscaler decisions: signals → sizes, hysteresis, cooldowns, clamps, throughput model."""

from __future__ import annotations

import pytest
from pdserve_proto.nodes import NodeLoad

from router.autoscale.policy import (
    Autoscaler,
    AutoscalerConfig,
    Pool,
    PoolController,
    PoolLimits,
    PoolObservation,
    Traffic,
    TrafficEstimator,
    TrafficSnapshot,
    requirements,
    saturated,
)

IDLE = Traffic(0.0, 0.0, 0.0)
FAST = {"up_cooldown_s": 10.0, "down_cooldown_s": 20.0, "down_delay_s": 5.0}


def config(**kw: object) -> AutoscalerConfig:
    limits = {"prefill": PoolLimits(1, 4), "decode": PoolLimits(1, 4)}
    return AutoscalerConfig(**{**limits, **FAST, **kw})  # type: ignore[arg-type]


def pool_obs(target: int, *loads: NodeLoad, ready: int | None = None) -> PoolObservation:
    return PoolObservation(target, target if ready is None else ready, loads)


def prefill_load(queued=0, waiting=0, ttft=0.0, rate=0.0) -> NodeLoad:
    return NodeLoad(
        num_waiting=waiting,
        queued_prompt_tokens=queued,
        ttft_p90_ms=ttft,
        prefill_tokens_per_s=rate,
    )


def decode_load(running=0, waiting=0, kv=0.0, itl=0.0, seqs=8) -> NodeLoad:
    return NodeLoad(
        num_running=running, num_waiting=waiting, kv_usage=kv, itl_p90_ms=itl, max_num_seqs=seqs
    )


# -- limits and traffic -----------------------------------------------------------------------


def test_pool_limits_validate_and_clamp() -> None:
    limits = PoolLimits(2, 5, 3)
    assert (limits.start, limits.clamp(0), limits.clamp(4), limits.clamp(9)) == (3, 2, 4, 5)
    assert PoolLimits(2, 5).start == 2
    for bad in ((0, 3), (3, 2), (1, 3, 4), (2, 4, 1)):
        with pytest.raises(ValueError):
            PoolLimits(*bad)


def test_config_rejects_inverted_hysteresis() -> None:
    from router.autoscale.policy import Watermarks

    with pytest.raises(ValueError, match="hysteresis"):
        AutoscalerConfig(down=Watermarks(0.9, 0.4, 0.4, 0.6))


def test_traffic_estimator_converges_to_rate_and_lengths() -> None:
    est = TrafficEstimator(halflife_s=2.0)
    for t in range(61):  # 2 req/s, 100 prompt and 50 output tokens each, all completed
        est.update(TrafficSnapshot(float(t), 2.0 * t, 2.0 * t, 200.0 * t, 100.0 * t))
    assert est.traffic.arrival_rate == pytest.approx(2.0, rel=1e-3)
    assert est.traffic.mean_prompt_tokens == pytest.approx(100.0)
    assert est.traffic.mean_output_tokens == pytest.approx(50.0)
    for t in range(61, 121):  # silence: the rate decays, the lengths are remembered
        est.update(TrafficSnapshot(float(t), 120.0, 120.0, 12000.0, 6000.0))
    assert est.traffic.arrival_rate < 0.01
    assert est.traffic.mean_prompt_tokens == pytest.approx(100.0)


def test_traffic_estimator_ignores_a_repeated_time() -> None:
    est = TrafficEstimator()
    est.update(TrafficSnapshot(1.0, 0, 0, 0, 0))
    assert est.update(TrafficSnapshot(1.0, 50, 50, 0, 0)).arrival_rate == 0.0


# -- requirements (the throughput model) --------------------------------------------------------


def test_prefill_backlog_uses_token_budget_until_capacity_is_known() -> None:
    cfg = config(queue_tokens_per_instance=1000)
    loads = (prefill_load(queued=1500), prefill_load(queued=1700))
    (backlog,) = requirements(Pool.PREFILL, loads, IDLE, None, cfg.up, cfg)
    assert backlog == (4, "prompt backlog")  # 3200 / (1000 * 0.8) = 4


def test_prefill_backlog_with_capacity_uses_the_ttft_slo_as_budget() -> None:
    cfg = config(ttft_slo_ms=500.0)
    loads = (prefill_load(queued=2000),)
    found = requirements(Pool.PREFILL, loads, IDLE, 2000.0, cfg.up, cfg)
    assert found[0] == (3, "prompt backlog")  # 2000 / (2000 tok/s * 0.5 s * 0.8) = 2.5


def test_throughput_model_sizes_pools_from_arrival_rate_and_lengths() -> None:
    cfg = config()
    traffic = Traffic(arrival_rate=4.0, mean_prompt_tokens=500.0, mean_output_tokens=200.0)
    prefill = requirements(Pool.PREFILL, (), traffic, 1000.0, cfg.up, cfg)
    assert max(r.instances for r in prefill if r.reason == "throughput") == 3
    decode = requirements(Pool.DECODE, (), traffic, 400.0, cfg.up, cfg)
    assert max(r.instances for r in decode) == 3  # 800 tok/s / (400 * 0.8) = 2.5
    unknown = requirements(Pool.DECODE, (), traffic, None, cfg.up, cfg)
    assert all(r.reason != "throughput" for r in unknown)  # no capacity, no model term


def test_decode_requirements_from_kv_usage_and_running_requests() -> None:
    cfg = config()
    loads = (decode_load(running=4, waiting=4, kv=0.9, seqs=4), decode_load(4, kv=0.6, seqs=4))
    found = requirements(Pool.DECODE, loads, IDLE, None, cfg.up, cfg)
    found = {r.reason: r.instances for r in found}
    assert found == {"KV usage": 2, "running requests": 4}  # 1.5/0.8 → 2; 12/(4*0.8) → 4


def test_saturation_per_pool() -> None:
    assert saturated(Pool.PREFILL, prefill_load(queued=10))
    assert not saturated(Pool.PREFILL, prefill_load())
    assert saturated(Pool.DECODE, decode_load(running=8, seqs=8))
    assert saturated(Pool.DECODE, decode_load(running=1, waiting=1))
    assert not saturated(Pool.DECODE, decode_load(running=3, seqs=8))


def test_capacity_is_learned_only_from_saturated_instances() -> None:
    ctl = PoolController(Pool.PREFILL, config(prefill_capacity=500.0))
    ctl.observe_capacity((prefill_load(rate=900.0),))  # idle instance: its rate says nothing
    assert ctl.capacity == 500.0
    ctl.observe_capacity((prefill_load(queued=64, rate=1200.0),))
    assert ctl.capacity == 1200.0


# -- decisions ------------------------------------------------------------------------------------


def test_scale_up_jumps_to_the_requirement_clamped_to_max() -> None:
    ctl = PoolController(Pool.PREFILL, config(queue_tokens_per_instance=100))
    decision = ctl.decide(0.0, pool_obs(1, prefill_load(queued=10_000)), IDLE)
    assert decision is not None
    assert (decision.current, decision.target, decision.reason) == (1, 4, "prompt backlog")


def test_up_cooldown_blocks_a_second_scale_up() -> None:
    ctl = PoolController(Pool.DECODE, config())
    assert ctl.decide(0.0, pool_obs(1, decode_load(running=8, waiting=2)), IDLE).target == 2
    busy = pool_obs(2, decode_load(running=8, waiting=8), decode_load(running=8, waiting=8))
    assert ctl.decide(5.0, busy, IDLE) is None  # within the 10 s cooldown
    assert ctl.decide(10.0, busy, IDLE).target == 4
    at_max = pool_obs(4, *[decode_load(running=8, waiting=8)] * 4)
    assert ctl.decide(100.0, at_max, IDLE) is None  # wants more, already at max: no no-op change


def test_pending_instances_block_growth_until_the_startup_grace() -> None:
    ctl = PoolController(Pool.DECODE, config(startup_grace_s=60.0))
    busy = pool_obs(2, decode_load(running=8, waiting=8), ready=1)  # one still starting
    assert ctl.decide(100.0, busy, IDLE) is None
    assert ctl.decide(159.0, busy, IDLE) is None
    decision = ctl.decide(160.0, busy, IDLE)  # the starting one never came: grow anyway
    assert decision is not None and decision.target == 3


def test_outside_min_max_is_corrected_at_once() -> None:
    ctl = PoolController(Pool.PREFILL, config(prefill=PoolLimits(2, 3)))
    assert ctl.decide(0.0, pool_obs(0), IDLE) == (Pool.PREFILL, 0, 2, "below min")
    assert ctl.decide(1.0, pool_obs(5), IDLE) == (Pool.PREFILL, 5, 3, "above max")
    # Nodes that crash again right away are restarted once per up-cooldown, not every tick.
    assert ctl.decide(2.0, pool_obs(1), IDLE) is None
    assert ctl.decide(11.0, pool_obs(1), IDLE) == (Pool.PREFILL, 1, 2, "below min")


def test_scale_down_waits_for_the_delay_and_steps_by_one() -> None:
    ctl = PoolController(Pool.DECODE, config())
    idle = pool_obs(3, decode_load(), decode_load(), decode_load())
    assert ctl.decide(100.0, idle, IDLE) is None  # low since 100
    assert ctl.decide(104.0, idle, IDLE) is None
    decision = ctl.decide(105.0, idle, IDLE)
    assert decision is not None and (decision.current, decision.target) == (3, 2)
    idle2 = pool_obs(2, decode_load(), decode_load())
    assert ctl.decide(115.0, idle2, IDLE) is None  # delay met, down cooldown (20 s) not
    assert ctl.decide(125.0, idle2, IDLE).target == 1
    at_min = pool_obs(1, decode_load())
    assert all(ctl.decide(float(t), at_min, IDLE) is None for t in range(200, 400, 5))  # min


def test_load_returning_resets_the_scale_down_delay() -> None:
    ctl = PoolController(Pool.DECODE, config())
    idle = pool_obs(2, decode_load(), decode_load())
    busyish = pool_obs(2, decode_load(running=4), decode_load(running=3))  # 7/(8*.4) → 3 ≥ 2
    assert ctl.decide(100.0, idle, IDLE) is None
    assert ctl.decide(103.0, busyish, IDLE) is None
    assert ctl.decide(106.0, idle, IDLE) is None  # the delay restarts at 106
    assert ctl.decide(111.0, idle, IDLE).target == 1


def test_hysteresis_band_holds_the_size() -> None:
    """Between the low and high watermarks nothing moves, however long it lasts."""
    ctl = PoolController(Pool.DECODE, config())
    # 2 instances, 9 sequences over 2×8 slots: high marks need 2 (9/6.4), low ones 3 (9/3.2).
    band = pool_obs(2, decode_load(running=5), decode_load(running=4))
    assert all(ctl.decide(float(t), band, IDLE) is None for t in range(0, 300, 5))


def test_slo_breach_adds_an_instance_only_with_work_pending() -> None:
    ctl = PoolController(Pool.PREFILL, config(ttft_slo_ms=200.0))
    slow_idle = pool_obs(1, prefill_load(ttft=900.0))
    assert ctl.decide(0.0, slow_idle, IDLE) is None  # old samples, nothing queued
    slow_busy = pool_obs(1, prefill_load(waiting=1, queued=10, ttft=900.0))
    decision = ctl.decide(1.0, slow_busy, IDLE)
    assert decision is not None and decision.target == 2 and "TTFT p90" in decision.reason


def test_latency_near_the_slo_blocks_scale_down() -> None:
    ctl = PoolController(Pool.DECODE, config(itl_slo_ms=50.0))
    warm = pool_obs(2, decode_load(itl=40.0), decode_load())  # 40 > 0.6 * 50
    assert all(ctl.decide(float(t), warm, IDLE) is None for t in range(0, 100, 5))
    cool = pool_obs(2, decode_load(itl=20.0), decode_load())
    assert ctl.decide(100.0, cool, IDLE) is None
    assert ctl.decide(105.0, cool, IDLE).target == 1


def test_throughput_model_keeps_a_busy_pool_from_shrinking() -> None:
    ctl = PoolController(Pool.PREFILL, config(prefill_capacity=1000.0))
    traffic = Traffic(arrival_rate=2.0, mean_prompt_tokens=400.0, mean_output_tokens=10.0)
    # 800 tok/s: the high marks need 1 instance (800/800), the low ones 2 (800/500).
    obs = pool_obs(2, prefill_load(), prefill_load())
    assert all(ctl.decide(float(t), obs, traffic) is None for t in range(0, 100, 5))
    heavier = Traffic(arrival_rate=3.0, mean_prompt_tokens=400.0, mean_output_tokens=10.0)
    assert ctl.decide(100.0, obs, heavier) is None  # 1200/800 → 2: exactly enough
    assert ctl.decide(101.0, pool_obs(1, prefill_load()), heavier).target == 2


def test_autoscaler_decides_each_pool_independently() -> None:
    scaler = Autoscaler(config(queue_tokens_per_instance=100))
    snapshot = TrafficSnapshot(0.0, 0, 0, 0, 0)
    observations = {
        Pool.PREFILL: pool_obs(1, prefill_load(queued=150)),  # 150/80 → 2
        Pool.DECODE: pool_obs(1, decode_load(running=1)),
    }
    (decision,) = scaler.decide(0.0, snapshot, observations)
    assert (decision.pool, decision.current, decision.target) == (Pool.PREFILL, 1, 2)


# -- GPUs, not instances ------------------------------------------------------------------------


def test_the_gpu_budget_caps_growth_counting_each_pools_tp_size() -> None:
    """8 GPUs; prefill TP=2, decode TP=1; 2 decode instances take 2: prefill may grow to 3
    instances (6 GPUs) though its backlog asks for 4."""
    scaler = Autoscaler(config(queue_tokens_per_instance=100, prefill_gpus=2, gpu_budget=8))
    observations = {
        Pool.PREFILL: pool_obs(1, prefill_load(queued=10_000)),
        Pool.DECODE: pool_obs(2, decode_load(running=1), decode_load(running=1)),
    }
    (decision,) = scaler.decide(0.0, TrafficSnapshot(0.0, 0, 0, 0, 0), observations)
    assert (decision.pool, decision.target) == (Pool.PREFILL, 3)
    assert "GPU budget of 8" in decision.reason


def test_both_pools_short_of_gpus_the_needier_is_served_first() -> None:
    scaler = Autoscaler(config(queue_tokens_per_instance=100, gpu_budget=5))
    observations = {
        Pool.PREFILL: pool_obs(1, prefill_load(queued=170)),  # wants 3 (×3 its size)
        Pool.DECODE: pool_obs(2, decode_load(kv=0.8), decode_load(kv=0.8)),  # wants 2 → hold
    }
    (decision,) = scaler.decide(0.0, TrafficSnapshot(0.0, 0, 0, 0, 0), observations)
    assert (decision.pool, decision.target) == (Pool.PREFILL, 3)
    observations = {
        Pool.PREFILL: pool_obs(1, prefill_load(queued=170)),  # wants 3: ×3
        Pool.DECODE: pool_obs(1, decode_load(kv=3.0)),  # wants 4 (3.0 / 0.8): ×4, first
    }
    decisions = Autoscaler(config(queue_tokens_per_instance=100, gpu_budget=5)).decide(
        0.0, TrafficSnapshot(0.0, 0, 0, 0, 0), observations
    )
    assert [(d.pool, d.target) for d in decisions] == [(Pool.DECODE, 4)]  # prefill: no GPU left


def test_minima_that_do_not_fit_the_gpu_budget_are_refused() -> None:
    with pytest.raises(ValueError, match="minima take 5 GPUs"):
        config(prefill=PoolLimits(1, 4), decode=PoolLimits(3, 4), prefill_gpus=2, gpu_budget=4)
