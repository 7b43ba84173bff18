# Long because its every-ratio-at-once attention arithmetic (_Terms) serves this estimator only.
"""``query_attention``: the question's own attention, full KV against every variant, for every
ratio at once (issue 26).

The question's tokens run once through the model with the context's full KV as cache
(:func:`.window_queries.pass_for_context`: ``|q|`` tokens, a few % of the context's prefill), and
every layer's RoPE-applied queries ``q`` of those tokens are kept, with the question's own keys
and values. For every layer, query head (reading KV head ``j // G``, GQA) and question token::

    o_full = softmax(q [K; K_q]^T / sqrt(D)) [V; V_q]      the N context keys + the question's
    o_var  = the same over the variant's kept (dequantized) context keys + the question's
    error  = min(1, ||o_var - o_full|| / ||o_full||)
    raw    = 1 - mean of error over (layer, head, token)

over every ``layer_stride``-th layer (5 by default: layers 0, 5, .., 25 of 30, a fifth of the
errors' cost, and the question's pass stops after layer 25), with the question's pass in
``question_dtype`` (bf16 by default: about half the pass's cost on an AMX CPU; scores within
1e-3 of float32's on the labelled cases). Stride 5 is the cheapest reading measured that meets
issue 26's bar of 10% of a serving prefill (0.089 of it, median, on the labels); its raw
scores order fewer pairs than stride 3's (0.909 against 0.931), the default reading blended
with the prior as many (0.947 against 0.946): benchmarks/RESULTS.md.

(the question's keys causally: token ``t`` sees question tokens ``<= t``). This is what the
model's attention computes at each layer for the question with the full KV's hidden states
(teacher forcing: a layer's error is not carried to the next).

Every ratio at once: a token-dropping method keeps the ``M`` highest of its per-token scores
(:mod:`kvtierd.kernels.base`), so its kept sets are nested by ratio. The context's keys are
sorted once by the method's own score (the kernels' torch reference), and the softmax numerator
``sum e_t v_t`` and denominator ``sum e_t`` over the first ``M`` tokens in that order are running
sums of one matmul per segment between the grid's kept counts: one attention pass per method,
whatever the ratios. The softmax terms are kept context-entries-first (``[N, G*T]`` per head),
so a keep order permutes whole rows (``index_select``); the segments of an ordered pass cover
the whole context, so their sum is also the in-place output (the full KV, ``int8``, ``int4``)
of that quantization — no pass of its own (issue 26's speed-up; the computation before it,
:mod:`.query_attention_reference`, is the tests' reference).
Quantized variants attend over the dequantized K/V (the kernels' round trip); a drop composed
with a quantization (``knorm@0.5+int8``) over the full context's round trip in the method's keep
order — the stored object quantizes keys per channel in groups of 32 *kept* tokens, a grouping
this estimate does not follow (its error is of the same size).

``quality`` is ``raw`` through a monotone calibration to the share of questions whose answer is
unchanged (exact match of the greedy answer's first 16 tokens) measured on the labelled cases of
``benchmarks/data/quality_labels.jsonl`` (:data:`~.quality_tables.CALIBRATION`, where it comes from
is said there): the placer's ``alpha * quality`` then reads "share of questions still answered".
``calibrate=False`` returns ``raw``. Calibrated, the score is averaged (``prior_weight``, 0.5:
equal weights, chosen before measuring) with the labels' share for the variant (:data:`PRIOR`)
when the prior knows every variant: on the labels the prior alone ordered pairs better than the
context's own evidence, and the two together a little better still (RESULTS.md).

A context that continues others (issue 29: a document after a shared system prompt) is scored
as it is served: its ancestors' stored KV (``ContextKV.prefix_keys``) comes first, the question
runs after both (at positions ``P + N ..``, reading the prefix), and the prefix's softmax terms
join the question's own in every variant's output and the full one's alike (a variant of the
context compresses its own entries only). The prefix is read from storage, never recomputed: a
question of ``T`` tokens attends ``P`` more entries, once per layer for every variant.

Without a question (a context's first put): the queries of the context's last tokens
(``ContextKV.window_queries``; recomputed from ``model_dir`` and the context's token ids when the
KV has none), over the context's keys only — a weaker stand-in, measured in
benchmarks/RESULTS.md. Without those either (no model): the labels' mean share per variant
(:data:`PRIOR`, blind to the context), which ordered pairs better than the context's last keys
as probes; the last keys only for a variant the prior does not know.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.quality import (
    DEFAULT_FORM,
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
)
from kvtierd.profiler.quality_tables import COVERAGE_CALIBRATION, calibrate, prior_quality
from kvtierd.variants import parse_variant

if TYPE_CHECKING:
    import torch

# torch (and the kernels, which import it) is imported where a profile runs, not with this
# module: the daemon builds its evaluator at start, and torch's import was ~2 s of every
# start, also of daemons whose placer never profiles (issue 42: restart at scale).

FIRST_PUT_PROBES = ("window", "reconstruction", "coverage")
"""``first_put``: what a context is probed with when no question is known."""

QUESTION_DTYPES = ("bfloat16", "float32", "")  # torch dtype names; "": the stored KV's own
"""``question_dtype``: the dtype the question's pass runs the model in."""


