"""The gRPC frontend that prefill and decode nodes share.

A node is two processes: this frontend (grpc.aio on uvloop) and an engine-core process
(``common.core_process``) reached through ``common.core_client.CoreClient`` over ZeroMQ. This
package is the only node code that imports the generated wire contract (``pdserve_proto``): it
converts messages to ``common`` dataclasses at the edge (``convert``), parses flags and
``PDSERVE_*`` overrides (``options``), keeps latency/throughput windows (``stats``), admits and
drains requests and answers ``Abort`` / ``GetLoad`` (``runtime``), registers with a router
(``registration``) and runs the server (``server.serve``). ``prefill_node`` and ``decode_node``
add only their own RPC.
"""
