"""Restart with backoff (``launcher.supervisor``) and the local actuator keeping its count."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

import pytest

from launcher.actuators import LocalProcessActuator, NodeLaunch
from launcher.processes import CLUSTER_ENV, ManagedProcess, child_env, marked_pids
from launcher.supervisor import RestartBudget, RestartPolicy, Supervised
from router.autoscale.policy import Pool
from tests.launcher.test_actuators import stub_launch, wait_addresses  # noqa: F401 (fixture)


def test_backoff_doubles_up_to_the_cap_then_gives_up() -> None:
    now = [0.0]
    budget = RestartBudget(RestartPolicy(0.5, 2.0, max_failures=5, window_s=60), lambda: now[0])
    assert [budget.failed() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    assert budget.failed() is None  # the 5th exit inside 60 s
    assert "5 exits in 60 s" in budget.describe()


def test_exits_older_than_the_window_are_forgotten() -> None:
    now = [0.0]
    budget = RestartBudget(RestartPolicy(1.0, 8.0, max_failures=2, window_s=10), lambda: now[0])
    assert budget.failed() == 1.0
    now[0] = 11.0
    assert budget.failed() == 1.0  # the first exit left the window: not the 2nd in a row
    now[0] = 12.0
    assert budget.failed() is None


@pytest.mark.parametrize(("first", "cap", "failures"), [(-1, 1, 1), (2, 1, 1), (0, 1, 0)])
def test_policy_is_validated(first: float, cap: float, failures: int) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(first, cap, failures)


def _sleeper(tmp_path: Path, marker: str) -> ManagedProcess:
    argv = [sys.executable, "-c", "import time; print('PDSERVE_READY', flush=True); time.sleep(60)"]
    return ManagedProcess("sleeper", argv, tmp_path / "sleeper.log", child_env(marker))


def test_supervised_child_is_restarted_then_given_up(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex

    async def start() -> ManagedProcess:
        process = _sleeper(tmp_path, marker)
        await process.wait_ready(30)
        return process

    async def go() -> None:
        child = Supervised("sleeper", await start(), start, RestartPolicy(0.05, 0.1, 3, 60))
        for restarts in (1, 2):
            child.process.kill_group()
            child.process.proc.wait()
            assert child.check()
            while child.restarting:
                await asyncio.sleep(0.02)
            assert child.restarts == restarts and child.process.alive
        child.process.kill_group()
        child.process.proc.wait()
        assert not child.check() and child.gave_up  # 3rd exit in the window

    asyncio.run(go())
    assert marked_pids(marker) == []


def test_local_actuator_replaces_a_crashed_node_and_autoscaler_does_not_double_it(
    stub_launch: NodeLaunch,  # noqa: F811
) -> None:
    marker = stub_launch.env[CLUSTER_ENV]  # type: ignore[index]
    actuator = LocalProcessActuator(stub_launch, restart=RestartPolicy(0.3, 0.3, 3, 60))

    async def go() -> None:
        await actuator.scale(Pool.DECODE, 2)
        first = await wait_addresses(actuator, Pool.DECODE, 2)
        os.kill(int(first[0].split(":")[1]), 9)
        for _ in range(100):  # noticed without anyone asking (the watcher)
            if len(actuator.processes(Pool.DECODE)) == 1:
                break
            await asyncio.sleep(0.05)
        await actuator.scale(Pool.DECODE, 2)  # an autoscaler tick inside the backoff
        await asyncio.sleep(0.6)  # the backoff's respawn finds the count met
        assert await actuator.current(Pool.DECODE) == 2
        again = await wait_addresses(actuator, Pool.DECODE, 2)
        assert first[1] in again and first[0] not in again
        for _ in range(3):  # crash looping: given up after 3 exits in the window
            for node in actuator.nodes(Pool.DECODE):
                os.kill(node.process.pid, 9)
            await asyncio.sleep(0.8)
        assert Pool.DECODE in actuator.gave_up
        await actuator.close()

    asyncio.run(go())
    assert marked_pids(marker) == []


class _Nodes:
    """What ``Cluster._cannot_serve`` reads of the local actuator."""

    def __init__(self, gave_up: set[Pool], live: dict[Pool, int]) -> None:
        self.gave_up = gave_up
        self.live = live

    def nodes(self, pool: Pool) -> list[object]:
        return [object()] * self.live.get(pool, 0)


@pytest.mark.parametrize(
    ("router_gave_up", "gave_up", "live", "router_args", "reason"),
    [
        (False, set(), {}, (), None),
        (True, set(), {}, (), "the router keeps exiting"),
        (False, {Pool.DECODE}, {Pool.DECODE: 1}, (), None),  # one decode node still serves
        (False, {Pool.DECODE}, {}, (), "every decode node keeps exiting"),
        (False, {Pool.PREFILL}, {}, (), None),  # decode nodes prefill (fallback)
        (False, {Pool.PREFILL}, {}, ("--no-prefill-fallback",), "every prefill node keeps exiting"),
    ],
)
def test_up_stops_only_when_nothing_can_serve(
    router_gave_up: bool, gave_up: set[Pool], live: dict[Pool, int],
    router_args: tuple[str, ...], reason: str | None,
) -> None:  # fmt: skip
    from types import SimpleNamespace

    from launcher.cluster import Cluster

    cluster = SimpleNamespace(
        supervised=[SimpleNamespace(gave_up=router_gave_up)],
        nodes=_Nodes(gave_up, live),
        config=SimpleNamespace(router_args=router_args),
    )
    assert Cluster._cannot_serve(cluster) == reason  # type: ignore[arg-type]