@dataclass(frozen=True, slots=True, eq=False)
class Probes:
    """Query vectors to attend with: ``queries`` ``[L, Hq, T', D]``; ``own_keys``/``own_values``
    ``[L, H, T, D]`` when they are tokens after the context (a question of ``T`` tokens whose
    last ``T' <= T`` are the probes), attended causally beside the context; ``None`` for probes
    from inside the context."""

    queries: torch.Tensor
    own_keys: torch.Tensor | None = None
    own_values: torch.Tensor | None = None
    layer_stride: int = 1  # of every ``layer_stride``-th layer of the model only (0, k, 2k, ..)


class QueryAttentionEvaluator(QualityEvaluator):
    """Attention-output error of the question's queries, every ratio at once (module doc)."""

    name = "query_attention"

    def __init__(
        self,
        model_dir: str = "",
        *,
        window: int = 32,
        fallback_probes: int = 32,
        calibrate: bool = True,
        layers_per_step: int = 10,
        question_tokens: int = 0,
        prior_weight: float = 0.5,
        layer_stride: int = 5,
        question_dtype: str = "bfloat16",
        first_put: str = "coverage",
    ) -> None:
        if min(window, fallback_probes, layers_per_step, layer_stride) < 1:
            raise InvalidArgumentError(
                f"window, fallback_probes, layers_per_step and layer_stride must be >= 1, got "
                f"{window}, {fallback_probes}, {layers_per_step}, {layer_stride}"
            )
        if question_tokens < 0:
            raise InvalidArgumentError(f"question_tokens must be >= 0, got {question_tokens}")
        if question_dtype not in QUESTION_DTYPES:
            raise InvalidArgumentError(
                f"question_dtype must be one of {sorted(QUESTION_DTYPES)}, got {question_dtype!r}"
            )
        if first_put not in FIRST_PUT_PROBES:
            raise InvalidArgumentError(
                f"first_put must be one of {', '.join(FIRST_PUT_PROBES)}, got {first_put!r}"
            )
        self.first_put = first_put
        if not 0.0 <= prior_weight <= 1.0:
            raise InvalidArgumentError(f"prior_weight must be in [0, 1], got {prior_weight}")
        self.prior_weight = prior_weight
        self.layers_per_step = layers_per_step
        self.layer_stride = layer_stride
        self.question_dtype = question_dtype
        self.question_tokens = question_tokens
        self.model_dir = model_dir
        self.window = window
        self.fallback_probes = fallback_probes
        self.calibrate = calibrate

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery] = (),
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        """Quality per variant, the mean over ``queries`` that carry token ids (each one pass
        through the model in ``model_dir``); without any, or without ``model_dir``, over the
        fallback probes."""
        t0 = time.perf_counter()
        asked = [q for q in queries if q.token_ids] if self.model_dir else []
        if not asked and self.first_put == "coverage" and len(kv.token_ids) >= kv.num_tokens:
            return self._by_coverage(kv, variants, form, t0)
        return self._by_probes(kv, variants, asked, form, t0)

    def _by_coverage(
        self, kv: ContextKV, variants: Sequence[str], form: StoredForm, t0: float
    ) -> QualityResult:
        """A first put with ``first_put="coverage"``: each token-dropping variant's coverage
        (:mod:`.coverage`: no model pass) through :data:`~.quality_tables.COVERAGE_CALIBRATION`,
        averaged with the prior as a question's score is; the variants coverage cannot see
        (quantizations; a method that needs window queries the KV lacks) get the prior, or
        the probes where the prior does not know them."""
        from kvtierd.profiler.coverage import ngram_coverage

        seen = [v for v in variants if _drops_without_queries(v) or (
            parse_variant(v).drops_tokens and kv.window_queries is not None)]  # fmt: skip
        rest = [v for v in variants if v not in seen]
        covered = ngram_coverage(kv, seen, form) if seen else {}
        prior = prior_quality(variants) if self.calibrate else None
        w = self.prior_weight if prior is not None else 0.0
        per: dict[str, list[float]] = {}
        for v in seen:
            est = calibrate(covered[v], COVERAGE_CALIBRATION) if self.calibrate else covered[v]
            per[v] = [(1 - w) * est + w * (prior or {}).get(v, 0.0)]
        # the rest (quantizations): the prior where it knows them; probing them with the
        # window ranked contexts no better (held-out int4 Spearman 0.14) at 5x coverage's cost
        known = prior_quality(rest) if rest else {}
        if known is None:
            known = dict(self._by_probes(kv, rest, [], form, t0).quality)
        per.update({v: [q] for v, q in known.items()})
        # the context's own n-grams stand for the questions it was not asked yet
        return QualityResult.mean_of(self.name, per, 1, time.perf_counter() - t0)

    def _by_probes(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        asked: Sequence[ProfilingQuery],
        form: StoredForm,
        t0: float,
    ) -> QualityResult:
        """Over the questions ``asked`` (one pass each), or the first-put probes without."""
        known_ids = bool(self.model_dir) and len(kv.token_ids) >= kv.num_tokens
        can_probe = (
            kv.window_queries is not None
            or (known_ids and not kv.prefix_tokens)
            or (known_ids and self.first_put == "reconstruction")
        )
        if not asked and not can_probe and (known := prior_quality(variants)) is not None:
            # no question and no model: the labels' per-variant share beats the last keys
            per = {v: [q] for v, q in known.items()}
            return QualityResult.mean_of(self.name, per, 0, time.perf_counter() - t0)
        probe_sets = [self.question_probes(kv, q.token_ids) for q in asked] or [self.probes(kv)]
        per_query: dict[str, list[float]] = {v: [] for v in variants}
        prior = prior_quality(variants) if self.calibrate else None
        w = self.prior_weight if prior is not None else 0.0
        for probes in probe_sets:
            raw = self.raw_scores(kv, variants, probes, form)
            for v in variants:
                score = calibrate(raw[v]) if self.calibrate else raw[v]
                # the context's evidence and the labels' record of the variant, equal weights
                per_query[v].append((1 - w) * score + w * (prior or {}).get(v, 0.0))
        # as `attention` counts its probes when no question is known
        used = len(asked) or int(probe_sets[0].queries.shape[2])
        return QualityResult.mean_of(self.name, per_query, used, time.perf_counter() - t0)

    def question_probes(self, kv: ContextKV, token_ids: Sequence[int]) -> Probes:
        """The question's queries and own K/V after the context (one pass of its tokens)."""
        from kvtierd.profiler.window_queries import pass_for_context

        if not self.model_dir:
            raise InvalidArgumentError(
                "query_attention needs model_dir (the served model's local checkpoint) to run "
                "a question through the model"
            )
        # the pass in this dtype (bf16: 2x faster here, AMX's matmuls), of the layers read
        # only: it stops after the last of them (25 of 30 at stride 5)
        import torch

        dtype = getattr(torch, self.question_dtype) if self.question_dtype else None
        layers = range(0, int(kv.keys.shape[0]), self.layer_stride)
        keys, values = kv.served()  # after the ancestors' KV too: positions P + N ..
        seen = pass_for_context(self.model_dir, keys, values, token_ids, layers=layers, dtype=dtype)
        last = self.question_tokens or len(token_ids)
        return Probes(seen.queries[:, :, -last:], seen.keys, seen.values, self.layer_stride)

    def probes(self, kv: ContextKV) -> Probes:
        """Probes without a question (a first put): with ``first_put="reconstruction"``, the
        model and the context's token ids, spans of the context read again after it
        (:mod:`.reconstruction`); else window queries (given, or recomputed when ``model_dir``
        and the context's token ids are known; for a root only: a child's window would need its
        ancestors' ids too), else the last keys."""
        known_ids = len(kv.token_ids) >= kv.num_tokens
        if self.first_put == "reconstruction" and self.model_dir and known_ids:
            from kvtierd.profiler.reconstruction import reconstruction_ids

            return self.question_probes(kv, reconstruction_ids(kv.token_ids[: kv.num_tokens]))
        if kv.window_queries is not None:
            return Probes(kv.window_queries)
        if self.model_dir and known_ids and not kv.prefix_tokens:
            from kvtierd.profiler.window_queries import queries_for_context

            ids = kv.token_ids[: kv.num_tokens]
            return Probes(queries_for_context(self.model_dir, kv.keys, kv.values, ids, self.window))
        w = min(self.fallback_probes, kv.num_tokens)
        return Probes(kv.keys[:, :, kv.num_tokens - w :])

    def raw_scores(
        self, kv: ContextKV, variants: Sequence[str], probes: Probes, form: StoredForm
    ) -> dict[str, float]:
        """``raw`` per variant (module docstring), uncalibrated."""
        errors = self.errors(kv, variants, probes, form)
        return {v: 1.0 - float(e.mean()) for v, e in errors.items()}

    def errors(
        self, kv: ContextKV, variants: Sequence[str], probes: Probes, form: StoredForm
    ) -> dict[str, torch.Tensor]:
        """Clamped relative error per variant, float32 ``[L', H, G*T]`` (every
        ``layer_stride``-th layer from the first, ``L' = ceil(L / layer_stride)``; query heads
        grouped by the KV head they read, ``G`` per group, then the probe tokens)."""
        import torch

        from kvtierd.profiler.quant_round_trip import round_trips

        if self.layer_stride > 1:
            kv, probes = _every_kth_layer(kv, probes, self.layer_stride)
        plans = keep_plans(kv, variants, form)
        bits = sorted({p.bits for p in plans} | {0})
        n = kv.num_tokens
        per_step: dict[str, list[torch.Tensor]] = {v: [] for v in variants}
        layers = int(kv.keys.shape[0])
        for first in range(0, layers, self.layers_per_step):
            self.pause()
            at = slice(first, min(layers, first + self.layers_per_step))
            q = _scaled(probes.queries[at], int(kv.keys.shape[1]))
            own = _own_terms(q, probes, at, kv)
            k, v = kv.keys[at].float(), kv.values[at].float()
            lossy = [b for b in bits if b]
            ks = {0: k, **round_trips(k, lossy, form.group_size, "channel")}
            vs = {0: v, **round_trips(v, lossy, form.group_size, "token")}
            outs: dict[int, list[torch.Tensor]] = {}  # per ordered plan (its index), per count
            total: dict[int, torch.Tensor] = {}  # per bits: the output over every context entry
            for b in bits:
                terms = _Terms.of(q, (ks[b], vs[b]), own)
                for i, plan in enumerate(plans):
                    if plan.bits == b and plan.order is not None:
                        # its segments partition the context: their sum is the in-place output
                        *outs[i], total[b] = terms.outputs(plan.order[at], [*plan.counts, n])
                if b not in total:
                    total[b] = terms.outputs(None, [n])[0]
            for i, plan in enumerate(plans):  # an in-place plan keeps every entry: the total
                got = outs.get(i, [total[plan.bits]])
                for names, o in zip(plan.by_count, got, strict=True):
                    err = _relative_error(o, total[0])
                    for name in names:
                        per_step[name].append(err)
        return {v: torch.cat(errs) for v, errs in per_step.items()}


