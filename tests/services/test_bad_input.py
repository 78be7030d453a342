"""Bad requests get INVALID_ARGUMENT (or ALREADY_EXISTS) with a clear message, and each node
serves a good request right after."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import sampling_params_to_proto

from common.sampling_params import SamplingParams
from tests.services.nodes import Clients, Pair, random_prompts, run, wait_all_free

PROMPT = random_prompts([40], seed=30)[0]
OTHER_PROMPT = random_prompts([40], seed=31)[0]
GREEDY = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=4))


def params(**fields: object) -> pb.SamplingParams:
    msg = pb.SamplingParams()
    msg.CopyFrom(GREEDY)
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg


PREFILL_CASES = {
    "empty prompt": (dict(prompt_token_ids=[]), "prompt is empty"),
    "id over vocab": (dict(prompt_token_ids=[5, 1024]), "outside the vocabulary"),
    "negative id": (dict(prompt_token_ids=[5, -1]), "outside the vocabulary"),
    "max_tokens 0": (dict(sampling_params=params(max_tokens=0)), "max_tokens must be >= 1"),
    "over max_model_len": (dict(prompt_token_ids=[7] * 600), "max_model_len"),
    "seed too big": (dict(sampling_params=params(seed=2**63)), "seed"),
    "bad top_p": (dict(sampling_params=params(top_p=1.5)), "top_p"),
    "no request id": (dict(request_id=""), "request_id is required"),
}


async def expect_error(call, code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value
    assert text in info.value.details(), info.value.details()


async def good_flow(clients: Clients, request_id: str) -> None:
    flow = await clients.flow(request_id, PROMPT, GREEDY)
    assert len(flow.tokens) == 4


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_rejects(file_pair: Pair, case: str) -> None:
    fields, text = PREFILL_CASES[case]
    request = pb.PrefillRequest(request_id="bad-p", prompt_token_ids=PROMPT, sampling_params=GREEDY)
    for name, value in fields.items():
        if isinstance(value, list):
            request.ClearField(name)
            getattr(request, name).extend(value)
        elif isinstance(value, pb.SamplingParams):
            request.sampling_params.CopyFrom(value)
        else:
            setattr(request, name, value)

    async def go(clients: Clients) -> None:
        await expect_error(clients.prefill.Prefill(request), grpc.StatusCode.INVALID_ARGUMENT, text)
        await good_flow(clients, f"good-after-p-{case}")

    run(go, file_pair)


def _decode_cases(handle: pb.KVHandle, other: pb.KVHandle, first: int) -> dict[str, tuple]:
    """name → (DecodeRequest fields, expected detail text)."""

    def edited(**fields: object) -> pb.KVHandle:
        msg = pb.KVHandle()
        msg.CopyFrom(handle)
        for name, value in fields.items():
            if name == "block_hashes":
                del msg.block_hashes[:]
                msg.block_hashes.extend(value)  # type: ignore[arg-type]
            else:
                setattr(msg, name, value)
        return msg

    layout = "KV handle is for another model or layout"
    return {
        "no output tokens": (dict(output_token_ids=[]), "first token that came with"),
        "output id over vocab": (dict(output_token_ids=[first, 4096]), "outside the vocabulary"),
        "nothing to generate": (dict(sampling_params=params(max_tokens=1)), "nothing to generate"),
        "too few hashes": (
            dict(kv_handle=edited(block_hashes=handle.block_hashes[:1])),
            "malformed",
        ),
        "short hash": (dict(kv_handle=edited(block_hashes=[b"x"] * 3)), "malformed"),
        "no fingerprint": (dict(kv_handle=edited(fingerprint="")), "malformed"),
        "other model": (
            dict(kv_handle=edited(fingerprint="llama-70b-0123456789abcdef")),
            layout,
        ),
        "other block size": (
            dict(kv_handle=edited(block_size=32, block_hashes=[b"y" * 32] * 2)),
            layout,
        ),
        "other length": (dict(kv_handle=edited(num_tokens=39)), "holds 39 tokens, the prompt 40"),
        # same length, other tokens: the engine compares the hashes it computes for itself
        "other prompt": (dict(kv_handle=other), "KV handle names another prompt's KV"),
        "over max_model_len": (dict(prompt_token_ids=[7] * 600, kv_handle=None), "max_model_len"),
    }


def test_decode_rejects(file_pair: Pair) -> None:
    async def go(clients: Clients) -> None:
        first = await clients.prefill.Prefill(
            pb.PrefillRequest(request_id="h-1", prompt_token_ids=PROMPT, sampling_params=GREEDY)
        )
        other = await clients.prefill.Prefill(
            pb.PrefillRequest(
                request_id="h-2", prompt_token_ids=OTHER_PROMPT, sampling_params=GREEDY
            )
        )
        cases = _decode_cases(first.kv_handle, other.kv_handle, first.first_token_id)
        for name, (fields, text) in cases.items():
            request = pb.DecodeRequest(
                request_id=f"bad-d-{name}",
                prompt_token_ids=PROMPT,
                output_token_ids=[first.first_token_id],
                kv_handle=first.kv_handle,
                sampling_params=GREEDY,
            )
            for field, value in fields.items():
                request.ClearField(field)
                if isinstance(value, list):
                    getattr(request, field).extend(value)
                elif value is not None:
                    getattr(request, field).CopyFrom(value)
            stream = clients.decode.Decode(request)
            await expect_error(_drain(stream), grpc.StatusCode.INVALID_ARGUMENT, text)
            await good_flow(clients, f"good-after-d-{name}")
        await wait_all_free(clients)

    run(go, file_pair)


async def _drain(stream: grpc.aio.UnaryStreamCall) -> list[pb.DecodeResponse]:
    return [msg async for msg in stream]


def test_duplicate_request_id_in_flight(file_pair: Pair) -> None:
    long_params = sampling_params_to_proto(
        SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    )

    async def go(clients: Clients) -> None:
        request = pb.DecodeRequest(
            request_id="dup",
            prompt_token_ids=PROMPT,
            output_token_ids=[PROMPT[0]],
            sampling_params=long_params,
        )
        first = clients.decode.Decode(request)
        await first.read()  # in flight now
        second = clients.decode.Decode(request)
        await expect_error(_drain(second), grpc.StatusCode.ALREADY_EXISTS, "in use")
        first.cancel()
        await asyncio.sleep(0)
        await wait_all_free(clients)
        await good_flow(clients, "good-after-dup")

    run(go, file_pair)
