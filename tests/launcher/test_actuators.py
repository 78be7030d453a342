"""Actuators: compose through a fake command runner, Kubernetes through a fake API server
(httpx.MockTransport), local processes with a stub node; and the loop's scale-down order."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from launcher.actuators import (
    CommandResult,
    ComposeActuator,
    ComposeTarget,
    KubernetesActuator,
    KubernetesTarget,
    LocalProcessActuator,
    NodeLaunch,
)
from launcher.processes import CLUSTER_ENV, child_env, marked_pids
from router.autoscale.actuator import ActuatorError
from router.autoscale.policy import Pool

# -- docker compose -------------------------------------------------------------------------------


class FakeRunner:
    """Records every command; answers ``ps -q`` with ``running`` container ids."""

    def __init__(self, running: int = 2, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.running = running
        self.fail = fail

    async def __call__(self, argv: Sequence[str]) -> CommandResult:
        self.calls.append(list(argv))
        if self.fail:
            return CommandResult(1, "", "no such service: prefill")
        if "ps" in argv:
            return CommandResult(0, "".join(f"c0ffee{i}\n" for i in range(self.running)), "")
        return CommandResult(0, "", "")


def test_compose_reads_and_sets_replicas() -> None:
    runner = FakeRunner(running=2)
    target = ComposeTarget(compose_file="compose.yaml", project="pd")
    actuator = ComposeActuator(target, runner)

    async def go() -> tuple[int, int]:
        before = await actuator.current(Pool.PREFILL)
        await actuator.scale(Pool.PREFILL, 3)
        return before, await actuator.current(Pool.PREFILL)

    assert asyncio.run(go()) == (2, 3)
    base = ["docker", "compose", "-f", "compose.yaml", "-p", "pd"]
    assert runner.calls == [
        [*base, "ps", "-q", "prefill"],
        [*base, "up", "-d", "--no-deps", "--no-recreate", "--scale", "prefill=3", "prefill"],
    ]
    assert actuator.choose_victims(Pool.PREFILL, 1, ["127.0.0.1:1"]) == []


def test_compose_scales_the_decode_service_and_reports_failures() -> None:
    runner = FakeRunner()
    actuator = ComposeActuator(ComposeTarget(decode_service="gen"), runner)
    asyncio.run(actuator.scale(Pool.DECODE, 4))
    assert runner.calls[-1][-3:] == ["--scale", "gen=4", "gen"]
    failing = ComposeActuator(ComposeTarget(), FakeRunner(fail=True))
    with pytest.raises(ActuatorError, match="no such service"):
        asyncio.run(failing.scale(Pool.PREFILL, 2))


# -- Kubernetes ---------------------------------------------------------------------------------


class FakeApiServer:
    """The two calls of the scale subresource, with bearer-token checking."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.replicas = {"pdserve-prefill": 1, "pdserve-decode": 2}
        self.requests: list[httpx.Request] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return httpx.Response(401, json={"kind": "Status", "reason": "Unauthorized"})
        parts = request.url.path.strip("/").split("/")
        # apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
        if parts[:3] != ["apis", "apps", "v1"] or parts[5] != "deployments" or parts[7] != "scale":
            return httpx.Response(404)
        name = parts[6]
        if request.method == "PATCH":
            assert request.headers["content-type"] == "application/merge-patch+json"
            self.replicas[name] = json.loads(request.content)["spec"]["replicas"]
        return httpx.Response(
            200, json={"kind": "Scale", "spec": {"replicas": self.replicas[name]}}
        )


def k8s(tmp_path: Path, server: FakeApiServer, token: str) -> KubernetesActuator:
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    target = KubernetesTarget(
        api_url="https://k8s.test", namespace="serving", token_file=token_file
    )
    return KubernetesActuator(target, transport=httpx.MockTransport(server.handler))


def test_kubernetes_patches_the_scale_subresource(tmp_path: Path) -> None:
    server = FakeApiServer("secret-token")
    actuator = k8s(tmp_path, server, "secret-token")

    async def go() -> tuple[int, int, int]:
        try:
            prefill = await actuator.current(Pool.PREFILL)
            await actuator.scale(Pool.DECODE, 5)
            return prefill, await actuator.current(Pool.DECODE), server.replicas["pdserve-decode"]
        finally:
            await actuator.close()

    assert asyncio.run(go()) == (1, 5, 5)
    patch = next(r for r in server.requests if r.method == "PATCH")
    assert patch.url.path == "/apis/apps/v1/namespaces/serving/deployments/pdserve-decode/scale"
    assert json.loads(patch.content) == {"spec": {"replicas": 5}}


