"""The wire contract: generated modules are fresh against proto/pdserve.proto, messages round-trip.

Staleness is checked two ways: semantically (the descriptor embedded in ``pdserve_pb2`` equals
what protoc compiles from the .proto today, whatever the grpcio-tools version) and, when the
installed grpcio-tools is the one that generated the committed files, byte for byte.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from google.protobuf import descriptor_pb2

PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"

try:  # installed (pip install -e .)
    from pdserve_proto import pdserve_pb2 as pb
    from pdserve_proto import pdserve_pb2_grpc as pb_grpc
except ImportError:  # plain checkout: the package lives in proto/
    sys.path.insert(0, str(PROTO_DIR))
    from pdserve_proto import pdserve_pb2 as pb
    from pdserve_proto import pdserve_pb2_grpc as pb_grpc


def _load_generate() -> ModuleType:
    """Import proto/generate.py under a distinct name (``generate`` alone is too generic)."""
    spec = importlib.util.spec_from_file_location(
        "pdserve_proto_generate", PROTO_DIR / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _strip_json_names(messages) -> None:  # type: ignore[no-untyped-def]
    """protoc's descriptor sets carry json_name; the copy embedded in generated code does not."""
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _strip_json_names(message.nested_type)


def _roundtrip(msg):  # type: ignore[no-untyped-def]
    data = msg.SerializeToString()
    back = type(msg).FromString(data)
    assert back == msg
    return back


# --------------------------------------------------------------------------- staleness


def test_generated_descriptor_matches_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    generate = _load_generate()
    fresh_set = descriptor_pb2.FileDescriptorSet.FromString(
        generate.descriptor_set(tmp_path / "pdserve.desc")
    )
    (fresh,) = fresh_set.file
    _strip_json_names(fresh.message_type)
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "pdserve_pb2 is stale: run `python proto/generate.py`"


def test_grpc_module_covers_every_rpc() -> None:
    channel = grpc.insecure_channel("127.0.0.1:1")  # lazy: never connects
    try:
        for name, service in pb.DESCRIPTOR.services_by_name.items():
            stub = getattr(pb_grpc, f"{name}Stub")(channel)
            servicer = getattr(pb_grpc, f"{name}Servicer")
            assert hasattr(pb_grpc, f"add_{name}Servicer_to_server")
            for method in service.methods:
                assert hasattr(stub, method.name), f"{name}.{method.name} missing from the stub"
                assert hasattr(servicer, method.name), f"{name}.{method.name} missing"
    finally:
        channel.close()


def test_generated_files_match_byte_for_byte() -> None:
    tools = pytest.importorskip("grpc_tools")
    from importlib.metadata import version

    if version("grpcio-tools") != pb_grpc.GRPC_GENERATED_VERSION:
        pytest.skip(f"committed files come from grpcio-tools {pb_grpc.GRPC_GENERATED_VERSION}")
    assert tools is not None
    diffs = _load_generate().check()
    assert not diffs, "generated modules are stale:\n" + "\n".join(diffs)


def test_grpc_module_imports_relatively() -> None:
    # A top-level `import pdserve_pb2` would only work with proto/pdserve_proto on sys.path.
    source = Path(pb_grpc.__file__).read_text()
    assert "from . import pdserve_pb2" in source
    assert "\nimport pdserve_pb2" not in source


# --------------------------------------------------------------------------- messages


def _sampling() -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=0.0,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=2**63 - 1,
        max_tokens=128,
        min_tokens=4,
        stop_token_ids=[2, 7],
        ignore_eos=True,
        logprobs=5,
    )


def _handle() -> pb.KVHandle:
    hashes = [bytes([i]) * 32 for i in range(3)]
    return pb.KVHandle(
        fingerprint="tiny-llama:bf16:16:2:4:64",
        block_size=16,
        num_tokens=40,
        block_hashes=hashes,
        store_url="file:///dev/shm/pdserve",
    )


def test_sampling_params_presence() -> None:
    empty = pb.SamplingParams()
    for field in ("temperature", "top_p", "repetition_penalty", "seed", "max_tokens", "logprobs"):
        assert not empty.HasField(field), field
    back = _roundtrip(_sampling())
    # Greedy (0.0) and logprobs=0 must survive as "set", not collapse into "absent".
    assert back.HasField("temperature") and back.temperature == 0.0
    assert _roundtrip(pb.SamplingParams(logprobs=0)).HasField("logprobs")
    assert back.seed == 2**63 - 1


