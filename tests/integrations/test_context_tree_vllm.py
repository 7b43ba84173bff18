"""Contexts that share a prefix through real vLLM + LMCache (issue 29).

Three requests with the same system prompt (three chunks) and three different documents after
it (two chunks each) make one system-prompt context and three children, each with only its
own chunks, each placed on its own; dropping one child leaves its siblings and the prefix
cached, and the next request for it makes it a child again. With vLLM's prefix cache off, as
in the issue's run (every reuse goes through kvtierd), and on (``kvtierd stack``'s default:
LMCache still looks the whole prompt up, so the plugin still learns where a put starts).
One more child stored int8 on its own (a request's ``lmcache.tag.kvtierd_variant``) is served
after its whole parent with the full KV's answer, and is still refused token dropping.
float32: the KV path this CPU serves (cpu_dtype.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks._support.servers import post, router_stack
from benchmarks._support.tiny_vllm_model import words
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc
from tests.integrations.harness import CHUNK, INT8_TOLERANCE

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = [70 + (13 * i) % 900 for i in range(3 * CHUNK)]
DOCS = [[100 + d * 200 + (7 * i) % 150 for i in range(2 * CHUNK)] for d in range(3)]
QUESTION = [500, 501, 502]  # shorter than a chunk: never stored


@pytest.fixture(scope="module", params=["no-prefix-cache", "prefix-cache"])
def stack(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    args = ("--no-enable-prefix-caching",) if request.param == "no-prefix-cache" else ()
    with router_stack(tmp_path_factory.mktemp("tree"), tiny_model, args, "float32") as s:
        yield {**s, "prefix_cache": not args}


def ask(stack: dict[str, Any], doc: list[int]) -> str:
    return str(complete(stack, doc)["text"])


def complete(stack: dict[str, Any], doc: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": stack["model"], "prompt": words(SYSTEM + doc + QUESTION), "max_tokens": 4,
            "temperature": 0.0, **extra}  # fmt: skip
    answer, _ = post(f"{stack['vllm']}/v1/completions", body)
    return dict(answer["choices"][0])


def tree(stack: dict[str, Any]) -> dict[str, tuple[str, int, str]]:
    """context -> (parent, objects, tier) of the model's contexts."""
    with KVClient(stack["socket"]) as c:
        return {
            x.context_id: (x.parent_context_id, x.objects, x.tier)
            for x in c.contexts()
            if x.context_id.startswith(stack["model"])
        }


def test_one_system_prompt_and_three_documents_make_a_tree(stack: dict[str, Any]) -> None:
    first = [ask(stack, doc) for doc in DOCS]
    contexts = tree(stack)
    roots = [cid for cid, (parent, _, _) in contexts.items() if not parent]
    assert len(roots) == 1, contexts
    (root,) = roots
    assert contexts[root][1] == 3  # the system prompt's chunks only
    children = {cid: v for cid, v in contexts.items() if v[0] == root}
    assert sorted(v[1] for v in children.values()) == [2, 2, 2], contexts
    assert len(contexts) == 4 and all(v[2] for v in contexts.values())  # each placed

    # Dropped on its own: the others stay, and the same answers come from the cache.
    dropped = sorted(children)[0]
    with KVClient(stack["socket"]) as c:
        assert c.evict([dropped]) == 1
        hits_before = {x.context_id: x.hits for x in c.contexts()}
    after = tree(stack)
    assert dropped not in after and len(after) == 3 and after[root][1] == 3
    again = [ask(stack, doc) for doc in DOCS]
    assert again == first
    with KVClient(stack["socket"]) as c:
        hits = {x.context_id: x.hits for x in c.contexts()}
    assert hits[root] > hits_before[root]  # every request loaded the shared prefix
    assert all(hits[cid] > hits_before[cid] for cid in children if cid != dropped)
    final = tree(stack)  # the dropped document was recomputed: a child of the prefix again
    assert sorted(v[1] for cid, v in final.items() if v[0] == root) == [2, 2, 2], final
    log = Path(stack["vllm_log"]).read_text(errors="replace")
    assert "put failed" not in log and "Traceback" not in log


DOC_INT8 = [700 + (11 * i) % 150 for i in range(2 * CHUNK)]  # a fourth document


def test_one_child_stored_int8_is_served_after_its_whole_parent(stack: dict[str, Any]) -> None:
    """Quantization per segment: the new child is stored int8 while the system prompt and
    the other documents stay whole; the next request loads the whole prefix and the int8
    child, and answers as the full KV did (its first token, its logprobs within int8's
    rounding). Token dropping stays refused for it, with the reason."""
    if stack["prefix_cache"]:
        pytest.skip("vLLM's own prefix cache would answer the second request from its blocks")
    int8 = {"lmcache.tag.kvtierd_variant": "int8"}
    # the full KV's answer: vLLM computes the document (and loads the whole prefix); its
    # chunks are stored int8
    full = complete(stack, DOC_INT8, logprobs=5, kv_transfer_params=int8)
    with KVClient(stack["socket"]) as c:
        ours = {x.context_id: x for x in c.contexts() if x.context_id.startswith(stack["model"])}
    (root,) = [cid for cid, x in ours.items() if not x.parent_context_id]
    quantized = [x for x in ours.values() if x.variant == "int8"]
    assert len(quantized) == 1, ours
    (child,) = quantized
    assert (child.parent_context_id, child.objects) == (root, 2)
    assert all(x.variant == "none" for x in ours.values() if x is not child), ours
    served = complete(stack, DOC_INT8, logprobs=5)
    with KVClient(stack["socket"]) as c:
        after = {x.context_id: x for x in c.contexts()}
    admin = pb_grpc.AdminStub(grpc.insecure_channel(f"unix:{stack['socket']}"))
    shown = admin.DescribeContext(pb.DescribeContextRequest(context_id=child.context_id))
    assert after[child.context_id].variant == "int8"
    assert after[child.context_id].hits > child.hits and after[root].hits > ours[root].hits
    a, b = full["logprobs"]["top_logprobs"][0], served["logprobs"]["top_logprobs"][0]
    diffs = [abs(a[t] - b[t]) for t in a if t in b]
    assert served["logprobs"]["tokens"][0] == full["logprobs"]["tokens"][0]
    assert len(diffs) >= 3 and max(diffs) < INT8_TOLERANCE, diffs
    assert a != b  # the int8 chunks were loaded, not the float32 KV recomputed
    assert "continues context" in shown.summary.token_drop_refused
