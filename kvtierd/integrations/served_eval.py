"""``served``: answer similarity measured on the serving stack itself (vLLM via ``kvtierd router``).

For each profiling query, the answer vLLM generates (greedy, ``max_new_tokens``) for
``context + query`` with the full context, against the answer it generates when the context is
loaded as the variant through the router — the path production traffic takes: placeholder ids,
rotated keys, the plugin's chunks. Both are embedded with MiniLM-L6-v2 and compared by cosine;
a variant's quality is the mean over queries (EvicPress §6.1, as
:mod:`kvtierd.profiler.answer`).

It lives with the integrations, not in the profiler, because it is a client of the serving
stack: it talks to the daemon through :class:`kvtierd.client.KVClient` (a layer the profiler may
not import) and to the router over HTTP. The profiler's registry finds it by module path on
first lookup (:func:`kvtierd.profiler.quality.evaluator_class`), so the daemon's profiler builds
it like any other evaluator.

Each call of :meth:`ServedEvaluator.evaluate` works in a profiling **scope** of its own
(``kvtierd.router_protocol``): the variants it stores have a context identity no production
prompt is ever rewritten to (other manifest keys, other placeholder ids), and they are stored
side by side, one manifest per variant, so they are scored concurrently. Steps:

1. refuse up front what the stack cannot load verifiably (:func:`scorable_variant`);
2. reference: every query through the router in the scope with no variant — the real prompt,
   never a stored variant (``lmcache.skip_save``: nothing stored);
3. store every variant at once (``max_concurrency`` requests in flight): ``"kvtierd":
   {"context_tokens": N, "variant": v, "scope": s}``. The router answers only once the variant
   is in the daemon — built from a put of the context, or from the context's chunks the daemon
   already holds — and answers an error saying why otherwise;
4. ask every (variant, query) through the router (``"kvtierd": {"scope": s, "variant": v}``,
   ``lmcache.skip_save``), ``max_concurrency`` at a time: each answer must carry
   ``x-kvtierd-context: <digest>/<v>``, else it came from a re-prefilled prompt (a router
   fallback: its counter moved) and nothing is scored;
5. evict what step 3 stored (context ``<digest>/<v>``: a scoped store writes nothing else).

Limits (docs/profiler.md): the context's token ids are required; ``int8``/``int4`` alone
cannot be scored.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtierd.client import KVClient
from kvtierd.errors import InvalidArgumentError, KvtierError, NotFoundError, UnavailableError
from kvtierd.profiler.embedder import MiniLmEmbedder
from kvtierd.profiler.quality import (
    DEFAULT_FORM,
    SCORINGS,
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
)
from kvtierd.router_protocol import LOADED_HEADER, ContextRequest, context_digest, loaded_value
from kvtierd.types import ORIGINAL_VARIANT
from kvtierd.variants import parse_variant

_T = TypeVar("_T")

QUANT_ONLY_REFUSED = (
    "the served evaluator cannot score {v!r}: the plugin stores a quantization-only variant "
    "under the context's own LMCache chunk keys, so (1) nothing in vLLM's answer tells a "
    "quantized load from a re-prefill or a vLLM prefix-cache hit, (2) a context whose chunks "
    "are cached is never re-stored quantized, and (3) while it is stored, production requests "
    "on the context would load it; score it with 'answer' or 'attention' "
    "(token-dropping variants, also composed with a quantization, e.g. 'knorm@0.5+int8', work)"
)


def scorable_variant(variant: str) -> str:
    """``variant`` normalised as the router names it (``knorm@1.0`` -> ``knorm@1``); raises
    :class:`InvalidArgumentError` for what the serving stack cannot load verifiably."""
    try:
        v = parse_variant(variant)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from e
    if v.quant and not v.drops_tokens:
        raise InvalidArgumentError(QUANT_ONLY_REFUSED.format(v=variant))
    return str(v)


def _check_url(url: str, what: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidArgumentError(f"{what} must be an http(s):// URL with a host, got {url!r}")
    return url.rstrip("/")


@dataclass(frozen=True, slots=True)
class Served:
    """One answer: its text and what the router loaded (``""``: the real prompt was served)."""

    text: str
    loaded: str


@dataclass(frozen=True, slots=True)
class _Stack:
    model: str  # the name requests carry
    root: str  # the model path vLLM loaded (part of every context digest)


@dataclass(frozen=True, slots=True)
class _Run:
    """One ``evaluate`` call: the stack, its profiling scope, the context's digest in it, the
    context's and the queries' token ids."""

    stack: _Stack
    scope: str
    digest: str
    context: tuple[int, ...]
    prompts: tuple[tuple[int, ...], ...]


class ServedEvaluator(QualityEvaluator):
    """Answer similarity through vLLM and ``kvtierd router`` (module docstring).

    ``router_url``: the router; ``vllm_url``: vLLM itself, only to tokenize text-only queries;
    ``model``: the served model name (default: the first the router lists); ``daemon_socket``:
    the daemon the router's plugin stores into (default ``$KVTIERD_SOCKET``, else the daemon's
    default), used to evict the variants this evaluator stores (``KVClient.evict``).
    """

    name = "served"
    needs_token_ids = True

    def __init__(
        self,
        router_url: str,
        *,
        vllm_url: str = "",
        model: str = "",
        daemon_socket: str = "",
        max_new_tokens: int = 16,
        max_concurrency: int = 4,
        timeout_s: float = 120.0,
        embedder: MiniLmEmbedder | None = None,
        scoring: str = "similarity",
    ) -> None:
        if not router_url:
            raise InvalidArgumentError("the served evaluator needs router_url (kvtierd router)")
        if max_new_tokens < 1 or max_concurrency < 1 or not timeout_s > 0:
            raise InvalidArgumentError(
                f"max_new_tokens and max_concurrency must be >= 1 and timeout_s > 0, got "
                f"{max_new_tokens}, {max_concurrency}, {timeout_s}"
            )
        self.router_url = _check_url(router_url, "router_url")
        self.vllm_url = _check_url(vllm_url, "vllm_url") if vllm_url else ""
        self.model = model
        self.daemon_socket = daemon_socket
        self.max_new_tokens = max_new_tokens
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        if scoring not in SCORINGS:
            raise InvalidArgumentError(
                f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}"
            )
        self.scoring = scoring
        self.embedder = embedder or MiniLmEmbedder()

    # -- the metric ---------------------------------------------------------------------------

    def _scores(self, reference: Sequence[str], answers: Sequence[str]) -> tuple[float, ...]:
        if self.scoring == "exact_match":
            return tuple(float(a == r) for r, a in zip(reference, answers, strict=True))
        return tuple(self.embedder.similarity(reference, answers))

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        """Mean answer score per variant over ``queries`` (at least one) by ``scoring``
        (MiniLM similarity, or exact match: the variant's answer text equals the full KV's);
        ``form`` is unused: the stack compresses with its own."""
        context = self._context_ids(kv)
        if not queries:
            raise InvalidArgumentError("the served evaluator needs at least one profiling query")
        names = {v: scorable_variant(v) for v in variants}
        text_only = [q.text for q in queries if not q.token_ids]
        if text_only and not self.vllm_url:
            raise InvalidArgumentError(
                f"profiling queries {text_only} have no token_ids; give them, or vllm_url so "
                "that the served model's tokenizer (vLLM /tokenize) can make them"
            )
        t0 = time.perf_counter()
        stack = self._stack()
        prompts = tuple(tuple(self._query_ids(q, stack)) for q in queries)
        scope = f"profile-{uuid.uuid4().hex[:16]}"
        digest = context_digest(stack.root, context, scope)
        run = _Run(stack, scope, digest, tuple(context), prompts)
        reference = self._reference(run)
        stored = [v for v in dict.fromkeys(names.values()) if v != ORIGINAL_VARIANT]
        answers = {ORIGINAL_VARIANT: reference, **self._variant_answers(run, stored)}
        per_query = {v: self._scores(reference, answers[names[v]]) for v in variants}
        return QualityResult.mean_of(self.name, per_query, len(queries), time.perf_counter() - t0)

    @staticmethod
    def _context_ids(kv: ContextKV) -> list[int]:
        if not kv.token_ids:
            raise InvalidArgumentError(
                "the served evaluator needs the context's token ids (ContextKV.token_ids): it "
                "sends the context to vLLM as tokens; a KV cache alone cannot be served"
            )
        if len(kv.token_ids) != kv.num_tokens:
            raise InvalidArgumentError(
                f"ContextKV has {len(kv.token_ids)} token ids for {kv.num_tokens} KV entries"
            )
        return list(kv.token_ids)

    def _reference(self, run: _Run) -> list[str]:
        """The full context's answers: the scope with no variant never loads a stored one."""
        served = self._ask(run, [""])
        for s in served:
            if s.loaded:
                raise KvtierError(
                    f"the router loaded {s.loaded!r} for a request of scope {run.scope} naming "
                    "no variant; it must send the real prompt (a router older than this "
                    "evaluator?), so the full-context answers are not available"
                )
        return [s.text for s in served]

    def _variant_answers(self, run: _Run, variants: list[str]) -> dict[str, list[str]]:
        """Store every variant in the run's scope, ask every query of each, evict them."""
        if not variants:
            return {}
        with KVClient(self._socket(), timeout_s=self.timeout_s) as daemon:
            fallbacks = self._fallbacks()
            try:
                self._parallel([functools.partial(self._store, run, v) for v in variants])
                served = self._ask(run, variants)
            finally:  # a scoped store writes only <digest>/<v>, all of them ours
                for v in variants:
                    with contextlib.suppress(NotFoundError):  # never stored, or dropped since
                        daemon.evict([loaded_value(run.digest, v)])
        n = len(run.prompts)
        answers = {}
        for i, v in enumerate(variants):
            mine = served[i * n : (i + 1) * n]
            self._check_loaded(mine, loaded_value(run.digest, v), fallbacks)
            answers[v] = [s.text for s in mine]
        return answers

    def _check_loaded(self, served: list[Served], want: str, fallbacks_before: int) -> None:
        for s in served:
            if s.loaded == want:
                continue
            if s.loaded:
                raise InvalidArgumentError(f"the router loaded {s.loaded!r}, not {want!r}")
            after = self._fallbacks()
            if after > fallbacks_before:
                raise UnavailableError(
                    f"vLLM failed to load {want} and the router fell back to the real prompt "
                    f"(router fallbacks {fallbacks_before} -> {after}); the answer would be the "
                    "full context's, so the variant is not scored"
                )
            raise UnavailableError(
                f"the router found no stored {want} although it had confirmed the store: the "
                "daemon dropped it before the queries (its capacity), so nothing is scored"
            )

    # -- requests -----------------------------------------------------------------------------

    def _completion(self, stack: _Stack, prompt: list[int], **extra: Any) -> Served:
        body = {"model": stack.model, "prompt": prompt, "max_tokens": self.max_new_tokens,
                "temperature": 0.0, **extra}  # fmt: skip
        data, headers = self._http("POST", f"{self.router_url}/v1/completions", body)
        return Served(str(data["choices"][0]["text"]).strip(), headers.get(LOADED_HEADER, ""))

    def _ask(self, run: _Run, variants: Sequence[str]) -> list[Served]:
        """Every query against the context as each of ``variants`` (``""``: the real prompt)
        through the router, in that order; ``lmcache.skip_save``: nothing of them is stored."""
        params = {"lmcache.skip_save": True}
        calls = [
            functools.partial(
                self._completion, run.stack, [*run.context, *q], kv_transfer_params=params,
                kvtierd=ContextRequest(variant=v, scope=run.scope).to_json(),
            )
            for v in variants
            for q in run.prompts
        ]  # fmt: skip
        return self._parallel(calls)

    def _parallel(self, calls: Sequence[Callable[[], _T]]) -> list[_T]:
        """``calls``, ``max_concurrency`` at a time (vLLM batches them), results in order; all
        have finished when the first error is raised."""
        workers = min(self.max_concurrency, len(calls))
        with ThreadPoolExecutor(workers, thread_name_prefix="kvtierd-served-eval") as pool:
            futures = [pool.submit(c) for c in calls]
            return [f.result() for f in futures]

    def _store(self, run: _Run, v: str) -> None:
        """Store ``v`` in the run's scope; the router answers once it is in the daemon, else
        with an error saying why (raised here as the domain error of its status)."""
        spec = ContextRequest(len(run.context), v, run.scope)
        body = {"model": run.stack.model, "prompt": [*run.context, *run.prompts[0]],
                "max_tokens": 1, "temperature": 0.0, "kvtierd": spec.to_json()}  # fmt: skip
        self._http("POST", f"{self.router_url}/v1/completions", body)

    def _fallbacks(self) -> int:
        data, _ = self._http("GET", f"{self.router_url}/health", None, ok=(200, 503))
        return int(data.get("fallbacks", 0))

    def _stack(self) -> _Stack:
        data, _ = self._http("GET", f"{self.router_url}/v1/models", None)
        served = {str(m["id"]): str(m.get("root") or m["id"]) for m in data.get("data", [])}
        if not served:
            raise UnavailableError(f"the router at {self.router_url} lists no model")
        model = self.model or next(iter(served))
        if model not in served:
            raise InvalidArgumentError(
                f"model {model!r} is not served behind {self.router_url}; served: "
                + ", ".join(served)
            )
        return _Stack(model, served[model])

    def _query_ids(self, query: ProfilingQuery, stack: _Stack) -> list[int]:
        if query.token_ids:
            return list(query.token_ids)
        body = {"model": stack.model, "prompt": query.text, "add_special_tokens": False}
        data, _ = self._http("POST", f"{self.vllm_url}/tokenize", body)
        ids = [int(x) for x in data["tokens"]]
        if not ids:
            raise InvalidArgumentError(f"query {query.text!r} tokenizes to nothing")
        return ids

    def _socket(self) -> str:
        if self.daemon_socket:
            return self.daemon_socket
        from kvtierd.environment import default_socket_path

        return os.environ.get("KVTIERD_SOCKET") or default_socket_path()

    def _http(
        self, method: str, url: str, body: dict[str, Any] | None, ok: tuple[int, ...] = (200,)
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """One JSON request; failures become domain errors naming the URL."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            if e.code in ok:
                return json.loads(text), dict(e.headers)
            cls = InvalidArgumentError if 400 <= e.code < 500 else UnavailableError
            raise cls(f"{method} {url} answered {e.code}: {text[:500]}") from e
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            raise UnavailableError(f"cannot reach {url} (kvtierd router / vLLM): {reason}") from e
        except (json.JSONDecodeError, KeyError) as e:
            raise KvtierError(f"{method} {url}: unexpected answer ({e})") from e