def _drops_without_queries(variant: str) -> bool:
    from kvtierd.kernels.registry import get_method

    """Whether ``variant`` drops tokens by a method that scores them from the KV alone."""
    parsed = parse_variant(variant)
    return parsed.drops_tokens and not get_method(parsed.method, parsed.options).needs_queries


def _every_kth_layer(kv: ContextKV, probes: Probes, k: int) -> tuple[ContextKV, Probes]:
    """Layers ``0, k, 2k, ..`` of the context and the probes (a method's per-layer scores, and
    so its keep order, depend on its own layer only); probes of those layers only already
    (:meth:`QueryAttentionEvaluator.question_probes`) are kept as they are."""
    wq = None if kv.window_queries is None else kv.window_queries[::k]
    pk = None if kv.prefix_keys is None else kv.prefix_keys[::k]
    pv = None if kv.prefix_values is None else kv.prefix_values[::k]
    strided = ContextKV(kv.keys[::k], kv.values[::k], wq, kv.token_ids, pk, pv)
    if probes.layer_stride == k:
        return strided, probes
    if probes.layer_stride != 1:
        raise InvalidArgumentError(
            f"probes of every {probes.layer_stride}th layer cannot be read at stride {k}"
        )
    own_k = None if probes.own_keys is None else probes.own_keys[::k]
    own_v = None if probes.own_values is None else probes.own_values[::k]
    return strided, Probes(probes.queries[::k], own_k, own_v, k)


