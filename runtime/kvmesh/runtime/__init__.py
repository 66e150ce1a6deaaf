"""The foundation every kvmesh component uses and that uses none of them.

errors (and their gRPC status mapping in grpcutil), config dataclasses -> flags, gRPC plumbing,
clock, W3C trace context, discovery (file registry, etcd), model directories, process plumbing,
and the shared domain types (types: requests, outputs, options, model and load info; kv_events:
KV cache events and the event log; wire: both to and from protobuf).
"""

__version__ = "0.1.0"
