"""The gRPC frontend that prefill and decode nodes share.

A node is two processes: this frontend (grpc.aio on uvloop) and an engine-core process
(``common.core_process``) reached through ``common.core_client.CoreClient`` over ZeroMQ. Wire
messages are converted by the one conversion layer the router shares (``pdserve_proto.convert``).
This package parses flags and ``PDSERVE_*`` overrides (``options``), keeps latency/throughput
windows (``stats``), admits and drains requests and answers ``Abort`` / ``GetLoad`` /
``GetInfo`` (``runtime``), registers with a router, reporting the node's layout
(``registration``), and runs the server (``server.serve``). ``prefill_node`` and
``decode_node`` add only their own RPC.
"""