@dataclass(frozen=True, slots=True, eq=False)
class KeepPlan:
    """Variants sharing one keep order (``None``: every token, in place) and one quantization
    (``bits``, 0 for none), and the kept counts they take of that order."""

    order: torch.Tensor | None  # int64 [L, H, N]: token indices, most important first
    bits: int
    counts: list[int]  # ascending, distinct
    by_count: list[list[str]]  # variant names per count


def keep_plans(kv: ContextKV, variants: Sequence[str], form: StoredForm) -> list[KeepPlan]:
    import torch

    from kvtierd.kernels.layout import KVSource
    from kvtierd.kernels.registry import get_method

    parsed = {v: parse_variant(v) for v in variants}
    groups: dict[tuple[str, int], list[str]] = {}
    for v, p in parsed.items():
        groups.setdefault((p.drop_method if p.drops_tokens else "", p.quant_bits), []).append(v)
    orders: dict[str, torch.Tensor] = {}
    n = kv.num_tokens
    plans = []
    for (drop, bits), names in groups.items():
        count_of = {v: n for v in names}
        order = None
        if drop:
            first = parsed[names[0]]
            method = get_method(first.method, first.options)
            if drop not in orders:
                method.check_queries(
                    KVSource.from_contiguous(kv.keys, kv.values), kv.window_queries
                )
                scores = method.score_reference(kv.keys, kv.values, kv.window_queries)
                orders[drop] = torch.sort(scores, dim=-1, descending=True, stable=True).indices
            order = orders[drop]
            unit = form.chunk_tokens
            count_of = {v: method.kept_count(n, parsed[v].ratio, unit) for v in names}
        counts = sorted(set(count_of.values()))
        by_count = [[v for v in names if count_of[v] == c] for c in counts]
        plans.append(KeepPlan(order, bits, counts, by_count))
    return plans


