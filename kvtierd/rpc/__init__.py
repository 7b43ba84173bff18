"""Generated gRPC code for proto/kvtierd/v1/kvtier.proto (regenerate with scripts/gen-proto).

The generated modules are checked in; tests/test_proto.py fails when they are stale.
"""
