"""Issue 27.8: a policy applied at run time names as profiling.model_dir only a directory the
daemon's config allows (model_dirs; its own policy_file's is always allowed), that no other
user can write; what is loaded from it is safetensors only, never a pickle, never the
checkpoint's own code; a load that fails is a profile's clear error, not INTERNAL, and
profiling goes on. Over the Unix socket and over TCP (an admin tenant's token)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from benchmarks._support.daemon_proc import tcp_listener
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb

L, H, D, T = 2, 2, 32, 16


def _policy(model_dir: Path | str, evaluator: str = "answer") -> str:
    return (
        "name: p\nplacer: evicpress\nvariants:\n  methods: [int8]\n  ratios: [1.0]\n"
        f"profiling:\n  evaluator: {evaluator}\n  model_dir: {model_dir}\n"
    )


class _Opens:
    """Unpickled, it creates ``path``: the proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _checkpoints(root: Path, marker: Path) -> dict[str, Path]:
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    pickled = root / "pickled"
    pickled.mkdir(parents=True)
    (pickled / "config.json").write_text(json.dumps(config))
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(_Opens(marker)))
    remote = root / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.M"}}))
    (remote / "model.safetensors").write_bytes(b"")
    (remote / "x.py").write_text(f"open({str(marker)!r}, 'w')\n")
    return {"pickled": pickled, "remote": remote}


def test_model_dir_is_limited_to_the_daemons_allow_list(start_daemon, tmp_path):
    models = tmp_path / "models"
    marker = tmp_path / "code-ran"
    dirs = _checkpoints(models, marker)
    others = tmp_path / "others"
    others.mkdir()
    others.chmod(0o777)
    tcp = tcp_listener(tmp_path, "admin-token")
    d = start_daemon(model_dirs=[str(models), str(others)], **tcp.settings)
    with (
        KVClient(d.socket_path, timeout_s=60) as local,
        KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="admin-token",
                 timeout_s=60) as remote,
    ):  # fmt: skip
        for c in (local, remote):
            for bad in ("/etc", str(tmp_path), str(others)):
                with pytest.raises(errors.PermissionDeniedError, match="model_dir"):
                    c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml=_policy(bad)))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        local.put("k", x.view(torch.uint8).numpy().tobytes(), context_id="doc",
                  layout=f"KV_2LTD;2x{L}x{T}x{H * D};bfloat16;h={H}", token_count=T)  # fmt: skip
        local.call(local.kv.AddQueries, pb.AddQueriesRequest(context_id="doc", texts=["why?"]))
        for name, why in (("pickled", "safetensors"), ("remote", "auto_map")):
            local.call(local.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml=_policy(dirs[name])))
            reply = local.call(local.admin.Profile, pb.ProfileRequest(context_ids=["doc"]))
            assert reply.failed == 1 and why in reply.errors[0], reply.errors
            assert not marker.exists()
        assert local.status().health == "SERVING"
