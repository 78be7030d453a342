"""A store entry that would block forever (issue 26, item 5), on the session cluster's real nodes:
the entry files of a prompt the prefill node saved are replaced by FIFOs — a stalled shared
filesystem, as the fault campaign stood it in — and a decode node that never saw the prompt is
handed their KV handle. Opening a FIFO waits for a writer; the node used to wedge its engine
there. Now each is a miss: the prompt is recomputed, the tokens are the offline engine's, the
FIFOs are gone (removed like damaged entries), and the node stays healthy and routable.
"""

from __future__ import annotations

import asyncio
import os
import random
import stat
import time
from pathlib import Path

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import sampling_params_to_proto

from common.sampling_params import SamplingParams
from kv_store.entry import make_key
from kv_store.file_store import FileStore, default_root
from kv_store.url import file_base
from tests.router.conftest import Cluster, expected, node_load, wait_no_leaks

PROGRESS_TIMEOUT_S = 10.0  # the router's default --progress-timeout (the session router's)


def entry_paths(store_url: str, handle: pb.KVHandle) -> list[Path]:
    """The files of the entries a KV handle names (full blocks, then a final partial one)."""
    root = default_root(handle.fingerprint, file_base(store_url))
    paths = []
    for i, block_hash in enumerate(handle.block_hashes):
        tokens = min(handle.block_size, handle.num_tokens - i * handle.block_size)
        partial = None if tokens == handle.block_size else tokens
        name = FileStore.entry_name(make_key(handle.fingerprint, block_hash, partial))
        paths.append(root / name[:2] / name[2:])
    return paths


async def prefill_then_fifos_then_decode(
    cluster: Cluster, prompt: list[int], params: SamplingParams
) -> tuple[list[int], pb.DecodeResponse, list[Path], float]:
    """Prefill on one node; the entries its handle names replaced by FIFOs; Decode on a decode
    node with that handle. The tokens, the first decode item, the FIFO paths, Decode's time."""
    wire = sampling_params_to_proto(params)
    prefill_node, decode_node = cluster.alive()[0], cluster.decode[0]
    async with grpc.aio.insecure_channel(prefill_node.address) as channel:
        request = pb.PrefillRequest(
            request_id="fifo-p", prompt_token_ids=prompt, sampling_params=wire
        )
        first = await pb_grpc.PrefillServiceStub(channel).Prefill(request, timeout=120)
    assert first.finish_reason == pb.FINISH_REASON_HANDED_OFF
    paths = entry_paths(cluster.store_url, first.kv_handle)
    for path in paths:
        assert path.is_file(), f"the prefill node saved no entry at {path}"
        path.unlink()
        os.mkfifo(path)
    decode = pb.DecodeRequest(request_id="fifo-d", prompt_token_ids=prompt,
                              output_token_ids=[first.first_token_id], kv_handle=first.kv_handle,
                              sampling_params=wire)  # fmt: skip
    start = time.monotonic()
    async with grpc.aio.insecure_channel(decode_node.address) as channel:
        items = [m async for m in pb_grpc.DecodeServiceStub(channel).Decode(decode, timeout=60)]
    took = time.monotonic() - start
    tokens = [first.first_token_id] + [t for item in items for t in item.token_ids]
    return tokens, items[0], paths, took


def test_a_fifo_entry_costs_a_recompute_not_a_wedged_engine(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(26)
    prompt = [1] + [rng.randrange(4, 1000) for _ in range(40)]  # 2 full blocks + a partial one
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    steps_before = node_load(cluster.decode[0]).engine_steps
    tokens, first_item, fifos, took = asyncio.run(
        prefill_then_fifos_then_decode(cluster, prompt, params)
    )
    print(f"Decode over {len(fifos)} FIFO entries: {took:.2f} s")  # docs/DEPLOYMENT.md's row
    assert tokens == expected(offline, [prompt], [params])[0][0].token_ids
    assert first_item.kv_load.num_loaded_tokens == 0  # every FIFO missed: recomputed
    assert first_item.kv_load.num_recomputed_tokens == len(prompt)
    assert took < PROGRESS_TIMEOUT_S, f"Decode took {took:.1f} s"
    for path in fifos:  # removed as damage, or rewritten since by a save: never a FIFO again
        assert not path.exists() or stat.S_ISREG(path.stat().st_mode), path
    load = node_load(cluster.decode[0])
    assert load.engine_steps > steps_before and load.num_requests == 0
    cluster.wait_instances(prefill=len(cluster.prefill), decode=len(cluster.decode))
    wait_no_leaks(cluster)
