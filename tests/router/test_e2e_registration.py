"""Registration end to end (real router, real node processes): the router learns the layout
(block size, max_model_len) from the nodes that register, static instances included, and
refuses a node whose KV fingerprint differs from the pool's while it goes on serving."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from tests.router.conftest import API_KEY, Cluster, RouterProcess, wait_no_leaks
from tests.services.nodes import ENGINE_FLAGS, NodeProcess

NODE_MAX_MODEL_LEN = int(dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))["--max-model-len"])


def node_info(address: str, kind: str) -> pb.NodeInfo:
    async def ask() -> pb.NodeInfo:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.PrefillServiceStub if kind == "prefill" else pb_grpc.DecodeServiceStub
            return await stub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)

    return asyncio.run(ask())


def test_the_router_learns_max_model_len_from_its_nodes(
    cluster: Cluster, keyed_router: RouterProcess
) -> None:
    """Neither router is given --max-model-len: one learns it from registrations, the other
    (static instances) from GetInfo."""
    for router, headers in (
        (cluster.router, {}),
        (keyed_router, {"Authorization": f"Bearer {API_KEY}"}),
    ):
        with httpx.Client(base_url=router.base_url, headers=headers, timeout=60) as http:
            card = http.get("/v1/models").json()["data"][0]
            assert card["max_model_len"] == NODE_MAX_MODEL_LEN
            too_long = {"prompt": [5] * NODE_MAX_MODEL_LEN, "max_tokens": 1}
            response = http.post("/v1/completions", json=too_long)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert f"(max_model_len) is {NODE_MAX_MODEL_LEN} tokens" in error["message"]


def test_a_node_with_another_kv_layout_is_refused(cluster: Cluster) -> None:
    """A decode node with another block size (so another fingerprint) asks to join: the router
    refuses it, naming the node's fingerprint (never the pool's: the router's log has both), and
    keeps serving with the nodes it has."""
    pool = node_info(cluster.decode[0].address, "decode")
    foreign = NodeProcess(
        "decode", cluster.store_url, cluster.workdir,
        "--router", cluster.router.grpc_target, "--block-size", "32",
    ).wait_ready()  # fmt: skip
    try:
        theirs = node_info(foreign.address, "decode")
        assert theirs.fingerprint != pool.fingerprint and theirs.block_size == 32
        deadline = time.monotonic() + 60
        while "refused this node" not in foreign.log_tail(200):
            assert time.monotonic() < deadline, foreign.log_tail()
            time.sleep(0.2)
        refusal = next(
            line for line in foreign.log_tail(200).splitlines() if "refused this node" in line
        )
        assert repr(theirs.fingerprint) in refusal and pool.fingerprint not in refusal
        logged = cluster.router.log_tail(400)
        assert repr(theirs.fingerprint) in logged and repr(pool.fingerprint) in logged
        cluster.wait_instances(2, 2)  # not added; the others still serve
        with httpx.Client(base_url=cluster.router.base_url, timeout=120) as http:
            health = http.get("/health").json()
            assert health["ready"]
            body = {"prompt": [1, 300, 301], "max_tokens": 3, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        foreign.stop()
    wait_no_leaks(cluster)
