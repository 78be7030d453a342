"""The node watchdog (``launcher.watchdog``): its verdicts, and the local actuator killing and
replacing a stub node that does not answer, or whose engine stands still while it holds
requests (a fake ``GetLoad`` in this process), while a live one is left alone."""

from __future__ import annotations

import asyncio
import stat
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.nodes import NodeLoad

from launcher.actuators import LocalNode, LocalProcessActuator, NodeLaunch
from launcher.processes import CLUSTER_ENV, child_env, marked_pids
from launcher.supervisor import RestartPolicy
from launcher.watchdog import NodeWatch, WatchdogConfig
from router.autoscale.policy import Pool

BUSY = NodeLoad(num_requests=2, engine_steps=7)


def test_verdicts() -> None:
    watch = NodeWatch(timeout_s=5.0, now_s=0.0)
    assert watch.verdict(BUSY, 1.0) is None
    assert watch.verdict(BUSY, 5.9) is None  # the clock runs from the first busy report
    assert watch.verdict(BUSY, 6.0) == (
        "hung: its engine made no progress for 5 s while it held 2 requests"
    )
    assert watch.verdict(NodeLoad(num_requests=2, engine_steps=8), 7.0) is None  # it moved
    assert watch.verdict(NodeLoad(engine_steps=8), 20.0) is None  # idle: never stalled
    assert watch.verdict(None, 24.0) is None
    assert watch.verdict(None, 25.0) == "hung: no answer for 5 s"


# A stub node: ready at once (announcing $STUB_PORT, where this test may serve a fake GetLoad),
# exits on SIGTERM.
STUB_NODE = """#!/bin/sh
trap 'exit 0' TERM
echo "PDSERVE_READY port=${STUB_PORT:-$$}"
while :; do sleep 0.05; done
"""


def launch(tmp_path: Path, port: int | None = None) -> NodeLaunch:
    script = tmp_path / "stub-node"
    script.write_text(STUB_NODE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    extra = {"STUB_PORT": str(port)} if port else {}
    env = child_env(uuid.uuid4().hex, **extra)
    return NodeLaunch("127.0.0.1:1", "file:///x", tmp_path, env=env, python=str(script))


class FakeLoad(pb_grpc.DecodeServiceServicer):
    def __init__(self, load: Callable[[], NodeLoad]) -> None:
        self.load = load
        self.calls = 0

    async def GetLoad(self, request: pb.GetLoadRequest, context: object) -> pb.LoadReport:
        self.calls += 1
        load = self.load()
        return pb.LoadReport(
            role=pb.ROLE_DECODE,
            num_requests=load.num_requests,
            engine_steps=load.engine_steps,
        )


@asynccontextmanager
async def fake_node(servicer: FakeLoad) -> AsyncIterator[int]:
    server = grpc.aio.server()
    pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def first_node(actuator: LocalProcessActuator) -> LocalNode:
    for _ in range(200):
        nodes = [n for n in actuator.nodes(Pool.DECODE) if n.address]
        if nodes:
            return nodes[0]
        await asyncio.sleep(0.05)
    raise AssertionError("the stub node did not start")


async def killed(node: LocalNode, timeout_s: float) -> float:
    """Seconds until the watchdog killed ``node``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while node.process.alive:
        assert loop.time() - start < timeout_s, "the watchdog did not kill the node"
        await asyncio.sleep(0.05)
    return loop.time() - start


WATCHDOG = WatchdogConfig(timeout_s=1.0, interval_s=0.2, rpc_timeout_s=0.5)
FAST_RESTART = RestartPolicy(0.2, 0.2, 5, 60)


def test_a_node_that_does_not_answer_is_killed_and_replaced(tmp_path: Path) -> None:
    """The stub serves no gRPC at all: a frozen frontend (SIGSTOP) looks the same."""
    stub = launch(tmp_path)
    actuator = LocalProcessActuator(stub, FAST_RESTART, WATCHDOG)

    async def go() -> None:
        await actuator.scale(Pool.DECODE, 1)
        node = await first_node(actuator)
        assert await killed(node, 10.0) >= 0.9
        assert node.hung == "hung: no answer for 1 s"
        for _ in range(100):  # replaced after the backoff, by a new process
            replacement = [n for n in actuator.nodes(Pool.DECODE) if n is not node]
            if replacement:
                break
            await asyncio.sleep(0.05)
        assert replacement and replacement[0].process.pid != node.process.pid
        assert "hung: no answer" in actuator._budgets[Pool.DECODE].describe(node.hung)
        await actuator.close()

    asyncio.run(go())
    assert marked_pids(stub.env[CLUSTER_ENV]) == []  # type: ignore[index]


def test_a_node_whose_engine_stands_still_is_killed_a_live_one_not(tmp_path: Path) -> None:
    steps = [0]

    def moving() -> NodeLoad:
        steps[0] += 1
        return NodeLoad(num_requests=3, engine_steps=steps[0])

    async def go() -> None:
        live = FakeLoad(moving)
        async with fake_node(live) as port:
            actuator = LocalProcessActuator(launch(tmp_path, port), FAST_RESTART, WATCHDOG)
            await actuator.scale(Pool.DECODE, 1)
            node = await first_node(actuator)
            await asyncio.sleep(2.5)  # 2.5 bounds: a live node is left alone
            assert node.process.alive and node.hung is None and live.calls >= 5
            live.load = lambda: BUSY  # now its engine stands still, holding requests
            assert await killed(node, 10.0) >= 0.9
            assert node.hung == "hung: its engine made no progress for 1 s while it held 2 requests"
            await actuator.close()

    asyncio.run(go())
