"""RouterService over a real gRPC port (fake nodes): Generate, registry RPCs, API key, TLS."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import (
    generate_params_from_proto,
    node_info_to_proto,
    sampling_params_from_proto,
    wire_rounded,
)

from tests.router.fakes import FINGERPRINT, INFO, fake_tokens
from tests.router.inproc import Harness, running_router


def run(test: Callable[[Harness], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        async with running_router(grpc_server=True, **kwargs) as harness:
            await test(harness)

    asyncio.run(main())


def generate_request(**params: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 300, 301]),
        sampling_params=pb.SamplingParams(temperature=0.0, **params),
    )


async def collect(stub: pb_grpc.RouterServiceStub, request: pb.GenerateRequest, **kw: Any):  # type: ignore[no-untyped-def]
    return [item async for item in stub.Generate(request, timeout=30, **kw)]


def test_generate_streams_tokens_text_and_usage() -> None:
    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            items = await collect(stub, generate_request(seed=5, max_tokens=6))
            ids = [t for item in items for t in item.token_ids]
            assert ids == fake_tokens(5, 6)
            assert "".join(i.text for i in items) == h.router.core.prompts.decode(ids)
            last = items[-1]
            assert last.finish_reason == pb.FINISH_REASON_LENGTH
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 6)
            assert len({i.request_id for i in items}) == 1
            text = pb.GenerateRequest(text="hello", stop=["zzz"], request_id="mine")
            text.sampling_params.max_tokens = 2
            items = await collect(stub, text)
            assert items[0].request_id == "mine"

    run(test)


def test_generate_errors_map_to_status_codes() -> None:
    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            cases = [
                (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
                (generate_request(top_p=5.0), grpc.StatusCode.INVALID_ARGUMENT),
                (pb.GenerateRequest(text="x", model="gpt-9"), grpc.StatusCode.NOT_FOUND),
                (generate_request(max_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT),
            ]
            for request, code in cases:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub, request)
                assert info.value.code() == code, request
            for script in h.scripts("prefill"):
                script.fail = "busy"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, generate_request(max_tokens=3))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for script in h.scripts("prefill"):
                script.fail = None
            assert len(await collect(stub, generate_request(max_tokens=3))) >= 1
            # After the first token has gone out a failure is a final FINISH_REASON_ERROR item.
            for script in h.scripts("decode"):
                script.fail = "unavailable"
            items = await collect(stub, generate_request(max_tokens=3))
            assert len(items[0].token_ids) == 1
            assert items[-1].finish_reason == pb.FINISH_REASON_ERROR
            assert "no healthy decode instance" in items[-1].error_message
            # Before it, no instance is UNAVAILABLE. (Another request: the one above has
            # failed two decode instances, a third would quarantine it; test_quarantine.py.)
            for script in h.scripts("prefill"):
                script.fail = "unavailable"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, generate_request(max_tokens=4))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    run(test)


def test_generate_requires_the_api_key() -> None:
    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            for metadata in [(), (("authorization", "Bearer nope"),)]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub, generate_request(max_tokens=2), metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", "Bearer k3y"),)
            assert await collect(stub, generate_request(max_tokens=2), metadata=good)
            # Without a --node-key, nodes present the API key (test_node_key.py)
            reply = await stub.Heartbeat(
                pb.HeartbeatRequest(instance_id="prefill-0"), metadata=good
            )
            assert reply.known

    run(test, api_key="k3y")


def test_register_heartbeat_deregister_over_grpc() -> None:
    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            request = pb.RegisterRequest(
                instance_id="new-d", role=pb.ROLE_DECODE, address="127.0.0.1:1",
                info=node_info_to_proto(INFO), load=pb.LoadReport(num_running=2),
            )  # fmt: skip
            reply = await stub.Register(request)
            assert reply.heartbeat_interval_s == h.router.registry.heartbeat_interval_s
            assert h.router.registry.get("new-d").load.num_running == 2
            beat = pb.HeartbeatRequest(instance_id="new-d", load=pb.LoadReport(num_running=5))
            assert (await stub.Heartbeat(beat)).known
            assert h.router.registry.get("new-d").load.num_running == 5
            assert (await stub.Deregister(pb.DeregisterRequest(instance_id="new-d"))).known
            assert not (await stub.Heartbeat(beat)).known
            other = node_info_to_proto(dataclasses.replace(INFO, model="other"))
            wrong = pb.RegisterRequest(
                instance_id="x", role=pb.ROLE_PREFILL, address="h:2", info=other
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Register(wrong)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            bare = pb.RegisterRequest(instance_id="y", role=pb.ROLE_PREFILL, address="h:3")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Register(bare)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fingerprint" in refused.value.details()

    run(test)


def test_a_node_of_another_kv_layout_is_refused_and_the_router_keeps_serving() -> None:
    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            foreign = dataclasses.replace(INFO, fingerprint="other-fp")
            request = pb.RegisterRequest(
                instance_id="foreign-d", role=pb.ROLE_DECODE, address="127.0.0.1:1",
                info=node_info_to_proto(foreign),
            )  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Register(request)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "'other-fp'" in refused.value.details()  # its own, named
            assert FINGERPRINT not in refused.value.details()  # never the pool's
            assert h.router.registry.get("foreign-d") is None
            assert len(h.router.registry.instances()) == 4
            items = await collect(stub, generate_request(max_tokens=3, seed=5))
            assert [t for i in items for t in i.token_ids] == fake_tokens(5, 3)

    run(test)


def test_router_and_node_read_the_same_floats() -> None:
    """A GenerateRequest's float parameters reach the node's engine bit for bit as the router
    holds them: one conversion, one rounding rule."""

    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            sampling = pb.SamplingParams(
                temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                presence_penalty=-0.3, frequency_penalty=0.123456789, max_tokens=2, seed=1,
            )  # fmt: skip
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[1, 300]), sampling_params=sampling
            )
            await collect(stub, request)
        router_params = wire_rounded(generate_params_from_proto(request))
        [sent] = [r for s in h.scripts("prefill") for r in s.requests]
        node_params = sampling_params_from_proto(sent.sampling_params)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):  # fmt: skip
            ours, theirs = getattr(router_params, name), getattr(node_params, name)
            assert struct.pack("<d", ours) == struct.pack("<d", theirs), name
        assert (node_params.temperature, node_params.frequency_penalty) == (0.7, 0.12345679)

    run(test)


# ----------------------------------------------------------------------------- TLS


def _write_pki(directory: Path) -> dict[str, Path]:
    """A CA, a server cert for 127.0.0.1 and a client cert, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(name: str, key: Any, issuer: Any, issuer_key: Any, ca: bool) -> Any:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test CA")])
    ca = cert("pdserve test CA", ca_key, ca_name, ca_key, ca=True)
    files: dict[str, Path] = {}

    def write(name: str, data: bytes) -> None:
        files[name] = directory / f"{name}.pem"
        files[name].write_bytes(data)

    write("ca", ca.public_bytes(serialization.Encoding.PEM))
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        write(
            who, cert(who, key, ca_name, ca_key, ca=False).public_bytes(serialization.Encoding.PEM)
        )
        write(f"{who}-key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ))  # fmt: skip
    return files


def test_grpc_tls_and_mutual_tls(tmp_path: Path) -> None:
    pki = _write_pki(tmp_path)

    async def test(h: Harness) -> None:
        target = f"127.0.0.1:{h.grpc_port}"
        ca = pki["ca"].read_bytes()
        with_cert = grpc.ssl_channel_credentials(
            ca, pki["client-key"].read_bytes(), pki["client"].read_bytes()
        )
        async with grpc.aio.secure_channel(target, with_cert) as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            items = await collect(stub, generate_request(seed=2, max_tokens=3))
            assert [t for i in items for t in i.token_ids] == fake_tokens(2, 3)
        no_cert = grpc.ssl_channel_credentials(ca)
        async with grpc.aio.secure_channel(target, no_cert) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(pb_grpc.RouterServiceStub(channel), generate_request(max_tokens=2))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(pb_grpc.RouterServiceStub(channel), generate_request(max_tokens=2))

    run(
        test,
        tls_cert=str(pki["server"]),
        tls_key=str(pki["server-key"]),
        tls_client_ca=str(pki["ca"]),
    )


def test_tls_towards_nodes_with_client_cert(tmp_path: Path) -> None:
    pki = _write_pki(tmp_path)
    node_tls = grpc.ssl_server_credentials(
        [(pki["server-key"].read_bytes(), pki["server"].read_bytes())],
        root_certificates=pki["ca"].read_bytes(),
        require_client_auth=True,
    )

    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            items = await collect(
                pb_grpc.RouterServiceStub(channel), generate_request(seed=4, max_tokens=4)
            )
            assert [t for i in items for t in i.token_ids] == fake_tokens(4, 4)

    run(
        test,
        node_tls=node_tls,
        node_tls_ca=str(pki["ca"]),
        node_tls_cert=str(pki["client"]),
        node_tls_key=str(pki["client-key"]),
    )


def test_cancelled_generate_aborts_upstream() -> None:
    async def test(h: Harness) -> None:
        for script in h.scripts("decode"):
            script.delay_s = 0.05
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            call = pb_grpc.RouterServiceStub(channel).Generate(generate_request(max_tokens=100))
            for _ in range(3):
                await call.read()
            call.cancel()
        decode = next(s for s in h.scripts("decode") if s.seen)
        for _ in range(500):
            if decode.cancelled and decode.aborted and h.router.core.inflight == 0:
                break
            await asyncio.sleep(0.02)
        assert decode.cancelled == decode.seen == decode.aborted
        assert h.router.core.inflight == 0

    run(test)


def test_node_registers_with_a_mutual_tls_router(tmp_path: Path) -> None:
    """A node's registration channel speaks TLS (with its own certificate) to a router whose
    gRPC port requires it; without credentials it cannot register."""
    from node_frontend.registration import RouterRegistration, tls_credentials

    pki = _write_pki(tmp_path)

    async def load() -> pb.LoadReport:
        return pb.LoadReport(num_running=1)

    def registration(instance_id: str, credentials: Any) -> RouterRegistration:
        request = pb.RegisterRequest(
            instance_id=instance_id, role=pb.ROLE_DECODE, address="127.0.0.1:1",
            info=node_info_to_proto(INFO),
        )  # fmt: skip
        return RouterRegistration(
            f"localhost:{h_port[0]}", request, load, credentials=credentials, max_retry_s=0.2
        )

    h_port: list[int] = []

    async def test(h: Harness) -> None:
        h_port.append(h.grpc_port)
        creds = tls_credentials(str(pki["ca"]), str(pki["client"]), str(pki["client-key"]))
        good, bad = registration("tls-node", creds), registration("plain-node", None)
        good.start()
        bad.start()
        for _ in range(200):
            if good.registered:
                break
            await asyncio.sleep(0.05)
        assert good.registered and h.router.registry.get("tls-node") is not None
        assert not bad.registered and h.router.registry.get("plain-node") is None
        await good.stop()
        await bad.stop()
        assert h.router.registry.get("tls-node") is None  # deregistered over TLS too

    run(
        test,
        tls_cert=str(pki["server"]),
        tls_key=str(pki["server-key"]),
        tls_client_ca=str(pki["ca"]),
    )
