"""Needle-in-a-haystack check of the compression kernels on a real model, as kvpress evaluates.

    .venv/bin/python -m benchmarks.quality.needle_check --model /tmp/smol/hf  # the table
    .venv/bin/python -m benchmarks.quality.needle_check --variants knorm@0.5 snapkv@0.25 --cases 6

Per case: a chat prompt whose user turn is ~``--tokens`` tokens of filler prose with one fact
(the needle) at a given depth, then a question about it. The model prefills the context (the
prompt up to the question); each layer's KV is compressed with ``kvtierd.kernels`` (kept keys
stay at their original positions, no RoPE re-rotation: kvpress's evaluation); a
``DynamicCache`` holds the kept entries; the question is prefilled with ``position_ids``
continuing from ``N`` (the mask follows the cache's ``M`` entries), then greedy decoding. A
case passes when the answer contains the needle's value.

snapkv gets the real window queries: a forward hook on each layer's ``q_proj`` keeps the last
``W`` context rows, rotated with the model's own rotary embedding at positions ``N - W ..
N - 1``; :func:`check_window_queries` holds them to the attention the model computed.

Reusable pieces: :func:`needle_cases`, :func:`prefill_context`, :func:`answer_with_variant`,
:func:`run`. Results are a list of :class:`Outcome`; :func:`table` prints accuracy per variant.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._support.common import machine
from kvtierd.kernels.api import compress_dense, dense_kv

DEFAULT_MODEL = "/tmp/smol/hf"
QUERY_TOLERANCE = 2e-2  # bf16 attention outputs against a float32 recomputation
DEFAULT_VARIANTS = tuple(
    f"{m}@{r}"
    for r in (0.5, 0.25)
    for m in (
        "knorm",
        "keydiff",
        "snapkv",
        "streamingllm",
        "paged_eviction",
        "paged_eviction_block",
    )
)
FILLER = (
    "The river town kept its old stone bridge, though the carts had long since gone.",
    "Every spring the orchard growers argued about when the frost would finally lift.",
    "A librarian catalogued maps of coastlines that no longer matched the sea.",
    "The railway timetable listed stations whose names nobody could pronounce.",
    "Bakers rose before dawn to fire ovens that had been burning for a century.",
    "In the museum, a clock without hands ticked in a glass case by the door.",
    "Fishermen mended nets on the pier while gulls circled over the harbor.",
    "The council debated the price of lamp oil for three long evenings.",
    "Children learned to count with beads strung on copper wire.",
    "A traveling painter sold portraits of horses to farmers at the market.",
    "The mountain pass closed each winter, and the village waited for the thaw.",
    "Students copied star charts by candlelight in the observatory tower.",
    "Weavers dyed wool with onion skins, walnut husks and madder root.",
    "The postmaster sorted letters into pigeonholes labeled in faded ink.",
    "An engineer sketched a windmill that could pump water uphill.",
    "Merchants weighed saffron on brass scales polished every morning.",
)
NAMES = ("amber", "cobalt", "harbor", "juniper", "lantern", "meadow", "orchid", "quartz",
         "saffron", "timber")  # fmt: skip


@dataclass(frozen=True, slots=True)
class NeedleCase:
    """One prompt: ``context`` ends where the question starts (both chat-templated text)."""

    name: str
    depth: float
    value: str
    context: str
    question: str


@dataclass(frozen=True, slots=True)
class ContextKV:
    """A prefilled context: keys/values ``[L, H, N, D]`` (RoPE applied), window queries
    ``[L, Hq, W, D]`` (RoPE applied, float32)."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    last_attention: torch.Tensor  # [L, Hq, D]: the attention output of the last context token

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])


@dataclass(frozen=True, slots=True)
class Outcome:
    case: str
    variant: str
    kept: int
    tokens: int
    answer: str
    correct: bool
    seconds: float


