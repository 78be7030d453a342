"""gRPC channels from the router to prefill and decode nodes, one per address, with optional TLS.

Channels are cached by address and shared by every request to that node (HTTP/2 multiplexes
the calls). Reconnect backoff is capped low so a node restarted at the same address is reached
again within seconds. No keepalive pings: on loopback and LANs a dead peer resets the TCP
connection, and pings faster than the node's server policy would get the channel GOAWAY'd.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2_grpc
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),  # the router retries on another instance itself
]


@dataclass(frozen=True)
class NodeTLS:
    """TLS towards the nodes: ``ca`` verifies them; ``cert``+``key`` is our client identity;
    ``server_name``, when set, is the name every node's certificate is checked for (instead of
    the address it advertised)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_flags(
        cls, ca: str | None, cert: str | None, key: str | None, server_name: str | None
    ) -> NodeTLS | None:
        """The ``--node-tls-*`` flags' TLS (the router's, `up`'s watchdog's, the health probe's);
        None without a CA: nodes are reached in plaintext."""
        return cls.from_files(ca, cert, key, server_name) if ca else None

    @classmethod
    def from_files(
        cls,
        ca: str,
        cert: str | None = None,
        key: str | None = None,
        server_name: str | None = None,
    ) -> NodeTLS:
        if (cert is None) != (key is None):
            raise ValueError("--node-tls-cert and --node-tls-key go together")
        return cls(
            ca=Path(ca).read_bytes(),
            cert=Path(cert).read_bytes() if cert else None,
            key=Path(key).read_bytes() if key else None,
            server_name=server_name,
        )

    def options(self) -> list[tuple[str, object]]:
        """Channel options: the name to verify, when it is not the address."""
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


class NodeClients:
    """Stubs for nodes, by address. Owns the channels; ``close()`` them on shutdown."""

    def __init__(self, tls: NodeTLS | None = None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    @property
    def tls(self) -> NodeTLS | None:
        """How nodes are reached (None: plaintext); the local actuator's watchdog does the same."""
        return self._tls

    def channel(self, address: str) -> grpc.aio.Channel:
        """The (cached) channel to ``address`` (host:port)."""
        channel = self._channels.get(address)
        if channel is None:
            if self._tls is None:
                channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(
                    address, self._tls.credentials(), options=_CHANNEL_OPTIONS + self._tls.options()
                )
            self._channels[address] = channel
        return channel

    def prefill(self, address: str) -> pb_grpc.PrefillServiceStub:
        return pb_grpc.PrefillServiceStub(self.channel(address))

    def decode(self, address: str) -> pb_grpc.DecodeServiceStub:
        return pb_grpc.DecodeServiceStub(self.channel(address))

    def health(self, address: str) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.channel(address))

    def refused(self, address: str) -> bool:
        """Whether the node at ``address`` refuses connections now: its channel failed to
        connect (a dead process's port: the kernel refuses at once). A channel the connection
        of which was closed (idle) is asked to reconnect, so the next look knows."""
        state = self.channel(address).get_state(try_to_connect=True)
        return state is grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def addresses(self) -> list[str]:
        """The addresses with an open channel."""
        return list(self._channels)

    async def forget(self, address: str) -> None:
        """Close the channel to an address no instance uses any more."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=None)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)
