"""The checked-in generated code matches proto/ (regenerated with the pinned grpcio-tools)."""

import subprocess
from pathlib import Path

import google.protobuf
import grpc

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_is_current(tmp_path):
    subprocess.run([str(REPO / "scripts" / "gen-proto"), "--out", str(tmp_path)], check=True,
                   capture_output=True)  # fmt: skip
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["kvtier_pb2.py", "kvtier_pb2.pyi", "kvtier_pb2_grpc.py", "kvtier_pb2_grpc.pyi"]
    for name in names:
        fresh = (tmp_path / name).read_text()
        checked_in = (REPO / "kvtierd" / "rpc" / name).read_text()
        assert fresh == checked_in, f"kvtierd/rpc/{name} is stale: run scripts/gen-proto"


def test_stubs_run_on_the_runtime_lmcache_pins():
    # lmcache 0.5.6 pins protobuf<7 and grpcio 1.78 (notes/vllm-cpu-lmcache.md); the test
    # environment installs exactly those, so importing the stubs here proves they load there.
    assert google.protobuf.__version__.startswith("6.33")
    assert grpc.__version__.startswith("1.78")
    from kvtierd.rpc import kvtier_pb2, kvtier_pb2_grpc

    assert set(kvtier_pb2.DESCRIPTOR.services_by_name) == {"KVStore", "Admin"}
    assert hasattr(kvtier_pb2_grpc, "KVStoreStub")


def test_hand_built_data_frames_are_valid_protobuf():
    from kvtierd.rpc import kvtier_pb2 as pb
    from kvtierd.rpc.framing import data_frame, data_of

    for size in (0, 1, 127, 128, 300_000):
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        frame = data_frame(memoryview(payload))
        assert pb.GetChunk.FromString(frame).data == payload
        assert pb.PutChunk.FromString(frame).data == payload
        view = data_of(frame)
        assert view is not None and bytes(view) == payload
    header = pb.GetChunk(info=pb.ObjectInfo(tier="cpu")).SerializeToString()
    assert data_of(header) is None
