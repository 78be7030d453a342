"""Folders are programs: the launcher starts the router as a process and imports only the leaf
interface of its autoscaler (and the router's node channels, for its watchdog); the router
imports no launcher code (until it builds an actuator) and, of bench/, only the SLO math. Each
check imports in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = (
    "cluster", "cluster_config", "cluster_demo", "local_store", "processes", "actuators",
    "health_check", "ports", "reaper", "state", "down",
)  # fmt: skip
ROUTER_LEAVES = {
    "router",
    "router.autoscale",
    "router.autoscale.policy",
    "router.autoscale.actuator",
}
# and the node channels (TLS) that the launcher's node watchdog dials as the router does
LAUNCHER_FROM_ROUTER = ROUTER_LEAVES | {"router.node_clients"}


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (from the repo root)."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def package(loaded: set[str], name: str) -> set[str]:
    return {m for m in loaded if m == name or m.startswith(f"{name}.")}


def test_the_launcher_imports_only_the_autoscaler_leaves_of_the_router() -> None:
    loaded = modules_after("\n".join(f"import launcher.{name}" for name in (*LAUNCHER, "demo")))
    assert package(loaded, "router") == LAUNCHER_FROM_ROUTER
    assert not package(loaded, "torch")


def test_the_autoscaler_leaves_import_nothing_else() -> None:
    loaded = modules_after("import router.autoscale.actuator")
    assert package(loaded, "router") == ROUTER_LEAVES
    assert not package(loaded, "launcher") and not package(loaded, "bench")


def test_the_router_imports_no_launcher_and_only_the_slo_math_of_bench() -> None:
    loaded = modules_after("import router.server")
    assert not package(loaded, "launcher")
    assert package(loaded, "bench") == {"bench", "bench.slo"}