def test_kv_handle_roundtrip() -> None:
    back = _roundtrip(_handle())
    assert [len(h) for h in back.block_hashes] == [32, 32, 32]
    assert back.HasField("store_url")
    assert not pb.KVHandle().HasField("store_url")


def test_prefill_roundtrip() -> None:
    req = pb.PrefillRequest(
        request_id="r1", prompt_token_ids=[1, 5, 9], sampling_params=_sampling(), priority=-1
    )
    assert _roundtrip(req).priority == -1
    resp = pb.PrefillResponse(
        request_id="r1",
        first_token_id=42,
        first_logprob=pb.TokenLogprob(
            token_id=42, logprob=-0.25, top_token_ids=[42, 3], top_logprobs=[-0.25, -1.5]
        ),
        kv_handle=_handle(),
        finish_reason=pb.FINISH_REASON_HANDED_OFF,
        timing=pb.PrefillTiming(queue_ms=1.5, compute_ms=20.0, save_ms=3.25),
        num_cached_tokens=16,
    )
    back = _roundtrip(resp)
    assert back.timing.compute_ms == 20.0 and not back.HasField("stop_token_id")


def test_decode_roundtrip() -> None:
    req = pb.DecodeRequest(
        request_id="r1",
        prompt_token_ids=[1, 5, 9],
        output_token_ids=[42],
        kv_handle=_handle(),
        sampling_params=_sampling(),
    )
    assert _roundtrip(req).output_token_ids == [42]
    assert not pb.DecodeRequest(request_id="x").HasField("kv_handle")
    first = pb.DecodeResponse(
        token_ids=[7, 8],
        kv_load=pb.KVLoadStats(num_loaded_tokens=32, num_recomputed_tokens=8, load_ms=0.75),
    )
    last = pb.DecodeResponse(
        token_ids=[2],
        finish_reason=pb.FINISH_REASON_STOP,
        stop_token_id=2,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=4),
    )
    assert _roundtrip(first).kv_load.num_recomputed_tokens == 8
    assert _roundtrip(last).finish_reason == pb.FINISH_REASON_STOP


def test_load_and_registry_roundtrip() -> None:
    load = pb.LoadReport(
        role=pb.ROLE_DECODE,
        num_waiting=3,
        num_running=17,
        kv_usage=0.5,
        num_free_blocks=100,
        num_total_blocks=200,
        queued_prompt_tokens=4096,
        itl_p50_ms=12.5,
        itl_p90_ms=20.0,
        decode_tokens_per_s=1234.5,
        draining=True,
    )
    info = pb.NodeInfo(model="tiny-llama", fingerprint="fp", block_size=16, max_model_len=512)
    reg = pb.RegisterRequest(
        instance_id="decode-0",
        role=pb.ROLE_DECODE,
        address="127.0.0.1:50071",
        load=load,
        info=info,
    )
    assert _roundtrip(reg).load == load
    assert _roundtrip(reg).info == info
    assert _roundtrip(pb.HeartbeatRequest(instance_id="decode-0", load=load)).load.draining
    assert _roundtrip(pb.RegisterResponse(heartbeat_interval_s=2.0)).heartbeat_interval_s == 2.0
    assert not _roundtrip(pb.HeartbeatResponse(known=False)).known


def test_generate_roundtrip_and_oneofs() -> None:
    by_text = pb.GenerateRequest(text="hello", sampling_params=_sampling(), stop=["\n\n"])
    by_ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), echo=True)
    assert _roundtrip(by_text).WhichOneof("prompt") == "text"
    assert _roundtrip(by_ids).WhichOneof("prompt") == "token_ids"
    assert not by_ids.HasField("request_id") and not by_ids.HasField("skip_special_tokens")
    resp = pb.GenerateResponse(
        request_id="r1",
        token_ids=[5],
        text=" world",
        finish_reason=pb.FINISH_REASON_STOP,
        stop_string="\n\n",
        usage=pb.Usage(prompt_tokens=1, completion_tokens=1),
    )
    assert _roundtrip(resp).WhichOneof("stop_reason") == "stop_string"


def test_enum_names_are_stable() -> None:
    # Routers and nodes log and compare these by name; renames break dashboards.
    assert pb.FinishReason.Name(pb.FINISH_REASON_LENGTH) == "FINISH_REASON_LENGTH"
    assert pb.FinishReason.Name(pb.FINISH_REASON_HANDED_OFF) == "FINISH_REASON_HANDED_OFF"
    assert [pb.Role.Name(v) for v in pb.Role.values()] == [
        "ROLE_UNSPECIFIED",
        "ROLE_PREFILL",
        "ROLE_DECODE",
        "ROLE_COLOCATED",
    ]
