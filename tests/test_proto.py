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
        assert pb.GetPart.FromString(frame).data == payload
        assert pb.PutPart.FromString(frame).data == payload
        view = data_of(frame)
        assert view is not None and bytes(view) == payload
    header = pb.GetPart(info=pb.ObjectInfo(tier="cpu")).SerializeToString()
    assert data_of(header) is None


def test_stream_parts_keep_the_wire_form_they_had_as_chunks():
    """``PutPart`` / ``GetPart`` / ``part_bytes`` were ``PutChunk`` / ``GetChunk`` /
    ``chunk_bytes`` before issue 17. Names are not on the wire, so peers built from either
    .proto still talk: each message below serializes to the bytes the old names produced
    (recorded from the generated code at ef2e7de), and the method paths are the same."""
    from kvtierd.rpc import kvtier_pb2 as pb

    spec = pb.ObjectSpec(key="k", size_bytes=8)
    assert pb.GetStreamRequest(key="k", part_bytes=65536).SerializeToString().hex() == (
        "0a016b10808004"
    )
    assert pb.PutPart(spec=spec, durable=True).SerializeToString().hex() == "0a050a016b20081801"
    assert pb.PutPart(data=b"ab").SerializeToString().hex() == "12026162"
    assert pb.GetPart(info=pb.ObjectInfo(tier="cpu")).SerializeToString().hex() == "0a051203637075"
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    put, get = service.methods_by_name["PutStream"], service.methods_by_name["GetStream"]
    assert (put.full_name, put.input_type.name) == ("kvtierd.v1.KVStore.PutStream", "PutPart")
    assert (get.full_name, get.output_type.name) == ("kvtierd.v1.KVStore.GetStream", "GetPart")


def test_the_deprecated_plan_messages_are_advises_field_for_field():
    """``KVStore.Plan`` (Advise's name before issue 17) stays in v1 for one release, answered
    by Advise's handler, which reads Plan's bytes as Advise's messages and back: that is
    lossless only while every pair has the same field numbers, types and labels."""
    from kvtierd.rpc import kvtier_pb2 as pb

    def fields(message):
        return [
            (f.number, f.type, f.is_repeated, f.message_type.name if f.message_type else "")
            for f in message.DESCRIPTOR.fields
        ]

    pairs = [(pb.PlanQuery, pb.AdviseQuery), (pb.PlanRequest, pb.AdviseRequest),
             (pb.ContextPlan, pb.WriteAdvice), (pb.PlanResponse, pb.AdviseResponse)]  # fmt: skip
    renamed = {"PlanQuery": "AdviseQuery", "ContextPlan": "WriteAdvice"}
    for old, new in pairs:
        assert [(*f[:3], renamed.get(f[3], f[3])) for f in fields(old)] == fields(new)
        assert old.DESCRIPTOR.GetOptions().deprecated and not new.DESCRIPTOR.GetOptions().deprecated
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    plan, advise = service.methods_by_name["Plan"], service.methods_by_name["Advise"]
    assert (plan.input_type.name, plan.output_type.name) == ("PlanRequest", "PlanResponse")
    assert (advise.input_type.name, advise.output_type.name) == ("AdviseRequest", "AdviseResponse")
    assert plan.GetOptions().deprecated and not advise.GetOptions().deprecated
