"""Stalled nodes (``pdserve_proto.progress``, ``router.registry``): a node holding requests whose
engine loop stands still is out of routing and /ready, lost once (its calls move), and back
when its loop turns; an idle node never stalls."""

from __future__ import annotations

import pytest
from pdserve_proto.nodes import NodeLoad
from pdserve_proto.progress import ProgressWatch

from router.registry import Registry, Role
from tests.router.fakes import INFO


def busy(steps: int, requests: int = 1) -> NodeLoad:
    return NodeLoad(engine_steps=steps, num_requests=requests)


def test_the_rule() -> None:
    watch = ProgressWatch(timeout_s=10.0, now_s=0.0)
    watch.observe(NodeLoad(), 0.0)
    assert watch.stalled_for(50.0) == 0.0  # idle, even silent: nothing waits on its loop
    watch.observe(busy(3), 2.0)  # work arrived: the clock starts at the first busy report
    assert not watch.stalled(11.9) and watch.stalled(12.0)
    watch.observe(busy(3), 12.0)
    assert watch.stalled_for(14.0) == 12.0  # the same count again: still stalled
    watch.observe(busy(4), 15.0)  # it moved
    assert watch.stalled_for(15.0) == 0.0 and not watch.stalled(24.9)
    assert watch.stalled(25.0)  # silence while it held requests counts as standing still
    with pytest.raises(ValueError):
        ProgressWatch(0.0, 0.0)


def test_a_stalled_instance_leaves_routing_is_lost_once_and_comes_back() -> None:
    now = [0.0]
    registry = Registry("tiny-llama", clock=lambda: now[0], progress_timeout_s=10.0)
    stuck = registry.register("d0", Role.DECODE, "127.0.0.1:1", INFO, busy(5))
    other = registry.register("d1", Role.DECODE, "127.0.0.1:2", INFO)
    told: list[str] = []
    stuck.on_lost.add(lambda: told.append("lost"))
    for t in (2.0, 4.0, 8.0):
        now[0] = t
        registry.heartbeat("d0", busy(5))
        registry.heartbeat("d1", busy(t))
    assert registry.mark_stalled() == [] and stuck.state(now[0]) == "ready"
    now[0] = 10.0
    registry.heartbeat("d0", busy(5))
    assert registry.candidates(Role.DECODE) == [other]
    assert registry.state_counts() == {("decode", "stalled"): 1, ("decode", "ready"): 1}
    assert registry.mark_stalled() == [(stuck, 10.0)] and told == ["lost"] and stuck.lost
    assert registry.mark_stalled() == []  # once
    now[0] = 12.0
    registry.heartbeat("d0", busy(6))  # its loop turned again
    assert not stuck.lost and stuck in registry.candidates(Role.DECODE)


def test_silence_with_calls_in_flight_stalls_a_node_that_last_reported_idle() -> None:
    now = [0.0]
    registry = Registry("tiny-llama", clock=lambda: now[0], progress_timeout_s=3.0)
    node = registry.register("d0", Role.DECODE, "127.0.0.1:1", INFO, NodeLoad())
    now[0] = 5.0
    assert not node.stalled(now[0])  # silent and idle: the heartbeat timeout's business
    with registry.track(node):
        assert node.stalled(now[0]) and registry.mark_stalled() == [(node, 5.0)]


def test_silence_after_a_call_was_given_up_stalls_it_until_it_reports_again() -> None:
    # the flow's per-token deadline moved the node's requests before a maintenance round ran:
    # no call waits on it any more, yet a node frozen since must still be found stalled
    now = [0.0]
    registry = Registry("tiny-llama", clock=lambda: now[0], progress_timeout_s=3.0)
    node = registry.register("d0", Role.DECODE, "127.0.0.1:1", INFO, NodeLoad())
    now[0] = 1.0
    with registry.track(node):
        pass  # its call gave no token and was given up
    registry.gave_up_on(node)
    now[0] = 2.9
    assert not node.stalled(now[0]) and registry.mark_stalled() == []
    now[0] = 3.0
    assert node.stalled(now[0]) and registry.mark_stalled() == [(node, 3.0)] and node.lost
    registry.heartbeat("d0", NodeLoad())  # it answers again: its silence no longer counts
    now[0] = 10.0
    assert not node.stalled(now[0]) and not node.lost


def test_an_instance_dropped_silent_is_lost_and_live_full_is_judged_fresh() -> None:
    now = [0.0]
    registry = Registry("tiny-llama", clock=lambda: now[0], progress_timeout_s=4.0)
    full = NodeLoad(num_running=8, max_num_seqs=8, num_requests=9, engine_steps=1)
    node = registry.register("d0", Role.DECODE, "127.0.0.1:1", INFO, full)
    assert registry.live_and_full(node)
    registry.heartbeat("d0", NodeLoad(num_running=2, max_num_seqs=8, num_requests=9))
    assert not registry.live_and_full(node)  # seats free: a waiting request is stuck
    registry.heartbeat("d0", full)
    now[0] = 4.5
    assert not registry.live_and_full(node)  # its last report is stale
    now[0] = 11.0
    assert registry.expire() == [node] and node.lost
    assert not registry.live_and_full(node)
