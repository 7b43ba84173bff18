"""A snapkv variant the placer chooses is built by the daemon and served through the router
(issue 12): the daemon recomputes the window queries vLLM's paged cache does not keep from the
policy's ``profiling.model_dir`` and the context's token ids the router registered
(engine/profiling/observation_window.py), stores the variant in the servable form, and the next
routed request with the same context loads it (test_daemon_variant_served.py does the same for
keydiff@0.5).

The needle sits in the document's last window (the 64 tokens before the question), which
snapkv keeps whole whenever it keeps at least 64 tokens, so the served answer must still hold
it; the kept tokens elsewhere are those snapkv keeps in-process from the queries transformers'
prefill attended with. Its own stack (the keydiff module's fixture, one per module): that
module's policy and contexts stay apart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks._support.servers import get_json
from kvtierd.client import KVClient
from kvtierd.kernels.placeholder import Manifest, manifest_key
from kvtierd.router_protocol import context_digest
from kvtierd.rpc import kvtier_pb2 as pb
from tests.integrations import test_daemon_variant_served as keydiff_served
from tests.integrations.harness import CHUNK
from tests.integrations.test_daemon_variant_served import VALUE, chat_ids, complete
from tests.integrations.test_snapkv_served import in_process_kept

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

VARIANT = "snapkv@0.5"
stack = keydiff_served.stack  # the same module-scoped fixture: a stack of this module's own


def wait_for_manifest(c: KVClient, digest: str, timeout_s: float = 180) -> Manifest:
    """The placeholder manifest of ``digest`` once the daemon has written it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if c.lookup([manifest_key(digest)]).found[0] and not c.status().pending_plans:
            return Manifest.from_bytes(bytes(c.get(manifest_key(digest))))
        time.sleep(0.2)
    raise AssertionError(f"no variant stored for {digest}: {list(c.contexts())}")


def daemon_kept(c: KVClient, manifest: Manifest, layers: int, heads: int) -> Any:
    """The kept indices ``[L, H, M]`` the daemon wrote into its chunks' metadata."""
    import torch

    parts = []
    for key in manifest.chunk_keys:
        with c.lease(key) as (info, _):
            parts.append(np.frombuffer(info.spec.kept_indices, "<i4").reshape(layers, heads, -1))
    return torch.from_numpy(np.concatenate(parts, axis=2))


def test_a_snapkv_variant_the_daemon_builds_is_served(
    stack: dict[str, Any], real_model: Path
) -> None:
    import torch

    prompt, n = chat_ids(real_model, needle_at=23)  # one sentence after it: in the window
    model = stack["model"]
    reference, _ = complete(stack["vllm"], model, prompt)  # vLLM alone, the full KV
    assert VALUE in reference, reference
    policy = f"placer: fixed\nvariant: {VARIANT}\nprofiling:\n  model_dir: {real_model}\n"
    with KVClient(stack["socket"]) as c:
        c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml=policy, source="test.yaml"))
        for part in (prompt[: n + 3], prompt):  # two prompts agree on the document's chunks
            _, headers = complete(stack["router"], model, part)
            assert "x-kvtierd-context" not in headers  # nothing compressed yet
        digest = context_digest(model, prompt[:n])
        manifest = wait_for_manifest(c, digest)
        assert (manifest.variant, manifest.num_tokens, manifest.num_kept) == (VARIANT, n, n // 2)
        (ctx,) = [x for x in c.contexts() if x.context_id == manifest.source_context]
        assert ctx.variant == VARIANT and ctx.objects == n // 2 // CHUNK
        kept = daemon_kept(c, manifest, 30, 3)  # SmolLM2: 30 layers, 3 KV heads
        answer, headers = complete(stack["router"], model, prompt)
        assert headers.get("x-kvtierd-context") == f"{digest}/{VARIANT}"
        assert get_json(f"{stack['router']}/health")["rewrites"] == 1
    want = in_process_kept(real_model, prompt[:n], VARIANT)
    rows = zip(kept.flatten(0, 1), want.flatten(0, 1), strict=True)
    same = float(torch.stack([torch.isin(a, b.to(a.dtype)).float().mean() for a, b in rows]).mean())
    print(f"kept tokens equal to the in-process snapkv's: {same:.3f}; answer {answer!r}")
    # vLLM's bf16 KV and transformers' differ by rounding: a tie at the cut may flip
    assert same > 0.9
    assert VALUE in answer, (answer, reference)
