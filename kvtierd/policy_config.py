# Long because it is the one typed schema every layer reads a policy through, with its checks.
"""Placement policies (``configs/policies/*.yaml``): the typed, frozen :class:`PolicyConfig` every
layer reads, and the pieces a placer's policy schema is read with.

A policy names a placer and gives it its knobs. The loader,
:func:`kvtierd.policies.loader.parse_policy`, asks the named placer class which top-level keys
it reads (``Placer.policy_keys``) and lets it read them (``Placer.read_policy``) through a
:class:`PolicyDocument`, whose errors name ``file:line``, the key and the allowed values; a
bad document is rejected whole (nothing partial is ever returned), so a daemon that hot-reloads
keeps its running policy on error. Placers that place by profiles share the ``variants``,
``profiling`` and ``frequency`` sections (:func:`read_profiled`).

Keys (every one documented in docs/configuration.md; unknown keys are errors)::

    name: evicpress            # label shown by `kvtierctl policy show`; default: the placer
    description: "..."         # free text
    placer: evicpress          # a registered placer (kvtierd.policies.PLACERS)
    alpha: 1.0                 # evicpress: quality weight in 1/s (utility = (alpha*q - ttft)*freq)
    selection: per_byte        # evicpress: per_byte | absolute (greedy rule on overflow)
    variants:                  # evicpress: the configuration grid profiled per context
      methods: [knorm, snapkv, int8, knorm+int8, snapkv-window=32-pool=7]  # snapkv: model_dir
      ratios: [1.0, 0.9, ..., 0.1]
    profiling:                 # evicpress: re-profile when online quality drops by > threshold
      reprofile_threshold: 0.05
      interval_s: 300
      estimator: query_attention  # the cheap estimator: every context's profile at its first
                               # put, trusted from the start (any evaluator but answer and served)
      evaluator: answer        # refines those profiles while vLLM is idle, where a decision is
                               # within estimator_error (answer | served); omitted: none
      estimator_error: 0.1     # the estimator's quality error: a closer call is refined
      scoring: similarity      # answer, served: similarity (MiniLM) | exact_match
      min_queries: 3           # a refined profile from fewer queries moves no context
      model_dir: ""            # the served model's local checkpoint: answer decodes with it,
                               # snapkv's window queries are recomputed with it (required)
      router_url: ""           # served: the kvtierd router in front of vLLM (required)
      vllm_url: ""             # served: vLLM itself, to tokenize text-only queries
    frequency:                 # evicpress: exponentially decayed access frequency
      half_life_s: 3600
    variant: knorm@0.5         # fixed: the one variant every context is stored as
    profiling: {model_dir: ""} # fixed: only model_dir (required for a snapkv variant)

This module sits in the bottom import layer (DESIGN.md §3.2): it must not import
``kvtierd.policies``, ``kvtierd.profiler`` or ``kvtierd.kernels``. Methods and variants are
checked by the one variant grammar, :mod:`kvtierd.variants`, in the same layer; evaluator names
are kept here as data (:data:`EVALUATORS`, held equal to ``kvtierd.profiler.EVALUATORS`` by a
test). Mapping a policy onto ``kvtierd.policies.PlacerParams`` is the engine's job;
:data:`PLACER_PARAMS_FIELDS` says which attribute feeds which parameter.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from kvtierd.errors import ConfigError
from kvtierd.types import ORIGINAL_VARIANT
from kvtierd.variants import (
    QUANT_BITS,
    Variant,
    expand_variants,
    parse_grid_method,
    parse_variant,
)
from kvtierd.yaml_source import YamlSource

EVALUATORS: tuple[str, ...] = ("attention", "answer", "served", "query_attention")
"""Quality evaluators a policy may name (``kvtierd.profiler``); ``answer`` needs
``profiling.model_dir`` (a local Hugging Face causal LM), ``served`` ``profiling.router_url``
(the daemon refuses ``served`` for a context whose token ids it was not given,
docs/profiler.md); ``query_attention`` runs questions through ``profiling.model_dir`` and
falls back to the context's last queries, else to the labels' per-variant prior, without it."""
EXPENSIVE_EVALUATORS: tuple[str, ...] = ("answer", "served")
"""Evaluators that decode answers (one to several prefills per context): they only refine
the cheap estimator's profiles (``profiling.evaluator``), never give a context its first."""
DEFAULT_ESTIMATOR = "query_attention"
"""The cheap estimator a policy gets when it names none (``profiling.estimator``): the one
that orders variants as accuracy does most often at a small share of a prefill (issue 26,
``benchmarks/quality/bench_estimators.py``)."""
DEFAULT_ESTIMATOR_ERROR = 0.1
"""``profiling.estimator_error`` when a policy gives none: the quality error the estimator is
taken to have until it is measured on labelled cases (issue 26)."""
SCORINGS: tuple[str, ...] = ("similarity", "exact_match")
"""How ``answer`` and ``served`` compare a variant's answer with the full KV's
(``profiling.scoring``, ``kvtierd.profiler.quality.SCORINGS``): MiniLM similarity (the paper's)
or exact match (issue 26)."""
RENAMED_EVALUATORS: Mapping[str, str] = MappingProxyType({"engine": "served"})
"""Old evaluator names a policy may still carry, refused with the new name (issue 17: "engine"
is only kvtierd's ``Engine``); never read as an alias."""
DEFAULT_RATIOS: tuple[float, ...] = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
DEFAULT_METHODS: tuple[str, ...] = ("knorm", "int8", "knorm+int8")
"""The default grid's methods. No ``snapkv``: it needs ``profiling.model_dir``
(:data:`SNAPKV_NEEDS_MODEL`), which has no default."""
SNAPKV_NEEDS_MODEL = (
    "snapkv scores tokens by the attention of the context's last window of queries, which a "
    "stored KV cache does not keep: the daemon recomputes them from the served model's weights "
    "(its local Hugging Face checkpoint) and the context's token ids, as the LMCache plugin does "
    "for a router store request. Set profiling.model_dir to that checkpoint, or remove snapkv "
    "(docs/kernels.md, 'snapkv in the daemon')"
)
PROFILED_KEYS: tuple[str, ...] = ("variants", "profiling", "frequency")
"""The sections :func:`read_profiled` reads, for a placer that places by profiles."""
PROFILED_FIELDS: tuple[str, ...] = (
    "methods", "ratios", "variants", "reprofile_threshold", "reprofile_interval_s", "evaluator",
    "estimator", "estimator_error", "evaluator_model_dir", "evaluator_router_url",
    "evaluator_vllm_url", "min_queries", "frequency_half_life_s", "evaluator_scoring",
)  # fmt: skip
"""The ``PolicyConfig`` attributes :func:`read_profiled` sets."""

