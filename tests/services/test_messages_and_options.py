"""The engine config round-trips through msgpack; node options merge flags, env and defaults
(the core messages are tested in test_core_client.py)."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from common.core_messages import engine_config_from_dict, engine_config_to_dict
from node_frontend.options import PREFILL_PORT, add_node_arguments, options_from_args


def test_engine_config_round_trip() -> None:
    args = argparse.Namespace(kv_store="file:///tmp/x", num_blocks=64, max_num_seqs=8)
    config = options_from_args(args, PREFILL_PORT, env={}).engine_config("both")
    data = msgspec.msgpack.encode(engine_config_to_dict(config))
    assert engine_config_from_dict(msgspec.msgpack.decode(data)) == config


def _parse(argv: list[str], env: dict[str, str]):
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, PREFILL_PORT)
    return options_from_args(parser.parse_args(argv), PREFILL_PORT, env=env)


def test_flags_beat_env_beat_defaults() -> None:
    env = {"kv_store": "redis://127.0.0.1:1/0", "port": "0", "max_queue": "3", "cache_dir": "/x"}
    options = _parse(["--max-queue", "5", "--num-blocks", "64"], env)
    assert (options.kv_store, options.port, options.max_queue) == (env["kv_store"], 0, 5)
    assert (options.num_blocks, options.host, options.model) == (64, "127.0.0.1", "tiny-llama")
    assert _parse(["--kv-store", "file:///tmp/x"], {}).port == PREFILL_PORT


def test_bad_options_are_clear() -> None:
    with pytest.raises(ValueError, match="--kv-store is required"):
        _parse([], {})
    with pytest.raises(ValueError, match="PDSERVE_PORT"):
        _parse(["--kv-store", "file:///tmp/x"], {"port": "http"})
    with pytest.raises(ValueError, match="--host is empty"):  # would bind every interface
        _parse(["--kv-store", "file:///tmp/x", "--host", " "], {})


def test_tensor_parallel_size_flag() -> None:
    """``--tensor-parallel-size`` (or ``PDSERVE_TENSOR_PARALLEL_SIZE``) reaches the engine config
    of a node, whose KV store works at any TP size."""
    options = _parse(["--kv-store", "file:///tmp/x"], {"tensor_parallel_size": "1"})
    assert options.engine_config("both").tensor_parallel_size == 1
    options = _parse(["--kv-store", "file:///tmp/x", "--tensor-parallel-size", "2"], {})
    assert options.tensor_parallel_size == 2
    config = options.engine_config("producer")
    assert config.tensor_parallel_size == 2 and config.kv_store == "file:///tmp/x"


def test_a_wildcard_host_advertises_its_address_towards_the_router() -> None:
    """A container on several networks (compose: the router's and the KV store's) has an address
    on each; the router reaches only the one on its own network, the route's source address."""
    from node_frontend.options import route_address

    assert route_address("127.0.0.1:50051") == "127.0.0.1"
    assert route_address(None) is None and route_address("no-port") is None
    options = _parse(["--host", "0.0.0.0", "--router", "127.0.0.1:50051"],
                     {"kv_store": "redis://127.0.0.1:1/0"})  # fmt: skip
    assert options.address(50071) == "127.0.0.1:50071"
    pinned = _parse(["--advertise-address", "node-3:7"], {"kv_store": "redis://127.0.0.1:1/0"})
    assert pinned.address(50071) == "node-3:7"
