"""``answer``: the paper's quality metric (EvicPress §4.2, §6.1).

For each profiling query, greedy-decode an answer from the full KV and from every variant's KV
(:mod:`.greedy`, variants batched) and score the variant's answer against the full KV's; a
variant's quality is the mean over queries. Two scorings (``scoring``):

* ``similarity`` (the paper's): ``cos(answer_full, answer_variant)`` of MiniLM-L6-v2 embeddings
  (:mod:`.embedder`);
* ``exact_match``: 1.0 when the variant's greedy answer is token-identical to the full KV's over
  the ``max_new_tokens`` decoded, else 0.0 — so quality is the share of profiled questions whose
  answer is unchanged, the scale users feel (issue 26). No embedder is loaded.

The model is any Hugging Face causal LM in a local directory (``model_path``), loaded on first
use with ``local_files_only=True``; its KV geometry (layers, KV heads, head dim) must match the
context's KV. The context KV must come from the same model (the daemon stores what vLLM computed
with it); :meth:`AnswerEvaluator.encode_context` prefills text or token ids when only those are
known (a batch job over contexts stored as tokens, and the tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.embedder import MiniLmEmbedder
from kvtierd.profiler.greedy import greedy_decode
from kvtierd.profiler.quality import (
    DEFAULT_FORM,
    SCORINGS,
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
)
from kvtierd.profiler.variant_kv import pad_left, variant_kvs
from kvtierd.profiler.window_queries import prefill_with_window_queries


class AnswerEvaluator(QualityEvaluator):
    """Answer similarity between the full KV and each variant's KV (module docstring)."""

    name = "answer"

    def __init__(
        self,
        model_path: str,
        max_new_tokens: int = 16,
        max_batch: int = 8,
        device: str = "cpu",
        embedder: MiniLmEmbedder | None = None,
        *,
        scoring: str = "similarity",
    ) -> None:
        if max_new_tokens < 1 or max_batch < 1:
            raise InvalidArgumentError(
                f"max_new_tokens and max_batch must be >= 1, got {max_new_tokens}, {max_batch}"
            )
        if scoring not in SCORINGS:
            raise InvalidArgumentError(
                f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}"
            )
        self.model_path = model_path
        self.max_new_tokens = max_new_tokens
        self.max_batch = max_batch
        self.device = device
        self.scoring = scoring
        self._embedder = embedder
        self._model: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def embedder(self) -> MiniLmEmbedder:
        """MiniLM, built on first use (``exact_match`` scoring never needs it)."""
        if self._embedder is None:
            self._embedder = MiniLmEmbedder(device=self.device)
        return self._embedder

    def load(self) -> tuple[Any, Any]:
        """The model and tokenizer, loaded once from ``model_path`` (never from the hub)."""
        with self._lock:
            if self._model is None:
                from kvtierd.profiler.checkpoint import load_causal_lm, load_tokenizer

                tok = load_tokenizer(self.model_path)
                model: Any = load_causal_lm(self.model_path)
                self._model, self._tokenizer = model.to(self.device).eval(), tok
            return self._model, self._tokenizer

    def query_ids(self, query: ProfilingQuery) -> list[int]:
        if query.token_ids:
            return list(query.token_ids)
        _, tok = self.load()
        ids = list(tok(query.text, add_special_tokens=False).input_ids)
        if not ids:
            raise InvalidArgumentError(f"query {query.text!r} tokenizes to nothing")
        return ids

    @torch.inference_mode()
    def encode_context(self, context: str | Sequence[int], window: int = 0) -> ContextKV:
        """Prefill a context (text or token ids) and return its KV ``[L, H, N, D]``; with
        ``window > 0`` also the RoPE-applied queries of its last ``window`` tokens (snapkv)."""
        model, tok = self.load()
        ids = (
            list(tok(context, add_special_tokens=False).input_ids)
            if isinstance(context, str)
            else list(context)
        )
        if not ids:
            raise InvalidArgumentError("empty context")
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        queries = None
        if window > 0:
            cache, queries = prefill_with_window_queries(model, x, window)
        else:
            cache = model(input_ids=x, use_cache=True).past_key_values
        keys = torch.stack([layer.keys[0] for layer in cache.layers])
        values = torch.stack([layer.values[0] for layer in cache.layers])
        return ContextKV(keys=keys, values=values, window_queries=queries, token_ids=tuple(ids))

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        """Mean score per variant over ``queries`` (at least one), by ``scoring``."""
        if not queries:
            raise InvalidArgumentError("the answer evaluator needs at least one profiling query")
        t0 = time.perf_counter()
        per_query: dict[str, list[float]] = {v: [] for v in variants}
        for ids in self.answer_ids(kv, ["none", *variants], queries, form=form):
            for v, s in zip(variants, self._scores(ids[0], ids[1:]), strict=True):
                per_query[v].append(s)
        return QualityResult.mean_of(self.name, per_query, len(queries), time.perf_counter() - t0)

    def _scores(self, full: list[int], others: Sequence[list[int]]) -> list[float]:
        if self.scoring == "exact_match":
            return [float(other == full) for other in others]
        _, tok = self.load()
        texts = [tok.decode(a, skip_special_tokens=True).strip() for a in [full, *others]]
        return self.embedder.similarity([texts[0]] * len(others), texts[1:])

    def answers(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> list[list[str]]:
        """Greedy answer texts, ``[query][variant]`` (:meth:`answer_ids`, decoded)."""
        _, tok = self.load()
        return [
            [tok.decode(a, skip_special_tokens=True).strip() for a in answers]
            for answers in self.answer_ids(kv, variants, queries, form=form)
        ]

    def answer_ids(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> list[list[list[int]]]:
        """Greedy answer token ids, ``[query][variant]``, each cut before its first EOS: each
        variant compressed once, every query decoded over all of them in batches of
        ``max_batch``."""
        model, _ = self.load()
        self._check_geometry(model, kv)
        kv = _on(kv, self.device, model.dtype)
        items = variant_kvs(kv, variants, form)
        return [self._answers(model, kv, items, self.query_ids(query)) for query in queries]

    def _answers(
        self, model: Any, kv: ContextKV, items: list[Any], query_ids: list[int]
    ) -> list[list[int]]:
        eos = model.generation_config.eos_token_id
        eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        out: list[list[int]] = []
        for start in range(0, len(items), self.max_batch):
            out += greedy_decode(
                model,
                pad_left(items[start : start + self.max_batch]),
                query_ids,
                context_tokens=kv.num_tokens,
                max_new_tokens=self.max_new_tokens,
                eos_token_ids=eos_ids,
                pause=self.pause,
            )
        return out

    @staticmethod
    def _check_geometry(model: Any, kv: ContextKV) -> None:
        cfg = model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
        have = (int(kv.keys.shape[0]), int(kv.keys.shape[1]), int(kv.keys.shape[3]))
        if want != have:
            raise InvalidArgumentError(
                f"context KV has (layers, kv heads, head dim) {have}, the model expects {want}"
            )


def _on(kv: ContextKV, device: str, dtype: torch.dtype) -> ContextKV:
    wq = kv.window_queries
    return ContextKV(
        keys=kv.keys.to(device, dtype),
        values=kv.values.to(device, dtype),
        window_queries=None if wq is None else wq.to(device, dtype),
        token_ids=kv.token_ids,
    )