PLACER_PARAMS_FIELDS: Mapping[str, str] = MappingProxyType(
    {"alpha": "alpha", "fixed_variant": "fixed_variant", "selection": "selection"}
)
"""``PlacerParams`` field -> ``PolicyConfig`` attribute. The engine builds the placer with
``placer_class(p.placer)(tiers, PlacerParams(**{f: getattr(p, a) for f, a in
PLACER_PARAMS_FIELDS.items()}))``."""

_SECTION_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "variants": ("methods", "ratios"),
        "profiling": (
            "reprofile_threshold",
            "interval_s",
            "evaluator",
            "estimator",
            "estimator_error",
            "min_queries",
            "max_share",
            "model_dir",
            "router_url",
            "vllm_url",
            "scoring",
        ),
        "frequency": ("half_life_s",),
    }
)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """A validated policy. ``variants`` is the expanded grid (always starting with ``"none"``)
    in the variant grammar of :mod:`kvtierd.variants` (``knorm@0.5``, ``int8``,
    ``knorm@0.5+int8``); ``fixed_variant`` is set only for the ``fixed`` placer.
    ``text``/``source`` are the document as given, for ``Admin.GetPolicy``."""

    name: str
    placer: str
    description: str = ""
    alpha: float = 1.0
    selection: str = "per_byte"
    methods: tuple[str, ...] = ()
    ratios: tuple[float, ...] = ()
    variants: tuple[str, ...] = (ORIGINAL_VARIANT,)
    fixed_variant: str = ""
    reprofile_threshold: float = 0.05
    reprofile_interval_s: float = 300.0
    # The cheap estimator profiles every context; ``evaluator`` refines where it can change a
    # decision. The same name in both: nothing refines (:attr:`refines`).
    estimator: str = DEFAULT_ESTIMATOR
    evaluator: str = DEFAULT_ESTIMATOR
    estimator_error: float = DEFAULT_ESTIMATOR_ERROR
    evaluator_model_dir: str = ""
    evaluator_router_url: str = ""
    evaluator_vllm_url: str = ""
    evaluator_scoring: str = "similarity"
    min_queries: int = 3
    profiling_share: float = 1.0
    frequency_half_life_s: float = 3600.0
    source: str = "embedded"
    text: str = ""

    @property
    def refines(self) -> bool:
        """Whether an expensive evaluator refines the estimator's profiles (docs/profiler.md,
        "Refining")."""
        return self.evaluator != self.estimator


