"""The one conversion layer (``pdserve_proto.convert``): every field round-trips, floats follow
one rule on both ends, one finish-reason map, and one Python type per node report."""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    generate_params_from_proto,
    kv_handle_from_proto,
    kv_handle_to_proto,
    load_from_proto,
    load_to_proto,
    node_info_from_engine,
    node_info_from_proto,
    node_info_to_proto,
    node_load_from_engine,
    role_from_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    wire_float,
    wire_rounded,
)
from pdserve_proto.nodes import NodeInfo, NodeLoad, Role

from common.core_messages import LoadStats, Ready
from common.kv_interface import KVHandle
from common.sampling_params import SamplingParams, StructuredOutputsParams
from node_frontend.stats import NodeStats

# Fields only the router uses: GenerateRequest carries them, nodes never see them.
TEXT_FIELDS = {"stop", "skip_special_tokens", "include_stop_str_in_output"}
FLOAT_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.type == "float"]
# Every node-level field away from its default (floats that float32 holds as written).
PARAMS = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=-0.5,
    frequency_penalty=0.25,
    seed=2**63 - 1,
    max_tokens=9,
    min_tokens=2,
    stop_token_ids=[7, 9],
    ignore_eos=True,
    logprobs=0,
    prompt_logprobs=3,
    structured_outputs=StructuredOutputsParams(choice=["a", "b c"], disable_any_whitespace=True),
)
HANDLE = KVHandle(
    fingerprint="fp-1",
    block_size=16,
    num_tokens=20,
    block_hashes=[b"a" * 32, b"b" * 32],
    store_url="file:///tmp/x",
)


