"""A context the placer compresses is served to vLLM from its variant (issue 17.1): the daemon
writes the token-dropped variant in the servable form (keys rotated by ``M - N``, placeholder
manifest under the digest of the context's tokens) and the next routed request with the same
context is rewritten to ``[M placeholder ids] + suffix`` and loads the variant's chunks; on a
needle document the answer still holds the needle (the real model).

keydiff@0.5, not knorm@0.5: on this document knorm@0.5 drops the needle's number. Served through
this pipeline vLLM answered "The secret code of the blue vault is 512." — the answer
transformers gives for knorm@0.5 of the same context too, with the kept keys at their original
positions and rotated to 0..M-1 alike (2026-11-23): the method's loss, not the serving's.
keydiff@0.5 keeps it in both."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support.servers import get_json, post, router_stack
from kvtierd.client import KVClient
from kvtierd.kernels.placeholder import Manifest, manifest_key
from kvtierd.router_protocol import context_digest
from kvtierd.rpc import kvtier_pb2 as pb
from tests.integrations.harness import CHUNK

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

FILLER = [
    "The river wound slowly through the valley, past fields of wheat and old stone barns.",
    "In the town square a baker sold bread to early customers while pigeons waited nearby.",
    "The library kept its oldest maps in a quiet room at the end of a long corridor.",
    "A light rain fell over the harbour, and the fishing boats stayed tied to the pier.",
    "Children walked to school along the canal, counting the ducks on the water.",
    "The museum opened a new wing dedicated to clocks and instruments of navigation.",
]
NEEDLE = "The secret code of the blue vault is 58213."
QUESTION = "What is the secret code of the blue vault? Answer with the number only."
VALUE = "58213"


@pytest.fixture(scope="module")
def stack(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    # vLLM's own prefix cache off: every reuse goes through kvtierd, so its hits show
    work = tmp_path_factory.mktemp("variant")
    with router_stack(work, real_model, ("--no-enable-prefix-caching",)) as stack:
        yield stack


def chat_ids(model: Path, needle_at: int = 12, start: int = 0) -> tuple[list[int], int]:
    """The needle prompt's token ids and its context length (the document, whole chunks):
    24 filler sentences from ``FILLER[start]`` on, the needle before the ``needle_at``-th."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    sentences = [FILLER[(start + i) % len(FILLER)] for i in range(24)]
    sentences.insert(needle_at, NEEDLE)
    document = " ".join(sentences)

    def ids(content: str) -> list[int]:
        out = tok.apply_chat_template([{"role": "user", "content": content}],
                                      add_generation_prompt=True, tokenize=True)  # fmt: skip
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    full, doc = ids(f"{document}\n\n{QUESTION}"), ids(document)
    common = next(i for i, (a, b) in enumerate(zip(full, doc, strict=False)) if a != b)
    return full, common // CHUNK * CHUNK


def complete(url: str, model: str, prompt: list[int]) -> tuple[str, dict[str, str]]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    answer, headers = post(f"{url}/v1/completions", body)
    return str(answer["choices"][0]["text"]), headers


def wait_for_variant(c: KVClient, variant: str, timeout_s: float = 120) -> pb.ContextSummary:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [x for x in c.contexts() if x.variant == variant]
        if done and not c.status().pending_plans:
            return done[0]
        time.sleep(0.2)
    raise AssertionError(f"no context stored as {variant}: {list(c.contexts())}")


def test_a_context_the_placer_compresses_is_served_from_its_variant(
    stack: dict[str, Any], real_model: Path
) -> None:
    prompt, n = chat_ids(real_model)
    model = stack["model"]
    reference, _ = complete(stack["vllm"], model, prompt)  # vLLM alone, the full KV
    assert VALUE in reference, reference  # the model answers it from the whole document
    with KVClient(stack["socket"]) as c:
        c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(
            yaml="placer: fixed\nvariant: keydiff@0.5\n", source="test.yaml"))  # fmt: skip
        # Through the router: the document and a few tokens past it (less than a chunk, which
        # LMCache does not store), then the whole prompt: the daemon learns the context's
        # tokens from the router, and the two prompts agree on the document's chunks.
        for part in (prompt[: n + 3], prompt):
            _, headers = complete(stack["router"], model, part)
            assert "x-kvtierd-context" not in headers  # nothing compressed yet
        ctx = wait_for_variant(c, "keydiff@0.5")
        digest = context_digest(model, prompt[:n])
        manifest = Manifest.from_bytes(bytes(c.get(manifest_key(digest))))
        assert (manifest.num_tokens, manifest.source_context) == (n, ctx.context_id)
        assert manifest.num_kept == n // 2 and ctx.objects == n // 2 // CHUNK
        hits = c.status().hits
        answer, headers = complete(stack["router"], model, prompt)
        assert headers.get("x-kvtierd-context") == f"{digest}/keydiff@0.5"
        assert get_json(f"{stack['router']}/health")["rewrites"] == 1
        # every placeholder chunk was read from the daemon (and the manifest, by the router
        # and by the plugin)
        assert c.status().hits - hits >= len(manifest.chunk_keys)
        (after,) = [x for x in c.contexts() if x.context_id == ctx.context_id]
        assert after.hits > ctx.hits
    assert VALUE in answer, (answer, reference)
