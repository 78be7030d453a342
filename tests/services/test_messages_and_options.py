"""Core messages round-trip through msgpack; node options merge flags, env and defaults."""

from __future__ import annotations

import argparse

import msgpack
import pytest
from pdserve_proto import pdserve_pb2 as pb

from common.core_messages import (
    AbortRequests,
    AddRequest,
    GetLoad,
    LoadStats,
    Outputs,
    Ready,
    RequestError,
    RequestTiming,
    Shutdown,
    decode,
    encode,
    engine_config_from_dict,
    engine_config_to_dict,
)
from common.kv_connector import KVHandle
from common.request import TokenLogprobs
from common.sampling_params import SamplingParams
from common.scheduler import EngineCoreOutput
from node_frontend.convert import (
    kv_handle_from_proto,
    kv_handle_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from node_frontend.options import PREFILL_PORT, add_node_arguments, options_from_args

HANDLE = KVHandle("fp-1", 16, 20, [b"a" * 32, b"b" * 32], "file:///tmp/x")
OUTPUT = EngineCoreOutput(
    "r1",
    [7],
    [TokenLogprobs(7, -0.5, [7, 9], [-0.5, -1.5])],
    "stop",
    7,
    num_cached_tokens=16,
    kv_handle=HANDLE,
    num_external_tokens=4,
)

MESSAGES = [
    AddRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, seed=3, stop_token_ids=[9]), 2),
    AddRequest("r2", [1], SamplingParams(), output_token_ids=[4, 5]),
    AbortRequests(["r1", "r2"]),
    GetLoad(7),
    Shutdown(),
    Ready("tiny-llama", 1024, 512, 16, 512, 32, "fp-1", 123),
    Outputs([OUTPUT, EngineCoreOutput("r2", [], [], "abort")], [RequestTiming(1, 2, 3), None]),
    RequestError("r3", "invalid_argument", "prompt is empty"),
    LoadStats(7, 1, 2, 0.25, 384, 512, 40),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.KIND)
def test_messages_round_trip(message) -> None:
    assert decode(encode(message)) == message


def test_malformed_messages_are_value_errors() -> None:
    for data in (b"\xc1", msgpack.packb({"kind": "nope", "body": {}}), msgpack.packb([1, 2])):
        with pytest.raises(ValueError):
            decode(data)
    bad_params = msgpack.packb({"kind": "add", "body": {"sampling_params": {"evil": 1}}})
    with pytest.raises(ValueError):
        decode(bad_params)


def test_engine_config_round_trip() -> None:
    args = argparse.Namespace(kv_store="file:///tmp/x", num_blocks=64, max_num_seqs=8)
    config = options_from_args(args, PREFILL_PORT, env={}).engine_config("both")
    assert engine_config_from_dict(msgpack.unpackb(msgpack.packb(engine_config_to_dict(config))))


def test_sampling_params_proto_round_trip() -> None:
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=11, max_tokens=9, logprobs=2, min_tokens=1
    )
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams(max_tokens=None)
    assert kv_handle_from_proto(kv_handle_to_proto(HANDLE)) == HANDLE


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
