"""Registry: registration, heartbeats, expiry, refusal, suspicion, static instances, and the
layout (block size, context length) the router learns from its nodes."""

from __future__ import annotations

import dataclasses

import pytest
from pdserve_proto.nodes import NodeInfo, NodeLoad

from router.registry import RegistrationRefused, Registry, Role

INFO = NodeInfo("tiny-llama", "fp", block_size=16, max_model_len=512)


def info(**changes: object) -> NodeInfo:
    return dataclasses.replace(INFO, **changes)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **layout: int) -> Registry:
    return Registry(
        "tiny-llama",
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=5.0,
        suspect_cooldown_s=2.0,
        clock=clock,
        **layout,  # type: ignore[arg-type]
    )


def test_register_heartbeat_and_expire() -> None:
    clock = Clock()
    registry = make(clock)
    registry.register("p0", Role.PREFILL, "127.0.0.1:1", INFO)
    registry.register("d0", Role.DECODE, "127.0.0.1:2", INFO)
    assert [i.instance_id for i in registry.candidates(Role.PREFILL)] == ["p0"]
    clock.now += 4.0
    assert registry.heartbeat("p0", NodeLoad(num_running=3))
    clock.now += 2.0  # d0 silent for 6 s > 5 s, p0 for 2 s
    dropped = registry.expire()
    assert [i.instance_id for i in dropped] == ["d0"]
    assert registry.get("p0") is not None and registry.get("p0").load.num_running == 3
    assert not registry.heartbeat("d0", None)  # unknown: must register again


def test_refuses_other_model_and_fingerprint() -> None:
    registry = make(Clock())
    with pytest.raises(RegistrationRefused, match="serves"):
        registry.register("x", Role.PREFILL, "h:1", info(model="other-model"))
    registry.register("p0", Role.PREFILL, "h:1", info(fingerprint="fp-a"))
    with pytest.raises(RegistrationRefused, match="'fp-b' differs from the pool's 'fp-a'"):
        registry.register("d0", Role.DECODE, "h:2", info(fingerprint="fp-b"))
    assert registry.get("d0") is None  # refused: not added
    # A restarted node on the same address replaces the old one, even with a new layout.
    registry.register("p1", Role.PREFILL, "h:1", info(fingerprint="fp-b"))
    registry.register("d0", Role.DECODE, "h:2", info(fingerprint="fp-b"))
    with pytest.raises(ValueError, match="required"):
        registry.register("", Role.DECODE, "h:3", INFO)


def test_layout_comes_from_the_nodes() -> None:
    registry = make(Clock())
    assert (registry.block_size(), registry.max_model_len()) == (None, None)  # nobody said yet
    registry.register("p0", Role.PREFILL, "h:1", info(max_model_len=1024))
    registry.register("d0", Role.DECODE, "h:2", info(max_model_len=512))
    # Requests must fit whichever node runs them: the shortest context.
    assert (registry.block_size(), registry.max_model_len()) == (16, 512)
    registry.deregister("d0")
    assert registry.max_model_len() == 1024


def test_the_routers_flags_are_checked_against_the_nodes() -> None:
    registry = make(Clock(), block_size=16, max_model_len=256)
    assert (registry.block_size(), registry.max_model_len()) == (16, 256)
    with pytest.raises(RegistrationRefused, match="block size 32; the router's --block-size is 16"):
        registry.register("p0", Role.PREFILL, "h:1", info(block_size=32))
    with pytest.raises(RegistrationRefused, match="max_model_len 128, below the router's"):
        registry.register("p0", Role.PREFILL, "h:1", info(max_model_len=128))
    registry.register("p0", Role.PREFILL, "h:1", INFO)  # a longer context: capped at 256
    assert registry.max_model_len() == 256


def test_reregistration_replaces_same_id_or_address() -> None:
    registry = make(Clock())
    first = registry.register("p0", Role.PREFILL, "h:1", INFO)
    second = registry.register("p1", Role.PREFILL, "h:1", INFO)  # restarted node, same port
    assert registry.instances() == [second] and first is not second
    third = registry.register("p1", Role.PREFILL, "h:9", INFO)
    assert registry.instances() == [third]


def test_suspect_draining_and_colocated() -> None:
    clock = Clock()
    registry = make(clock)
    p0 = registry.register("p0", Role.PREFILL, "h:1", INFO)
    registry.register("p1", Role.PREFILL, "h:2", INFO, load=NodeLoad(draining=True))
    both = registry.register("c0", Role.COLOCATED, "h:3", INFO)
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
    registry.update_static(static, NodeLoad(kv_usage=0.5))
    assert registry.candidates(Role.DECODE) == [static] and static.load.kv_usage == 0.5


def test_static_instances_join_the_layout_once_described() -> None:
    registry = make(Clock())
    static = registry.add_static(Role.DECODE, "h:7")
    assert registry.max_model_len() is None
    registry.describe_static(static, INFO)
    assert (static.info, registry.max_model_len()) == (INFO, 512)
    other = registry.add_static(Role.PREFILL, "h:8")
    with pytest.raises(RegistrationRefused, match="'fp-x' differs from the pool's 'fp'"):
        registry.describe_static(other, info(fingerprint="fp-x"))
    assert other.info is None


def test_track_counts_inflight() -> None:
    registry = make(Clock())
    p0 = registry.register("p0", Role.PREFILL, "h:1", INFO)
    with registry.track(p0, 100):
        assert (p0.inflight, p0.inflight_tokens) == (1, 100)
    assert (p0.inflight, p0.inflight_tokens) == (0, 0)


def test_a_node_whose_port_refuses_is_dropped_once_it_misses_a_heartbeat() -> None:
    """A SIGKILLed node's port refuses connections at once: it is dropped after one missed
    heartbeat (and its calls told), not after the whole heartbeat timeout, during which
    `/ready` counted it on and off. One that still heartbeats is kept (its channel blinked)."""
    import asyncio
    import socket

    from router.maintenance import drop_refused
    from router.node_clients import NodeClients

    with socket.socket() as sock:  # a port nothing listens on: refused, as a dead node's
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"

    async def go() -> None:
        clock = Clock()
        registry = make(clock)
        registry.register("d0", Role.DECODE, address, INFO)
        instance = registry.get("d0")
        assert instance is not None
        clients = NodeClients()
        try:
            for _ in range(200):  # the channel's first connection attempt fails
                if clients.refused(address):
                    break
                await asyncio.sleep(0.02)
            assert clients.refused(address)
            drop_refused(registry, clients)
            assert registry.get("d0") is instance  # heard from just now: kept
            clock.now += 1.5  # a heartbeat (every 1 s) missed
            drop_refused(registry, clients)
            assert registry.get("d0") is None and instance.lost
        finally:
            await clients.close()

    asyncio.run(go())
