"""Adapters across prefill and decode: prefill → store → decode under the base model and two
adapters, through each store, equals colocated (and HF + PEFT); a handle never carries KV
across adapters — a forged one naming another adapter's entries is refused."""

from __future__ import annotations

import functools

import msgspec
import pytest

from common.config import EngineConfig
from common.engine import EngineCore
from common.lora.adapter import LoraRef, read_adapter
from common.models.names import resolve_model_path
from kv_transfer.connector import create_store_connector
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.kv_store.test_connector import params, run
from tests.lora.adapters import peft_model

ARGS = dict(
    model="tiny-llama", block_size=16, max_num_batched_tokens=256, num_blocks=256,
    enable_lora=True, max_loras=2, max_lora_rank=16,
)  # fmt: skip
NAMES = (None, "alpha", "beta")


def _engine(url: str | None = None, role: str | None = None) -> EngineCore:
    config = EngineConfig.from_kwargs(**ARGS, kv_store=url, kv_role=role)
    return EngineCore(config, functools.partial(create_store_connector) if url else None)


def _refs(adapter_dirs) -> dict[str | None, LoraRef | None]:
    refs: dict[str | None, LoraRef | None] = {None: None}
    refs.update((n, read_adapter(n, adapter_dirs[n], 16)[0]) for n in ("alpha", "beta"))
    return refs


def _store_url(store: str, tmp_path, redis_server_factory) -> str:
    if store == "redis":
        return f"redis://127.0.0.1:{redis_server_factory().port}/0"
    return f"{store}://{tmp_path}/kv"


@pytest.mark.parametrize(
    ("store", "greedy"),
    [("file", True), ("shm", False), ("redis", True)],
    ids=["file-greedy", "shm-seeded", "redis-greedy"],
)
def test_disaggregated_equals_colocated_under_every_adapter(
    adapter_dirs, tmp_path, redis_server_factory, store, greedy
):
    refs = _refs(adapter_dirs)
    prompt = random_prompts(1000, 1, (40, 40), seed=12)[0]  # the same prompt under all three
    jobs = [(f"{name}", prompt, refs[name]) for name in NAMES]
    colocated = _engine()
    want = run(colocated, [(r, p, params(12, greedy), None, None, lora) for r, p, lora in jobs])
    colocated.close()
    url = _store_url(store, tmp_path, redis_server_factory)
    producer = _engine(url, "producer")
    first = run(producer, [(r, p, params(1, greedy), None, None, lora) for r, p, lora in jobs])
    producer.close()
    consumer = _engine(url, "consumer")
    rest = run(consumer, [
        (r, p, params(12, greedy), first[r]["tokens"], first[r]["handle"], lora)
        for r, p, lora in jobs
    ])  # fmt: skip
    consumer.close()
    for r, _, _ in jobs:
        assert first[r]["tokens"] + rest[r]["tokens"] == want[r]["tokens"]
        assert rest[r]["loaded"] == len(prompt)  # every prompt token from the store
    assert len({tuple(want[r]["tokens"]) for r, _, _ in jobs}) == 3  # three different outputs
    handles = [first[r]["handle"] for r, _, _ in jobs]
    assert len({h.fingerprint for h in handles}) == 3
    assert len({h.block_hashes[0] for h in handles}) == 3  # three sets of store entries
    if greedy and store == "file":  # and each is HF + PEFT's
        model = resolve_model_path("tiny-llama")
        for name in NAMES:
            hf = peft_model(model, adapter_dirs[name] if name else None)
            assert want[f"{name}"]["tokens"] == hf_greedy(hf, prompt, 12)


def test_a_handle_never_carries_kv_across_adapters(adapter_dirs, tmp_path):
    refs = _refs(adapter_dirs)
    prompt = random_prompts(1000, 1, (40, 40), seed=13)[0]
    url = f"file://{tmp_path}/kv"
    producer = _engine(url, "producer")
    first = run(producer, [("a", prompt, params(1, True), None, None, refs["alpha"])])
    producer.close()
    handle, token = first["a"]["handle"], first["a"]["tokens"]
    consumer = _engine(url, "consumer")
    for lora in (refs["beta"], None):  # alpha's handle for a beta or a base-model request
        with pytest.raises(ValueError, match="another layout or adapter"):
            consumer.add_request("x", prompt, params(4, True), output_token_ids=token,
                                 kv_handle=handle, lora=lora)  # fmt: skip
    # forged: beta's fingerprint over alpha's entries — the hashes are not beta's prompt's
    forged = msgspec.structs.replace(
        handle,
        fingerprint=handle.fingerprint.replace(refs["alpha"].identity, refs["beta"].identity),
    )
    assert forged.fingerprint != handle.fingerprint
    with pytest.raises(ValueError, match="names another prompt's KV"):
        consumer.add_request("y", prompt, params(4, True), output_token_ids=token,
                             kv_handle=forged, lora=refs["beta"])  # fmt: skip
    assert not consumer.has_unfinished() and consumer.num_free_blocks() == 256
    # asked without a handle, beta finds none of alpha's entries: it recomputes
    rest = run(consumer, [("b", prompt, params(4, True), token, None, refs["beta"])])
    assert rest["b"]["loaded"] == 0
    consumer.close()