@dataclass(frozen=True, slots=True, eq=False)
class _Terms:
    """Some layers' softmax terms over the context for one quantization: ``e_t``
    ``[L', H, N, G*T]`` (``exp`` of the logits less a per-row constant, which cancels; context
    entries first, so that a keep order permutes whole rows), the values ``[L', H, N, D]``, and
    the question's own numerator ``[L', H, G*T, D]`` and denominator ``[L', H, G*T]`` (zeros
    for probes from inside the context)."""

    e_t: torch.Tensor
    values: torch.Tensor
    own_num: torch.Tensor
    own_den: torch.Tensor

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        own: _Own,
    ) -> _Terms:
        """``kv``: the layers' float32 keys and values ``[L', H, N, D]`` (dequantized for a
        quantized variant)."""
        import torch

        k, v = kv
        logits_t = k @ q.transpose(-1, -2)  # [L', H, N, G*T]
        top = logits_t.amax(dim=-2)
        if own is None:
            e_t = torch.exp_(logits_t - top[..., None, :])
            return cls(e_t, v, torch.zeros_like(q), torch.zeros(q.shape[:-1]))
        own_logits, own_values, own_top = own
        top = torch.maximum(top, own_top)
        e_t = torch.exp_(logits_t.sub_(top[..., None, :]))
        e_own = torch.exp(own_logits - top[..., None])
        return cls(e_t, v, e_own @ own_values, e_own.sum(dim=-1))

    def outputs(self, order: torch.Tensor | None, counts: Sequence[int]) -> list[torch.Tensor]:
        """Attention outputs ``[L', H, G*T, D]`` over the first ``c`` context entries of
        ``order`` (``[L', H, N]``; ``None``: in place) and the own terms, for every ``c`` in
        ``counts`` (ascending): one matmul per segment between counts, then running sums."""
        e_t, v = self.e_t, self.values
        if order is not None:
            e_t, v = _permuted(e_t, order), _permuted(v, order)
        num, den = self.own_num, self.own_den
        outs, start = [], 0
        for c in counts:
            seg = e_t[:, :, start:c]
            num = num + seg.transpose(-1, -2) @ v[:, :, start:c]
            den = den + seg.sum(dim=-2)
            outs.append(num / den[..., None])
            start = c
        return outs