def test_kubernetes_rereads_a_rotated_token_and_reports_refusals(tmp_path: Path) -> None:
    server = FakeApiServer("new-token")
    actuator = k8s(tmp_path, server, "old-token")

    async def go() -> int:
        try:
            with pytest.raises(ActuatorError, match="401"):
                await actuator.scale(Pool.PREFILL, 2)
            (tmp_path / "token").write_text("new-token")  # the kubelet rotated it
            await actuator.scale(Pool.PREFILL, 2)
            return server.replicas["pdserve-prefill"]
        finally:
            await actuator.close()

    assert asyncio.run(go()) == 2


# -- local processes (a stub node that only prints its ready line and drains) --------------------

STUB_NODE = """#!/bin/sh
# Stand-in for `python -m pdserve_cli prefill|decode ...`: ready at once, exits on SIGTERM.
trap 'echo "$3 drained" >> "$STUB_LOG"; exit 0' TERM
echo "PDSERVE_READY port=$$"
while :; do sleep 0.05; done
"""


@pytest.fixture
def stub_launch(tmp_path: Path) -> NodeLaunch:
    script = tmp_path / "stub-node"
    script.write_text(STUB_NODE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env = child_env(uuid.uuid4().hex, STUB_LOG=str(tmp_path / "drained.log"))
    return NodeLaunch("127.0.0.1:1", "file:///x", tmp_path, env=env, python=str(script))


async def wait_addresses(actuator: LocalProcessActuator, pool: Pool, count: int) -> list[str]:
    for _ in range(400):
        addresses = [n.address for n in actuator.nodes(pool) if n.address]
        if len(addresses) == count:
            return addresses
        await asyncio.sleep(0.05)
    raise AssertionError(f"{count} {pool.value} stubs not ready")


def test_local_actuator_starts_stops_chosen_victims_and_cleans_up(
    stub_launch: NodeLaunch, tmp_path: Path
) -> None:
    marker = stub_launch.env[CLUSTER_ENV]  # type: ignore[index]
    actuator = LocalProcessActuator(stub_launch, restart=None)  # replacement: test_supervisor

    async def go() -> None:
        await actuator.scale(Pool.DECODE, 3)
        assert await actuator.current(Pool.DECODE) == 3
        addresses = await wait_addresses(actuator, Pool.DECODE, 3)
        ranked = [addresses[1], "10.0.0.9:1", addresses[0]]  # least busy first; one not ours
        victims = actuator.choose_victims(Pool.DECODE, 1, ranked)
        assert victims == [addresses[1]]
        await actuator.scale(Pool.DECODE, 2, victims)
        remaining = [n.address for n in actuator.nodes(Pool.DECODE)]
        assert remaining == [addresses[0], addresses[2]]
        os.kill(int(addresses[2].split(":")[1]), 9)  # a node crashes: it is noticed
        for _ in range(400):
            if await actuator.current(Pool.DECODE) == 1:
                break
            await asyncio.sleep(0.05)
        assert await actuator.current(Pool.DECODE) == 1
        await actuator.close()

    asyncio.run(go())
    assert (tmp_path / "drained.log").read_text().split() == ["decode", "drained"] * 2
    assert marked_pids(marker) == []


# -- the loop: out of routing first, then stopped -------------------------------------------------


class RecordingActuator:
    """Local-like: owns every address, records what the registry held at each scale call."""

    def __init__(self, registry: object, sizes: dict[Pool, int]) -> None:
        self.registry = registry
        self.sizes = dict(sizes)
        self.calls: list[tuple[Pool, int, list[str], set[str]]] = []

    async def current(self, pool: Pool) -> int:
        return self.sizes[pool]

    def choose_victims(self, pool: Pool, count: int, ranked: Sequence[str]) -> list[str]:
        return list(ranked[:count])

    async def scale(self, pool: Pool, replicas: int, victims: Sequence[str] = ()) -> None:
        routed = {i.address for i in self.registry.instances()}  # type: ignore[attr-defined]
        self.calls.append((pool, replicas, list(victims), routed))
        self.sizes[pool] = replicas

    async def close(self) -> None:
        return None


def test_loop_unroutes_the_least_busy_instance_before_stopping_it() -> None:
    """The loop reads each instance's load from the registry (sent with its heartbeats)."""
    from pdserve_proto.nodes import NodeInfo, NodeLoad

    from bench.slo import LiveSLOStats
    from router.autoscale.loop import AutoscaleLoop, traffic_snapshot
    from router.autoscale.policy import Autoscaler, AutoscalerConfig, PoolLimits
    from router.metrics import RouterMetrics
    from router.registry import Registry, Role

    registry = Registry("tiny-llama")
    info = NodeInfo("tiny-llama", "fp", block_size=16, max_model_len=512)
    registry.register("p0", Role.PREFILL, "127.0.0.1:5000", info, NodeLoad(max_num_seqs=8))
    running = {"127.0.0.1:6000": 1, "127.0.0.1:6001": 0}
    for i, (address, count) in enumerate(running.items()):
        load = NodeLoad(num_running=count, max_num_seqs=8)
        registry.register(f"d{i}", Role.DECODE, address, info, load)
    metrics = RouterMetrics(registry.state_counts, LiveSLOStats())
    config = AutoscalerConfig(
        prefill=PoolLimits(1, 2), decode=PoolLimits(1, 2), down_delay_s=0, down_cooldown_s=0
    )
    actuator = RecordingActuator(registry, {Pool.PREFILL: 1, Pool.DECODE: 2})
    loop = AutoscaleLoop(Autoscaler(config), actuator, registry, metrics, 1.0)
    decisions = asyncio.run(loop.step())
    assert [(d.pool, d.current, d.target) for d in decisions] == [(Pool.DECODE, 2, 1)]
    ((pool, replicas, victims, routed),) = actuator.calls
    assert (pool, replicas, victims) == (Pool.DECODE, 1, ["127.0.0.1:6001"])  # the idle one
    assert "127.0.0.1:6001" not in routed and "127.0.0.1:6000" in routed
    assert b'pdserve_autoscaler_target_instances{pool="decode"} 1.0' in metrics.exposition()
    meter = metrics.start("completions")
    assert traffic_snapshot(metrics, 1.0).arrivals == 1  # in flight counts as arrived
    meter.finish("ok", 100, 20)
    snapshot = traffic_snapshot(metrics, 2.0)
    assert (snapshot.arrivals, snapshot.completed, snapshot.prompt_tokens) == (1, 1, 100)
    assert snapshot.output_tokens == 20


GPU_STUB_NODE = """#!/bin/sh
# Records the GPUs and the flags it was started with, then behaves as the stub node above.
echo "$CUDA_VISIBLE_DEVICES $*" >> "$STUB_LOG"
echo "PDSERVE_READY port=$$"
trap 'exit 0' TERM
while :; do sleep 0.05; done
"""


def test_local_actuator_gives_each_node_its_tp_size_in_distinct_gpus(tmp_path: Path) -> None:
    script = tmp_path / "stub-node"
    script.write_text(GPU_STUB_NODE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env = child_env(uuid.uuid4().hex, STUB_LOG=str(tmp_path / "started.log"))
    launch = NodeLaunch(
        "127.0.0.1:1", "file:///x", tmp_path, env=env, python=str(script),
        gpus=("0", "1", "2", "3"), prefill_tp=2, decode_tp=1,
    )  # fmt: skip
    actuator = LocalProcessActuator(launch, restart=None)

    async def go() -> dict[str, int]:
        await actuator.scale(Pool.PREFILL, 1)
        await actuator.scale(Pool.DECODE, 2)
        await wait_addresses(actuator, Pool.DECODE, 2)
        await wait_addresses(actuator, Pool.PREFILL, 1)
        await actuator.scale(Pool.PREFILL, 0)  # its two GPUs are free again once it stopped
        for _ in range(400):
            if actuator.gpus.in_use()["0"] == 0:
                break
            await asyncio.sleep(0.05)
        in_use = actuator.gpus.in_use()
        await actuator.close()
        return in_use

    in_use = asyncio.run(go())
    started = [line.split() for line in (tmp_path / "started.log").read_text().splitlines()]
    pools = {words[3]: [] for words in started}  # "GPUS -m pdserve_cli POOL flags…"
    for words in started:
        pools[words[3]].append((words[0], " ".join(words[4:])))
    ((prefill_gpus, prefill_flags),) = pools["prefill"]
    assert prefill_gpus == "0,1"  # two distinct GPUs, the least used first
    assert "--tensor-parallel-size 2" in prefill_flags
    assert sorted(gpus for gpus, _ in pools["decode"]) == ["2", "3"]
    assert all("--tensor-parallel-size" not in flags for _, flags in pools["decode"])
    assert in_use == {"0": 0, "1": 0, "2": 1, "3": 1}


def test_a_tp_size_larger_than_the_gpus_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--decode-tp 4 needs 4 GPUs; there are 2"):
        NodeLaunch("127.0.0.1:1", "file:///x", tmp_path, gpus=("0", "1"), decode_tp=4)
