"""Router flags: defaults, PDSERVE_* overrides, validation."""

from __future__ import annotations

import argparse

import pytest

from router.config import RouterConfig, add_arguments


def parse(argv: list[str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return RouterConfig.from_args(parser.parse_args(argv))


def test_defaults_bind_loopback() -> None:
    config = parse([])
    assert (config.host, config.port, config.grpc_port) == ("127.0.0.1", 8000, 50051)
    assert config.api_key is None and config.prefill == () and config.slo.bounds() == {}


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    monkeypatch.setenv("PDSERVE_HEARTBEAT_TIMEOUT", "7.5")
    monkeypatch.setenv("PDSERVE_PORT", "9000")
    config = parse(["--port", "9100", "--prefill", "h:1, h:2", "--decode", "h:3",
                    "--slo", "ttft=200,tpot=40"])  # fmt: skip
    assert config.api_key == "from-env" and config.heartbeat_timeout_s == 7.5
    assert config.port == 9100  # an explicit flag wins over the environment
    assert config.prefill == ("h:1", "h:2") and config.decode == ("h:3",)
    assert config.slo.bounds() == {"ttft": 200.0, "tpot": 40.0}


@pytest.mark.parametrize(
    "argv",
    [["--tls-cert", "c.pem"], ["--tls-client-ca", "ca.pem"], ["--node-tls-cert", "c.pem"],
     ["--heartbeat-interval", "5", "--heartbeat-timeout", "2"], ["--max-inflight", "0"]],
)  # fmt: skip
def test_invalid_combinations(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        parse(argv)