def _permuted(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x`` ``[L', H, N, F]`` with each (layer, head)'s rows in ``order`` ``[L', H, N]``: one
    row gather over the flattened heads (``index_select`` copies rows; ``gather`` indexes
    every element and ran ~4x slower here)."""
    import torch

    lyr, h, n, f = (int(s) for s in x.shape)
    base = torch.arange(lyr * h, device=order.device).reshape(lyr, h, 1) * n
    rows = (order + base).reshape(-1)
    return x.reshape(lyr * h * n, f).index_select(0, rows).reshape(lyr, h, n, f)


def _scaled(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[L', Hq, T, D]`` -> float32 ``[L', H, G*T, D] / sqrt(D)`` (query heads grouped by the
    KV head they read)."""
    lyr, hq, t, d = (int(s) for s in queries.shape)
    if hq % kv_heads:
        raise InvalidArgumentError(f"{hq} query heads are not a multiple of {kv_heads} KV heads")
    return queries.float().reshape(lyr, kv_heads, hq // kv_heads * t, d) / math.sqrt(d)


_Own: TypeAlias = "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"


def _own_terms(q: torch.Tensor, probes: Probes, at: slice, kv: ContextKV | None = None) -> _Own:
    """The entries every variant keeps as they are, for the layers ``at``: the context's
    ancestors' KV (``kv.prefix_keys``, all visible) and the question's own keys, causally:
    ``(logits [L', H, G*T, X] with -inf above the question's diagonal, values [L', H, X, D],
    row max [L', H, G*T])``, or ``None`` when there are none (probes from inside a root)."""
    import torch

    logits_parts, value_parts = [], []
    if kv is not None and kv.prefix_keys is not None and kv.prefix_values is not None:
        logits_parts.append(q @ kv.prefix_keys[at].float().transpose(-1, -2))  # [L', H, G*T', P]
        value_parts.append(kv.prefix_values[at].float())
    if probes.own_keys is not None and probes.own_values is not None:
        k, v = probes.own_keys[at].float(), probes.own_values[at].float()
        t = int(k.shape[2])
        asked = int(probes.queries.shape[2])  # the question's last tokens, of its t
        logits = q @ k.transpose(-1, -2)  # [L', H, G*T', T]
        row = torch.arange(int(q.shape[2]), device=q.device) % asked + (t - asked)  # its token
        future = torch.arange(t, device=q.device)[None, :] > row[:, None]
        logits_parts.append(logits.masked_fill(future, float("-inf")))
        value_parts.append(v)
    if not logits_parts:
        return None
    logits = torch.cat(logits_parts, dim=-1)
    return logits, torch.cat(value_parts, dim=-2), logits.amax(dim=-1)


def _relative_error(o: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``min(1, ||o - full|| / ||full||)`` per row, ``[L', H, G*T]``."""
    err: torch.Tensor = (o - full).norm(dim=-1) / full.norm(dim=-1).clamp_min(1e-12)
    return err.clamp(max=1.0)
