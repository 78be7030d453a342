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
     ["--heartbeat-interval", "5", "--heartbeat-timeout", "2"], ["--max-inflight", "0"],
     ["--host", ""]],
)  # fmt: skip
def test_invalid_combinations(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        parse(argv)


def test_layout_flags_only_check_the_nodes(caplog: pytest.LogCaptureFixture) -> None:
    """The router takes block size and context from its nodes: by default it sets neither;
    --block-size is deprecated (a warning) and --max-model-len may not exceed the model's."""
    from router.server import build_router

    config = parse([])
    assert (config.block_size, config.max_model_len) == (None, None)
    with caplog.at_level("WARNING", logger="router.server"):
        router = build_router(parse(["--block-size", "16", "--max-model-len", "256"]))
    assert "--block-size is deprecated" in caplog.text
    assert (router.registry.expected_block_size, router.registry.max_model_len()) == (16, 256)
    with pytest.raises(ValueError, match="exceeds the model's limit 4096"):
        build_router(parse(["--max-model-len", "8192"]))
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        parse(["--block-size", "0"])


def test_prefill_fallback_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]).prefill_fallback is True  # on by default
    assert parse(["--no-prefill-fallback"]).prefill_fallback is False
    monkeypatch.setenv("PDSERVE_PREFILL_FALLBACK", "0")
    assert parse([]).prefill_fallback is False
    assert parse(["--prefill-fallback"]).prefill_fallback is True
    assert parse(["--max-json-depth", "8"]).max_json_depth == 8
    with pytest.raises(ValueError):
        parse(["--max-json-depth", "0"])