def over_the_wire(params: SamplingParams) -> SamplingParams:
    """What a node reads from a message the router serialised."""
    data = sampling_params_to_proto(params).SerializeToString()
    return sampling_params_from_proto(pb.SamplingParams.FromString(data))


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_every_sampling_params_field_round_trips() -> None:
    default = SamplingParams()
    node_fields = [f.name for f in dataclasses.fields(SamplingParams)]
    node_fields = [n for n in node_fields if n not in TEXT_FIELDS and n != "n"]
    # A field added to SamplingParams must be added here (and to the wire) too.
    assert all(getattr(PARAMS, n) != getattr(default, n) for n in node_fields)
    assert over_the_wire(PARAMS) == PARAMS
    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams(max_tokens=None)
    request = pb.GenerateRequest(
        sampling_params=sampling_params_to_proto(PARAMS),
        stop=["\n\n", "END"],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    expected = dataclasses.replace(
        PARAMS, stop=["\n\n", "END"], skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert generate_params_from_proto(request) == expected
    assert all(getattr(expected, n) != getattr(default, n) for n in TEXT_FIELDS)


@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3, 0.123456789, 1e-8, 1.9999999, 0.0])
def test_router_and_node_hold_the_same_floats(value: float) -> None:
    """The router keeps ``wire_rounded`` params; the node reads the message: bit for bit the
    same, for every float field; rounding again changes nothing."""
    for name in FLOAT_FIELDS:
        try:
            params = SamplingParams(**{name: value})
        except ValueError:
            continue  # out of this field's range
        held = wire_rounded(params)
        read = over_the_wire(params)
        assert bits(getattr(held, name)) == bits(getattr(read, name)), name
        assert wire_rounded(held) == held
        assert over_the_wire(held) == read
    assert wire_float(0.123456789, "x") == 0.12345679  # the shortest decimal of the float32


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e39])
def test_non_finite_and_overflowing_floats_are_refused(value: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        sampling_params_from_proto(pb.SamplingParams(temperature=value))
    with pytest.raises(ValueError, match="temperature"):
        wire_rounded(SamplingParams(temperature=value))


def test_one_finish_reason_map() -> None:
    for name in ("stop", "length", "abort", "error", None):
        assert finish_reason_from_proto(finish_reason_to_proto(name)) == name
    assert finish_reason_to_proto(None) == pb.FINISH_REASON_UNSPECIFIED
    # A prefill that hands the request off did not finish it.
    assert finish_reason_from_proto(pb.FINISH_REASON_HANDED_OFF) is None
    assert finish_reason_from_proto(99) == "error"  # a newer peer's value
    with pytest.raises(ValueError, match="unknown finish reason"):
        finish_reason_to_proto("weird")


def test_kv_handle_round_trips_and_is_checked() -> None:
    assert kv_handle_from_proto(kv_handle_to_proto(HANDLE)) == HANDLE
    short = kv_handle_to_proto(HANDLE)
    del short.block_hashes[1:]
    with pytest.raises(ValueError, match="1 block hashes for 20 tokens"):
        kv_handle_from_proto(short)
    stubby = kv_handle_to_proto(HANDLE)
    stubby.block_hashes[:] = [b"a", b"b"]
    with pytest.raises(ValueError, match="32 bytes"):
        kv_handle_from_proto(stubby)


def test_node_load_is_the_load_report() -> None:
    """One type: NodeLoad has exactly the LoadReport's fields (role aside, which the registry
    keeps), and every one of them round-trips."""
    report_fields = {f.name for f in pb.LoadReport.DESCRIPTOR.fields} - {"role"}
    assert {f.name for f in dataclasses.fields(NodeLoad)} == report_fields
    values = {f.name: i + 1 for i, f in enumerate(dataclasses.fields(NodeLoad))}
    values.update(kv_usage=0.5, draining=True, lora_adapters=("alpha", "beta"))
    load = NodeLoad(**values)  # type: ignore[arg-type]
    report = pb.LoadReport.FromString(load_to_proto(pb.ROLE_DECODE, load).SerializeToString())
    assert report.role == pb.ROLE_DECODE
    assert load_from_proto(report) == load
    for usage, clamped in ((1.5, 1.0), (-1.0, 0.0), (math.nan, 0.0)):
        assert load_from_proto(pb.LoadReport(kv_usage=usage)).kv_usage == clamped


def test_a_nodes_load_from_its_engine_and_frontend() -> None:
    stats = LoadStats(
        query_id=1,
        num_waiting=2,
        num_running=3,
        num_free_blocks=384,  # kv_usage is derived: (512 - 384) / 512 = 0.25
        num_total_blocks=512,
        queued_prompt_tokens=40,
    )
    load = node_load_from_engine(stats, max_num_seqs=8, draining=False)
    assert load == NodeLoad(2, 3, 0.25, 384, 512, 40, max_num_seqs=8)
    assert node_load_from_engine(None, 8, True) == NodeLoad(max_num_seqs=8, draining=True)
    windows = NodeStats()
    windows.ttft_ms.add(12.0)
    windows.itl_ms.add(3.0)
    full = windows.with_latencies(load)
    assert (full.ttft_p90_ms, full.itl_p50_ms, full.num_running) == (12.0, 3.0, 3)


def test_node_info_from_the_engines_handshake() -> None:
    ready = Ready(
        model="tiny-llama",
        vocab_size=1024,
        max_model_len=512,
        block_size=16,
        num_total_blocks=512,
        max_num_seqs=32,
        kv_fingerprint="fp-1",
        pid=123,
    )
    info = node_info_from_engine(ready)
    assert info == NodeInfo("tiny-llama", "fp-1", block_size=16, max_model_len=512)
    assert {f.name for f in dataclasses.fields(NodeInfo)} == {
        f.name for f in pb.NodeInfo.DESCRIPTOR.fields
    }
    wire = pb.NodeInfo.FromString(node_info_to_proto(info).SerializeToString())
    assert node_info_from_proto(wire) == info
    for missing in ("fingerprint", "block_size", "max_model_len"):
        incomplete = pb.NodeInfo()
        incomplete.CopyFrom(wire)
        incomplete.ClearField(missing)
        with pytest.raises(ValueError, match="node info must give"):
            node_info_from_proto(incomplete)


def test_roles() -> None:
    assert [role_from_proto(v) for v in (1, 2, 3)] == [Role.PREFILL, Role.DECODE, Role.COLOCATED]
    with pytest.raises(ValueError, match="unknown role"):
        role_from_proto(pb.ROLE_UNSPECIFIED)


@pytest.mark.parametrize(
    "spec",
    [
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"regex": "[a-z]+"},
        {"choice": ["x", "y z"]},
        {"grammar": 'root ::= "a"'},
        {"json_object": True},
    ],
)
def test_structured_outputs_round_trip(spec) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec))
    assert over_the_wire(params) == params


def test_structured_outputs_without_a_spec_is_refused() -> None:
    msg = pb.SamplingParams()
    msg.structured_outputs.disable_any_whitespace = True
    with pytest.raises(ValueError, match="needs one of"):
        sampling_params_from_proto(msg)