class PolicyDocument:
    """A policy document read through typed accessors whose errors point at ``file:line``,
    the key and what is allowed. ``at`` is a key path (``("profiling", "evaluator")``)."""

    def __init__(self, text: str, source: str) -> None:
        self.src = YamlSource(source, text)
        if not isinstance(self.src.data, dict):
            raise ConfigError(f"{source}: a policy must be a mapping with at least a 'placer' key")
        self.raw: dict[str, Any] = self.src.data
        self.text = text
        self.source = source

    def where(self, at: tuple[str, ...]) -> str:
        return self.src.where(at)

    def get(self, at: tuple[str, ...], default: object) -> object:
        node: object = self.raw
        for key in at:
            if not isinstance(node, dict) or key not in node or node[key] is None:
                return default
            node = node[key]
        return node

    def has(self, at: tuple[str, ...]) -> bool:
        return self.get(at, None) is not None

    def text_value(self, at: tuple[str, ...], default: str) -> str:
        value = self.get(at, default)
        if not isinstance(value, str) or (not value.strip() and default):
            raise ConfigError(f"{self.where(at)}: expected a non-empty string, got {value!r}")
        return value

    def number(
        self, at: tuple[str, ...], default: float, ok: Callable[[float], bool], rule: str
    ) -> float:
        value = self.get(at, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.where(at)}: expected a number {rule}, got {value!r}")
        if math.isnan(value) or not ok(float(value)):
            raise ConfigError(f"{self.where(at)}: must be {rule}, got {value!r}")
        return float(value)

    def choice(
        self,
        at: tuple[str, ...],
        allowed: tuple[str, ...],
        default: str = "",
        renamed: Mapping[str, str] = MappingProxyType({}),
    ) -> str:
        """One of ``allowed``; without a ``default`` the key is required. A value in
        ``renamed`` (old name -> new) is refused with its new name."""
        value = self.get(at, default or None)
        if value is None:
            raise ConfigError(f"{self.where(at)}: required key; allowed values: "
                              f"{', '.join(allowed)}")  # fmt: skip
        if isinstance(value, str) and value in renamed:
            raise ConfigError(f"{self.where(at)}: {value!r} was renamed to {renamed[value]!r}; "
                              f"allowed values: {', '.join(allowed)}")  # fmt: skip
        if value not in allowed:
            raise ConfigError(f"{self.where(at)}: {value!r} is not allowed; allowed values: "
                              f"{', '.join(allowed)}")  # fmt: skip
        return str(value)

    def str_list(self, at: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.get(at, default)
        if not isinstance(value, list | tuple) or not value:
            raise ConfigError(f"{self.where(at)}: expected a non-empty list, got {value!r}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{self.where((*at, str(i)))}: expected a string, got {item!r}")
        return tuple(dict.fromkeys(value))

    def ratio_list(self, at: tuple[str, ...], default: tuple[float, ...]) -> tuple[float, ...]:
        value = self.get(at, default)
        if not isinstance(value, list | tuple) or not value:
            raise ConfigError(f"{self.where(at)}: expected a non-empty list of ratios")
        out: list[float] = []
        for i, item in enumerate(value):
            where = self.where((*at, str(i)))
            if isinstance(item, bool) or not isinstance(item, int | float):
                raise ConfigError(f"{where}: expected a ratio in (0, 1], got {item!r}")
            if not 0.0 < float(item) <= 1.0:
                raise ConfigError(f"{where}: ratio must be in (0, 1] (kept/original), got {item}")
            out.append(float(item))
        return tuple(sorted(set(out), reverse=True))

    def check_keys(self, at: tuple[str, ...], allowed: tuple[str, ...], what: str) -> None:
        """Every key of the mapping at ``at`` (``()``: the document) is one of ``allowed``."""
        node = self.get(at, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{self.where(at)}: must be a mapping")
        for key in node:
            if key not in allowed:
                raise ConfigError(f"{self.where((*at, str(key)))}: unknown key; {what}: "
                                  f"{', '.join(allowed) or '(none)'}")  # fmt: skip


def read_profiled(doc: PolicyDocument, policy: PolicyConfig) -> PolicyConfig:
    """``policy`` with the sections of a placer that places by profiles (:data:`PROFILED_KEYS`):
    the variant grid, profiling and the access frequency's half-life."""
    for section, keys in _SECTION_KEYS.items():
        doc.check_keys((section,), keys, "allowed keys")
    methods = doc.str_list(("variants", "methods"), DEFAULT_METHODS)
    for i, m in enumerate(methods):
        try:
            parse_grid_method(m)
        except ValueError as e:
            raise ConfigError(f"{doc.where(('variants', 'methods', str(i)))}: {e}") from e
    ratios = doc.ratio_list(("variants", "ratios"), DEFAULT_RATIOS)
    at = ("profiling",)
    policy = replace(
        policy,
        methods=methods,
        ratios=ratios,
        variants=expand_variants(methods, ratios),
        reprofile_threshold=doc.number(
            (*at, "reprofile_threshold"), 0.05, lambda x: 0 <= x < 1, "in [0, 1)"
        ),
        reprofile_interval_s=doc.number((*at, "interval_s"), 300.0, lambda x: x > 0, "> 0 seconds"),
        # A profile scored on fewer queries is shown but does not move a context (one query
        # scored keydiff@0.5 at 1.000 on the real model; three ranked the variants right).
        min_queries=int(
            doc.number((*at, "min_queries"), 3, lambda x: x >= 1 and x == int(x), "an integer >= 1")
        ),
        # Profiling through the serving stack takes vLLM from the requests it serves; this
        # bounds the share of time the daemon spends profiling on its own (not when asked).
        profiling_share=doc.number((*at, "max_share"), 1.0, lambda x: 0 < x <= 1, "in (0, 1]"),
        frequency_half_life_s=doc.number(
            ("frequency", "half_life_s"), 3600.0, lambda x: x > 0, "> 0 seconds"
        ),
    )
    return _with_evaluator(doc, policy)


def _estimators(doc: PolicyDocument) -> tuple[str, str]:
    """``(estimator, evaluator)``. A cheap name in ``profiling.evaluator`` is that key's meaning
    before issue 26, the estimator itself (nothing refines it); ``profiling.estimator`` may
    not then name another. No ``evaluator``: nothing refines."""
    cheap = tuple(e for e in EVALUATORS if e not in EXPENSIVE_EVALUATORS)
    at, at_estimator = ("profiling", "evaluator"), ("profiling", "estimator")
    evaluator = doc.choice(at, EVALUATORS, "", RENAMED_EVALUATORS) if doc.has(at) else ""
    if doc.get(at_estimator, None) in EXPENSIVE_EVALUATORS:
        raise ConfigError(
            f"{doc.where(at_estimator)}: {doc.get(at_estimator, '')!r} decodes answers (one to "
            f"several prefills a context), too costly for every context's first profile: name "
            f"it in profiling.evaluator, which refines the estimator's profiles; allowed "
            f"estimators: {', '.join(cheap)}"
        )
    if doc.has(at_estimator):
        estimator = doc.choice(at_estimator, cheap)
    else:
        estimator = evaluator if evaluator in cheap else DEFAULT_ESTIMATOR
    if evaluator in cheap and evaluator != estimator:
        raise ConfigError(
            f"{doc.where(at)}: {evaluator!r} is a cheap estimator and profiling.estimator is "
            f"{estimator!r}: profiling.evaluator refines the estimator's profiles with "
            f"{' or '.join(EXPENSIVE_EVALUATORS)}; leave it out to refine nothing"
        )
    return estimator, evaluator or estimator


def _with_evaluator(doc: PolicyDocument, policy: PolicyConfig) -> PolicyConfig:
    at = ("profiling", "evaluator")
    estimator, evaluator = _estimators(doc)
    router_url = _url(doc, ("profiling", "router_url"))
    if evaluator == "served" and not router_url:
        raise ConfigError(
            f"{doc.where(at)}: evaluator 'served' requires profiling.router_url (the kvtierd "
            "router in front of vLLM, e.g. http://127.0.0.1:8100)"
        )
    if evaluator == "served":
        _scorable_when_served(doc, policy.methods, policy.ratios)
    model_dir = doc.text_value(("profiling", "model_dir"), "")
    if policy.ratios != (1.0,):  # at ratio 1.0 alone a method keeps every token
        grid = [parse_grid_method(m) for m in policy.methods]
        check_snapkv_model(doc, ("variants", "methods"), policy.methods, grid, model_dir)
    error = doc.number(("profiling", "estimator_error"), DEFAULT_ESTIMATOR_ERROR,
                       lambda x: 0 <= x <= 1, "in [0, 1]")  # fmt: skip
    return replace(
        policy,
        estimator=estimator,
        evaluator=evaluator,
        estimator_error=error,
        evaluator_model_dir=model_dir,
        evaluator_router_url=router_url,
        evaluator_vllm_url=_url(doc, ("profiling", "vllm_url")),
        evaluator_scoring=doc.choice(("profiling", "scoring"), SCORINGS, "similarity"),
    )


def check_snapkv_model(
    doc: PolicyDocument,
    at: tuple[str, ...],
    names: Sequence[str],
    forms: Sequence[Variant],
    model_dir: str,
) -> None:
    """``names`` (grid methods or a variant, parsed as ``forms``) that drop tokens with
    ``snapkv`` need ``model_dir`` (:data:`SNAPKV_NEEDS_MODEL`); ``at`` names their key."""
    snapkv = [n for n, v in zip(names, forms, strict=True) if v.method == "snapkv"]
    if snapkv and not model_dir.strip():
        raise ConfigError(f"{doc.where(at)}: {', '.join(snapkv)} without profiling.model_dir: "
                          f"{SNAPKV_NEEDS_MODEL}")  # fmt: skip


def _scorable_when_served(
    doc: PolicyDocument, methods: tuple[str, ...], ratios: tuple[float, ...]
) -> None:
    """``served`` cannot score a quantization-only variant
    (``kvtierd.integrations.served_eval.QUANT_ONLY_REFUSED``; a test holds the two together): a
    grid with one would fail every profile, so it is refused here, at ``policy validate``,
    ``policy apply`` and daemon start. ``snapkv`` is left out of every daemon grid anyway (the
    daemon cannot build it)."""
    unscorable = [v for v in expand_variants(methods, ratios) if v in QUANT_BITS]
    if not unscorable:
        return
    sources = [m if m in QUANT_BITS else f"{m} at ratio 1.0" for m in methods
               if set(expand_variants((m,), ratios)) & set(QUANT_BITS)]  # fmt: skip
    raise ConfigError(
        f"{doc.where(('profiling', 'evaluator'))}: evaluator 'served' cannot score "
        f"{', '.join(unscorable)} (quantization-only variants, from variants.methods "
        f"{', '.join(sources)}): a quantized context keeps LMCache's own chunk keys, so no "
        "answer through the router tells its load from a re-prefill, and every profile would "
        "fail. Remove those methods (or ratio 1.0, for a composed one), or use evaluator "
        "'attention' or 'answer'"
    )


def _url(doc: PolicyDocument, at: tuple[str, ...]) -> str:
    """An optional http(s) URL (``""`` when absent), without a trailing slash."""
    value = doc.text_value(at, "").strip()
    parts = urllib.parse.urlsplit(value)
    if value and (parts.scheme not in ("http", "https") or not parts.netloc):
        raise ConfigError(
            f"{doc.where(at)}: expected an http:// or https:// URL with a host, got {value!r}"
        )
    return value.rstrip("/")


def check_variant(text: str, where: str = "variant") -> str:
    """A single variant: ``none``, ``int8``, ``knorm@0.5``, ``snapkv-window=32@0.5`` or
    ``knorm@0.5+int8``, under its one name (``knorm@0.50`` -> ``knorm@0.5``, ``knorm@1`` ->
    ``none``); raises :class:`ConfigError` naming ``where``."""
    try:
        return str(parse_variant(text).canonical())
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e
