"""pdserve's wire contract: protobuf messages and gRPC stubs generated from ``proto/pdserve.proto``.

Import the generated modules explicitly::

    from pdserve_proto import pdserve_pb2, pdserve_pb2_grpc

Do not edit ``pdserve_pb2*.py*`` by hand: change the .proto and run ``python proto/generate.py``.
Only the node and router edges import this package; ``common/`` never does.
"""
