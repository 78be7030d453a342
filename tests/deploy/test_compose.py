"""compose.yaml (+ compose.cpu.yaml) and the Dockerfile: structure, and every command parses.

No Docker engine is needed: the files are read with yaml.safe_load, each service's command is
parsed by the real ``pdserve`` argparse parser (the image's entrypoint is ``pdserve``), and each
healthcheck by the health probe's parser.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher import health_check
from pdserve_cli import build_parser

REPO = Path(__file__).resolve().parents[2]
NODES = ("prefill", "decode")


class ComposeLoader(yaml.SafeLoader):
    """SafeLoader plus Compose's ``!reset`` tag (it clears the merged value)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load(name: str) -> dict[str, Any]:
    """A compose file that may use ``!reset`` (a SafeLoader: no object construction)."""
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_services_and_redis_is_a_bounded_cache(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", "router", *NODES}
    command = services["redis"]["command"]
    assert command[0] == "redis-server"
    flags = dict(zip(command[1::2], command[2::2]))
    assert flags["--maxmemory-policy"] == "allkeys-lru" and "--maxmemory" in flags
    assert flags["--save"] == "" and flags["--appendonly"] == "no"  # no persistence


def test_every_service_command_is_a_pdserve_subcommand_that_parses(
    compose: dict[str, Any], parser
) -> None:
    expected = {"router": "router", "prefill": "prefill", "decode": "decode"}
    for name, subcommand in expected.items():
        args = parser.parse_args(compose["services"][name]["command"])
        assert args.command == subcommand
        assert args.host == "0.0.0.0"  # explicit in compose: never a code default
        assert callable(args.func)


def test_nodes_find_redis_and_the_router_by_environment(compose: dict[str, Any]) -> None:
    for name in NODES:
        env = compose["services"][name]["environment"]
        assert env["PDSERVE_KV_STORE"] == "redis://redis:6379/0"
        assert env["PDSERVE_ROUTER"] == "router:50051"
        assert all(key.startswith("PDSERVE_") for key in env)
    router_env = compose["services"]["router"]["environment"]
    assert router_env["PDSERVE_API_KEY"] is None  # passed through from the host, never ""


def test_healthchecks_and_start_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    probe = health_check.build_parser()
    for name in ("router", *NODES):
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "launcher.health_check"]
        args = probe.parse_args(test[4:])
        if name == "router":
            assert args.http == "http://127.0.0.1:8000/ready"  # 503 until it can serve
        else:
            port = shlex.split(" ".join(services[name]["command"]))[-1]
            assert args.grpc == f"127.0.0.1:{port}"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name in NODES:
        depends = services[name]["depends_on"]
        assert depends == {
            "redis": {"condition": "service_healthy"},
            "router": {"condition": "service_started"},  # ready needs the nodes
        }
        assert services[name]["stop_grace_period"]  # room to drain on SIGTERM


def test_gpu_reservation_on_nodes_and_its_cpu_override(compose: dict[str, Any]) -> None:
    for name in NODES:
        (device,) = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert "deploy" not in compose["services"]["router"]
    cpu = load("compose.cpu.yaml")["services"]
    for name in NODES:
        assert cpu[name]["deploy"] is None  # !reset
        assert cpu[name]["environment"]["PDSERVE_DEVICE"] == "cpu"
        assert cpu[name]["build"]["args"]["TORCH_VARIANT"] == "cpu"


def test_only_the_router_publishes_ports_on_loopback_by_default(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert [n for n, s in services.items() if "ports" in s] == ["router"]
    for mapping in services["router"]["ports"]:
        assert mapping.startswith("${PDSERVE_BIND:-127.0.0.1}:")


def test_dockerfile_cpu_by_default_cuda_by_build_arg() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "ARG TORCH_VARIANT=cpu" in text
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in text
    assert 'ENTRYPOINT ["pdserve"]' in text
    assert "USER pdserve" in text
    packages = ("common", "kernels", "kv_store", "node_frontend", "prefill_node", "decode_node")
    for package in (*packages, "router", "launcher", "bench", "proto"):
        assert f"COPY {package} {package}" in text


def test_base_images_are_arguments_that_default_to_the_registry_ones(
    compose: dict[str, Any],
) -> None:
    """A user with a registry gets python:3.11-slim and redis:7-alpine; deploy/offline_images.sh
    passes its own bases and WHEELHOUSE=1 (deploy/compose_test.sh runs the real thing)."""
    text = (REPO / "Dockerfile").read_text()
    assert not text.startswith("# syntax=")  # BuildKit would pull its frontend image
    assert "ARG PYTHON_IMAGE=python:3.11-slim\nFROM ${PYTHON_IMAGE}\n" in text
    assert "ARG WHEELHOUSE=0" in text and "COPY deploy/wheelhouse /tmp/wheelhouse/" in text
    args = compose["x-image"]["build"]["args"]
    assert args["PYTHON_IMAGE"] == "${PDSERVE_PYTHON_IMAGE:-python:3.11-slim}"
    assert args["WHEELHOUSE"] == "${PDSERVE_WHEELHOUSE:-0}"
    redis = compose["services"]["redis"]
    assert redis["image"] == "${PDSERVE_REDIS_IMAGE:-redis:7-alpine}"
    command = redis["command"]
    assert command[command.index("--protected-mode") + 1] == "no"  # any Redis build, not loopback
