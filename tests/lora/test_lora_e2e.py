"""Adapters end to end: a real router and real prefill and decode nodes serving the base model
and LoRA adapters. The official ``openai`` client chooses an adapter by ``model`` and gets the
offline engine's tokens under it (disaggregated through the store); ``/v1/models`` lists the
adapters; ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change every node; an unknown
model is a 404 and a bad adapter a 400, with the cluster left healthy and every block free."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from common import LLM, SamplingParams
from tests.router.conftest import Cluster, run_cluster, wait_no_leaks
from tests.services.nodes import ENGINE_FLAGS

PROMPT = [1, *range(400, 440)]  # 41 tokens: two full blocks and a partial one
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
GREEDY = dict(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory, adapter_dirs) -> Iterator[Cluster]:
    modules = ("--lora-modules", f"alpha={adapter_dirs['alpha']}")
    yield from run_cluster(tmp_path_factory.mktemp("lora-e2e"), 1, 1, *LORA_FLAGS, *modules)


@pytest.fixture(scope="module")
def offline(adapter_dirs):
    flags = dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))
    with LLM(
        "tiny-llama", num_blocks=int(flags["--num-blocks"]),
        max_model_len=int(flags["--max-model-len"]), enable_lora=True, max_loras=2,
    ) as llm:  # fmt: skip
        yield llm


def _want(offline, adapter_dirs, name: str | None, text: bool = True) -> list[int] | str:
    lora = offline.lora(name, str(adapter_dirs[name])) if name else None
    out = offline.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False, lora_request=lora)
    return out[0].outputs[0].text if text else out[0].outputs[0].token_ids


def _api(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.router.base_url}/v1", api_key="unused", max_retries=0, timeout=180
    )


def _tokens(cluster: Cluster, model: str) -> str:
    """The completion's text (the offline engine's text of the same tokens)."""
    result = _api(cluster).completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert result.model == model
    return result.choices[0].text


def test_the_client_chooses_adapters_by_model(lora_cluster, offline, adapter_dirs):
    models = [m.id for m in _api(lora_cluster).models.list().data]
    assert models == ["tiny-llama", "alpha"]
    base, alpha = _tokens(lora_cluster, "tiny-llama"), _tokens(lora_cluster, "alpha")
    assert base == _want(offline, adapter_dirs, None)
    assert alpha == _want(offline, adapter_dirs, "alpha")
    assert alpha != base
    with pytest.raises(openai.NotFoundError, match=r"LoRA adapters \[.alpha.\]"):
        _api(lora_cluster).completions.create(model="beta", prompt=PROMPT, **GREEDY)
    wait_no_leaks(lora_cluster)


def test_grpc_generate_runs_under_the_adapter_it_names(lora_cluster, offline, adapter_dirs):
    with grpc.insecure_channel(lora_cluster.router.grpc_target) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT), model="alpha",
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=10),
        )  # fmt: skip
        tokens = [t for item in stub.Generate(request, timeout=120) for t in item.token_ids]
        assert tokens == _want(offline, adapter_dirs, "alpha", text=False)
        request.model = "nope"
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=60))
        assert refused.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


def test_load_and_unload_an_adapter_on_every_node(lora_cluster, offline, adapter_dirs, tmp_path):
    url = lora_cluster.router.base_url
    bad = httpx.post(f"{url}/v1/load_lora_adapter",
                     json={"lora_name": "broken", "lora_path": str(tmp_path)}, timeout=60)  # fmt: skip
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/load_lora_adapter",
                    json={"lora_name": "beta", "lora_path": str(adapter_dirs["beta"])}, timeout=60)  # fmt: skip
    assert ok.status_code == 200, ok.text
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [
        "tiny-llama", "alpha", "beta",
    ]  # fmt: skip
    card = httpx.get(f"{url}/v1/models/beta").json()
    assert card["parent"] == "tiny-llama"
    assert _tokens(lora_cluster, "beta") == _want(offline, adapter_dirs, "beta")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}, timeout=60)
    assert gone.status_code == 200, gone.text
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}, timeout=60)
    assert again.status_code == 404
    with pytest.raises(openai.NotFoundError):
        _api(lora_cluster).completions.create(model="beta", prompt=PROMPT, **GREEDY)
    assert _tokens(lora_cluster, "alpha") == _want(offline, adapter_dirs, "alpha")  # still well
    wait_no_leaks(lora_cluster)


def test_a_node_without_the_adapter_refuses_never_serves_base_weights(lora_cluster):
    """Straight to the decode node, past the router: an adapter it does not serve is
    INVALID_ARGUMENT, the node stays healthy and every block free."""
    node = lora_cluster.decode[0]
    with grpc.insecure_channel(node.address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        request = pb.DecodeRequest(
            request_id="direct-1", prompt_token_ids=PROMPT, lora_name="gamma",
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=4),
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Decode(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'gamma' is not served here" in refused.value.details()
        request.lora_name, request.request_id = "alpha", "direct-2"
        assert sum(len(r.token_ids) for r in stub.Decode(request, timeout=120)) == 4
    wait_no_leaks(lora_cluster)
