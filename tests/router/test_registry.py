"""Registry: registration, heartbeats, expiry, refusal, suspicion, static instances."""

from __future__ import annotations

import pytest

from router.registry import Load, RegistrationRefused, Registry, Role


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock) -> Registry:
    return Registry(
        "tiny-llama",
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=5.0,
        suspect_cooldown_s=2.0,
        clock=clock,
    )


def test_register_heartbeat_and_expire() -> None:
    clock = Clock()
    registry = make(clock)
    registry.register("p0", Role.PREFILL, "127.0.0.1:1", "tiny-llama", "fp")
    registry.register("d0", Role.DECODE, "127.0.0.1:2", "tiny-llama", "fp")
    assert [i.instance_id for i in registry.candidates(Role.PREFILL)] == ["p0"]
    clock.now += 4.0
    assert registry.heartbeat("p0", Load(num_running=3))
    clock.now += 2.0  # d0 silent for 6 s > 5 s, p0 for 2 s
    dropped = registry.expire()
    assert [i.instance_id for i in dropped] == ["d0"]
    assert registry.get("p0") is not None and registry.get("p0").load.num_running == 3
    assert not registry.heartbeat("d0", None)  # unknown: must register again


def test_refuses_other_model_and_fingerprint() -> None:
    registry = make(Clock())
    with pytest.raises(RegistrationRefused, match="serves"):
        registry.register("x", Role.PREFILL, "h:1", "other-model", "fp")
    registry.register("p0", Role.PREFILL, "h:1", "tiny-llama", "fp-a")
    with pytest.raises(RegistrationRefused, match="fingerprint"):
        registry.register("d0", Role.DECODE, "h:2", "tiny-llama", "fp-b")
    registry.deregister("p0")
    registry.register("d0", Role.DECODE, "h:2", "tiny-llama", "fp-b")  # pool empty: new layout


def test_reregistration_replaces_same_id_or_address() -> None:
    registry = make(Clock())
    first = registry.register("p0", Role.PREFILL, "h:1")
    second = registry.register("p1", Role.PREFILL, "h:1")  # restarted node, same port
    assert registry.instances() == [second] and first is not second
    third = registry.register("p1", Role.PREFILL, "h:9")
    assert registry.instances() == [third]


def test_suspect_draining_and_colocated() -> None:
    clock = Clock()
    registry = make(clock)
    p0 = registry.register("p0", Role.PREFILL, "h:1")
    registry.register("p1", Role.PREFILL, "h:2", load=Load(draining=True))
    both = registry.register("c0", Role.COLOCATED, "h:3")
    registry.mark_failed(p0)
    assert registry.candidates(Role.PREFILL) == [both]  # p0 suspect, p1 draining
    assert registry.candidates(Role.DECODE) == [both]
    assert registry.state_counts()[("prefill", "suspect")] == 1
    clock.now += 2.5
    assert p0 in registry.candidates(Role.PREFILL)
    assert registry.candidates(Role.PREFILL, frozenset({"p0"})) == [both]


def test_static_instances_never_expire_and_follow_polls() -> None:
    clock = Clock()
    registry = make(clock)
    static = registry.add_static(Role.DECODE, "h:7")
    clock.now += 100
    assert registry.expire() == []
    registry.update_static(static, None)
    assert registry.candidates(Role.DECODE) == []
    registry.update_static(static, Load(kv_usage=0.5))
    assert registry.candidates(Role.DECODE) == [static] and static.load.kv_usage == 0.5


def test_track_counts_inflight() -> None:
    registry = make(Clock())
    p0 = registry.register("p0", Role.PREFILL, "h:1")
    with registry.track(p0, 100):
        assert (p0.inflight, p0.inflight_tokens) == (1, 100)
    assert (p0.inflight, p0.inflight_tokens) == (0, 0)