def needle_cases(tokenizer: Any, num_cases: int, tokens: int, seed: int = 0) -> list[NeedleCase]:
    """``num_cases`` needles at depths spread over ``[0.05, 0.95]`` in ~``tokens`` of filler."""
    rng = random.Random(seed)
    per_sentence = len(tokenizer(" ".join(FILLER))["input_ids"]) / len(FILLER)
    count = max(1, round(tokens / per_sentence))
    cases = []
    for i in range(num_cases):
        depth = 0.05 + 0.9 * i / max(num_cases - 1, 1)
        name, value = NAMES[i % len(NAMES)], str(rng.randrange(10000, 100000))
        sentences = [rng.choice(FILLER) for _ in range(count)]
        sentences.insert(round(depth * count), f"The secret code of the {name} vault is {value}.")
        question = f"What is the secret code of the {name} vault? Answer with the number only."
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": " ".join(sentences) + "\n\n" + question}],
            tokenize=False,
            add_generation_prompt=True,
        )
        cut = text.index(question)
        cases.append(NeedleCase(name, depth, value, text[:cut], text[cut:]))
    return cases


def _ids(tokenizer: Any, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


@torch.no_grad()
def prefill_context(model: Any, ids: torch.Tensor, window: int) -> ContextKV:
    """Prefill ``ids`` ``[1, N]``; keep the KV and the RoPE-applied queries of the last
    ``window`` tokens of every layer."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = model.model.layers
    rows: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(
            lambda _m, _i, out: rows.append(out[0, -window:].float())
        )
        for layer in layers
    ] + [
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda _m, args: outs.append(args[0][0, -1].float())
        )
        for layer in layers
    ]
    try:
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    n, hd = ids.shape[1], model.config.head_dim
    w = min(window, n)
    pos = torch.arange(n - w, n)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    queries = []
    for row in rows:  # [W, Hq * D] -> [Hq, W, D], rotated as the model rotates its queries
        q = row.view(w, -1, hd).transpose(0, 1)[None]
        queries.append(apply_rotary_pos_emb(q, q, cos.float(), sin.float())[0][0])
    keys = torch.cat([cache.layers[i].keys for i in range(len(layers))])
    values = torch.cat([cache.layers[i].values for i in range(len(layers))])
    last = torch.stack(outs).view(len(layers), -1, hd)
    return ContextKV(keys, values, torch.stack(queries), last)


def check_window_queries(ctx: ContextKV) -> float:
    """Largest relative error of ``softmax(q k^T / sqrt(D)) v`` for the last window query
    against the attention output the model computed for that token (every layer and query
    head): small only when the captured queries are the model's, RoPE included."""
    k, v = ctx.keys.float(), ctx.values.float()
    g = ctx.queries.shape[1] // k.shape[1]
    q = ctx.queries[:, :, -1:]  # [L, Hq, 1, D]
    logits = q @ k.repeat_interleave(g, dim=1).transpose(-1, -2) / math.sqrt(k.shape[-1])
    mine = (torch.softmax(logits, dim=-1) @ v.repeat_interleave(g, dim=1))[:, :, 0]
    return float((mine - ctx.last_attention).norm() / ctx.last_attention.norm())


@torch.no_grad()
def answer_with_variant(
    model: Any, ctx: ContextKV, variant: str, question_ids: torch.Tensor, max_new_tokens: int
) -> tuple[int, list[int]]:
    """Compress ``ctx`` into ``variant``, then prefill the question and decode greedily.
    Returns the kept count and the generated token ids."""
    from transformers import DynamicCache

    c = compress_dense(ctx.keys, ctx.values, variant, queries=ctx.queries, backend="torch")
    keys, values = dense_kv(c)
    cache = DynamicCache(config=model.config)
    for layer in range(keys.shape[0]):
        cache.update(keys[layer : layer + 1], values[layer : layer + 1], layer)
    n, eos = ctx.num_tokens, _stop_ids(model)
    step, out = question_ids, []
    pos = n
    for _ in range(max_new_tokens):
        positions = torch.arange(pos, pos + step.shape[1])[None]
        logits = model(step, past_key_values=cache, position_ids=positions, use_cache=True).logits
        pos += step.shape[1]
        token = int(logits[0, -1].argmax())
        if token in eos:
            break
        out.append(token)
        step = torch.tensor([[token]])
    return c.num_kept, out


def _stop_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def run(
    model: Any,
    tokenizer: Any,
    cases: Sequence[NeedleCase],
    variants: Sequence[str],
    *,
    window: int = 64,
    max_new_tokens: int = 16,
    question_in_context: bool = False,
) -> list[Outcome]:
    """Every variant on every case (``"none"`` is the full-KV answer through the same path).

    ``question_in_context``: compress the whole prompt but its last token, question included
    (kvpress's ``compress_questions``; snapkv's window then holds the question), instead of the
    context alone (question-agnostic, the default and what a context cache stores)."""
    results = []
    for case in cases:
        context, question = _ids(tokenizer, case.context), _ids(tokenizer, case.question)
        if question_in_context:
            prompt = torch.cat([context, question], dim=1)
            context, question = prompt[:, :-1], prompt[:, -1:]
        ctx = prefill_context(model, context, window)
        if (err := check_window_queries(ctx)) > QUERY_TOLERANCE:
            raise RuntimeError(f"captured window queries off by {err:.2e} (not the model's)")
        for variant in ("none", *variants):
            t0 = time.perf_counter()
            kept, out = answer_with_variant(model, ctx, variant, question, max_new_tokens)
            answer = tokenizer.decode(out, skip_special_tokens=True).strip()
            seconds = time.perf_counter() - t0
            right = case.value in answer
            results.append(
                Outcome(case.name, variant, kept, ctx.num_tokens, answer, right, seconds)
            )
    return results


def table(results: Sequence[Outcome]) -> str:
    """Markdown: correct answers per variant, in the order first seen."""
    by: dict[str, list[Outcome]] = {}
    for r in results:
        by.setdefault(r.variant, []).append(r)
    lines = ["| variant | correct | kept / tokens (mean) | s per case |", "|---|---|---|---|"]
    for v, rs in by.items():
        kept = sum(r.kept for r in rs) / len(rs)
        toks = sum(r.tokens for r in rs) / len(rs)
        secs = sum(r.seconds for r in rs) / len(rs)
        right = sum(r.correct for r in rs)
        lines.append(f"| `{v}` | {right} / {len(rs)} | {kept:.0f} / {toks:.0f} | {secs:.2f} |")
    return "\n".join(lines)


def load_model(path: str, dtype: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face checkpoint directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1000, help="approximate context length")
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    ap.add_argument("--window", type=int, default=64, help="window queries captured for snapkv")
    ap.add_argument(
        "--question-in-context",
        action="store_true",
        help="compress the question with the context (default: the context alone)",
    )
    ap.add_argument("--json", default="", help="also write every outcome to this file")
    a = ap.parse_args()
    if not Path(a.model, "config.json").is_file():
        raise SystemExit(f"--model {a.model}: no config.json there (a Hugging Face checkpoint)")
    torch.manual_seed(0)
    model, tokenizer = load_model(a.model, a.dtype)
    cases = needle_cases(tokenizer, a.cases, a.tokens)
    t0 = time.perf_counter()
    results = run(
        model, tokenizer, cases, a.variants, window=a.window,
        question_in_context=a.question_in_context,
    )  # fmt: skip
    mode = "question in the compressed context" if a.question_in_context else "question after"
    print(f"needle check: {a.model} ({a.dtype}, {mode}), {len(cases)} cases of ~{a.tokens} tokens, "
          f"{time.perf_counter() - t0:.0f} s on {machine()}")  # fmt: skip
    print(table(results))
    for r in results:
        if not r.correct and r.variant == "none":
            print(f"full KV missed {r.case}: {r.answer!r}")
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
