"""Placement policy documents (``configs/policies/*.yaml``) validated into frozen typed objects.

A policy names a placer and gives it its knobs. ``parse_policy(text, source)`` and
``load_policy(path)`` return a :class:`PolicyConfig` or raise :class:`~kvtierd.errors.ConfigError`
naming ``file:line``, the key and the allowed values; a bad document is rejected whole (nothing
partial is ever returned), so a daemon that hot-reloads keeps its running policy on error.

Keys (every one documented in docs/configuration.md; unknown keys are errors)::

    name: evicpress            # label shown by `kvtierctl policy show`; default: the placer
    description: "..."         # free text
    placer: evicpress          # one of KNOWN_PLACERS
    alpha: 1.0                 # evicpress: quality weight in 1/s (utility = (alpha*q - ttft)*freq)
    selection: per_byte        # evicpress: per_byte | absolute (greedy rule on overflow)
    variants:                  # evicpress: the configuration grid profiled per context
      methods: [knorm, snapkv, int8, knorm+int8, snapkv-window=32-pool=7]  # snapkv: model_dir
      ratios: [1.0, 0.9, ..., 0.1]
    profiling:                 # evicpress: re-profile when online quality drops by > threshold
      reprofile_threshold: 0.05
      interval_s: 300
      evaluator: attention     # attention (model-free) | answer (needs model_dir) | engine
      min_queries: 3           # a profile from fewer queries moves no context
      model_dir: ""            # the served model's local checkpoint: answer decodes with it,
                               # snapkv's window queries are recomputed with it (required)
      router_url: ""           # engine: the kvtierd router in front of vLLM (required)
      vllm_url: ""             # engine: vLLM itself, to tokenize text-only queries
    frequency:                 # evicpress: exponentially decayed access frequency
      half_life_s: 3600
    variant: knorm@0.5         # fixed: the one variant every context is stored as
    profiling: {model_dir: ""} # fixed: only model_dir (required for a snapkv variant)

This module sits in the bottom import layer (DESIGN.md §3.2): it must not import
``kvtierd.policies`` or ``kvtierd.kernels``. Methods and variants are checked by the one variant
grammar, :mod:`kvtierd.variants`, in the same layer. Mapping a
policy onto ``kvtierd.policies.PlacerParams`` is the engine's job; :data:`PLACER_PARAMS_FIELDS`
says which attribute feeds which parameter.
"""

from __future__ import annotations

import math
import os
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvtierd.config import _Source
from kvtierd.errors import ConfigError
from kvtierd.types import ORIGINAL_VARIANT
from kvtierd.variants import (
    QUANT_BITS,
    expand_variants,
    parse_grid_method,
    parse_variant,
)

KNOWN_PLACERS: tuple[str, ...] = ("evicpress", "fixed", "lfu", "lru", "prefill")
"""Placer names a policy may name (``kvtierd.policies.PLACERS`` must be a subset of these)."""
SELECTIONS: tuple[str, ...] = ("per_byte", "absolute")
"""Greedy rules when a tier overflows: least utility drop per byte freed, or least drop."""
EVALUATORS: tuple[str, ...] = ("attention", "answer", "engine")
"""Quality evaluators a policy may name (``kvtierd.profiler``); ``answer`` needs
``profiling.model_dir`` (a local Hugging Face causal LM), ``engine`` ``profiling.router_url``
(the daemon itself refuses ``engine`` per context: it has no token ids, docs/profiler.md)."""
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

PLACER_PARAMS_FIELDS: Mapping[str, str] = MappingProxyType(
    {"alpha": "alpha", "fixed_variant": "fixed_variant", "selection": "selection"}
)
"""``PlacerParams`` field -> ``PolicyConfig`` attribute. The engine builds the placer with
``placer_class(p.placer)(tiers, PlacerParams(**{f: getattr(p, a) for f, a in
PLACER_PARAMS_FIELDS.items()}))``."""

_COMMON_KEYS = ("name", "description", "placer")
_PLACER_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "evicpress": ("alpha", "selection", "variants", "profiling", "frequency"),
        "fixed": ("variant", "profiling"),
        "lfu": (),
        "lru": (),
        "prefill": (),
    }
)
_SECTION_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "variants": ("methods", "ratios"),
        "profiling": (
            "reprofile_threshold",
            "interval_s",
            "evaluator",
            "min_queries",
            "model_dir",
            "router_url",
            "vllm_url",
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
    evaluator: str = "attention"
    evaluator_model_dir: str = ""
    evaluator_router_url: str = ""
    evaluator_vllm_url: str = ""
    min_queries: int = 3
    frequency_half_life_s: float = 3600.0
    source: str = "embedded"
    text: str = ""


DEFAULT_POLICY_TEXT = """\
# The daemon's embedded default: EvicPress with the default variant grid.
name: evicpress
placer: evicpress
"""


def default_policy() -> PolicyConfig:
    """The policy a daemon runs when its config names none: EvicPress (issue 5), every other
    setting at its default."""
    return parse_policy(DEFAULT_POLICY_TEXT, "embedded")


def load_policy(path: str | os.PathLike[str]) -> PolicyConfig:
    """Read and validate a policy file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read policy file {p}: {e.strerror}") from e
    return parse_policy(text, str(p))


def parse_policy(text: str, source: str) -> PolicyConfig:
    """Validate a whole policy document; ``source`` names it in error messages."""
    src = _Source(source, text)
    raw = src.data
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a policy must be a mapping with at least a 'placer' key")
    placer = _choice(raw.get("placer"), KNOWN_PLACERS, src, ("placer",), required=True)
    allowed = (*_COMMON_KEYS, *_PLACER_KEYS[placer])
    _check_keys(raw, allowed, src, (), f"keys for placer {placer!r}")
    r = _Reader(raw, src)
    fields: dict[str, Any] = {
        "name": r.text(("name",), placer),
        "description": r.text(("description",), ""),
        "placer": placer,
        "source": source,
        "text": text,
    }
    if placer == "evicpress":
        fields.update(_evicpress_fields(r))
    elif placer == "fixed":
        at = ("variant",)
        if "variant" not in raw:
            raise ConfigError(f"{src.where(at)}: placer 'fixed' requires key 'variant'")
        variant = check_variant(r.text(at, ""), src.where(at))
        fields.update(
            fixed_variant=variant, variants=tuple(dict.fromkeys((ORIGINAL_VARIANT, variant)))
        )
        fields.update(evaluator_model_dir=_fixed_model_dir(r, variant))
    return PolicyConfig(**fields)


def _evicpress_fields(r: _Reader) -> dict[str, Any]:
    for section in _SECTION_KEYS:
        value = r.raw.get(section)
        if value is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{r.src.where((section,))}: must be a mapping")
            _check_keys(value, _SECTION_KEYS[section], r.src, (section,), "allowed keys")
    methods = r.str_list(("variants", "methods"), DEFAULT_METHODS)
    for i, m in enumerate(methods):
        _method(m, r.src, ("variants", "methods", str(i)))
    ratios = r.ratio_list(("variants", "ratios"), DEFAULT_RATIOS)
    return {
        "alpha": r.number(("alpha",), 1.0, lambda x: x > 0, "> 0 (1/s)"),
        "selection": _choice(r.get(("selection",), "per_byte"), SELECTIONS, r.src, ("selection",)),
        "methods": methods,
        "ratios": ratios,
        "variants": expand_variants(methods, ratios),
        "reprofile_threshold": r.number(
            ("profiling", "reprofile_threshold"), 0.05, lambda x: 0 <= x < 1, "in [0, 1)"
        ),
        "reprofile_interval_s": r.number(
            ("profiling", "interval_s"), 300.0, lambda x: x > 0, "> 0 seconds"
        ),
        **_evaluator_fields(r),
        # A profile scored on fewer queries is shown but does not move a context (one query
        # scored keydiff@0.5 at 1.000 on the real model; three ranked the variants right).
        "min_queries": int(
            r.number(
                ("profiling", "min_queries"), 3, lambda x: x >= 1 and x == int(x), "an integer >= 1"
            )
        ),
        "frequency_half_life_s": r.number(
            ("frequency", "half_life_s"), 3600.0, lambda x: x > 0, "> 0 seconds"
        ),
    }


def _evaluator_fields(r: _Reader) -> dict[str, Any]:
    at = ("profiling", "evaluator")
    evaluator = _choice(r.get(at, "attention"), EVALUATORS, r.src, at)
    router_url = _url(r, ("profiling", "router_url"))
    if evaluator == "engine" and not router_url:
        raise ConfigError(
            f"{r.src.where(at)}: evaluator 'engine' requires profiling.router_url (the kvtierd "
            "router in front of vLLM, e.g. http://127.0.0.1:8100)"
        )
    model_dir = r.text(("profiling", "model_dir"), "")
    scorable = _scorable_grid(evaluator, r)
    methods = r.str_list(("variants", "methods"), DEFAULT_METHODS)
    if r.ratio_list(("variants", "ratios"), DEFAULT_RATIOS) != (1.0,):  # ratio 1.0 keeps all
        _snapkv_model(r, ("variants", "methods"), methods, model_dir)
    return {
        "evaluator": scorable,
        "evaluator_model_dir": model_dir,
        "evaluator_router_url": router_url,
        "evaluator_vllm_url": _url(r, ("profiling", "vllm_url")),
    }


def _scorable_grid(evaluator: str, r: _Reader) -> str:
    """``evaluator`` if it can score every variant of the grid. ``engine`` cannot score a
    quantization-only variant (``kvtierd.integrations.engine_eval.QUANT_ONLY_REFUSED``; a test
    holds the two together): a grid with one would fail every profile, so it is refused here,
    at ``policy validate``, ``policy apply`` and daemon start."""
    methods = r.str_list(("variants", "methods"), DEFAULT_METHODS)
    ratios = r.ratio_list(("variants", "ratios"), DEFAULT_RATIOS)
    unscorable = [v for v in expand_variants(methods, ratios) if v in QUANT_BITS]
    if evaluator != "engine" or not unscorable:
        return evaluator
    sources = [m if m in QUANT_BITS else f"{m} at ratio 1.0" for m in methods
               if set(expand_variants((m,), ratios)) & set(QUANT_BITS)]  # fmt: skip
    raise ConfigError(
        f"{r.src.where(('profiling', 'evaluator'))}: evaluator 'engine' cannot score "
        f"{', '.join(unscorable)} (quantization-only variants, from variants.methods "
        f"{', '.join(sources)}): a quantized context keeps LMCache's own chunk keys, so no "
        "answer through the router tells its load from a re-prefill, and every profile would "
        "fail. Remove those methods (or ratio 1.0, for a composed one), or use evaluator "
        "'attention' or 'answer'"
    )


def _snapkv_model(r: _Reader, at: tuple[str, ...], names: tuple[str, ...], model_dir: str) -> None:
    """``names`` (methods or a variant) with a snapkv one need ``model_dir``
    (:data:`SNAPKV_NEEDS_MODEL`); ``at`` names the key they come from. A snapkv method at ratio
    1.0 alone is the original: it needs nothing."""
    snapkv = [n for n in names if n.partition("+")[0].split("-")[0].split("@")[0] == "snapkv"]
    if snapkv and not model_dir.strip():
        raise ConfigError(f"{r.src.where(at)}: {', '.join(snapkv)} without profiling.model_dir: "
                          f"{SNAPKV_NEEDS_MODEL}")  # fmt: skip


def _fixed_model_dir(r: _Reader, variant: str) -> str:
    """The ``fixed`` placer's ``profiling`` section: only ``model_dir``, which a snapkv variant
    needs (the daemon builds it)."""
    section = r.raw.get("profiling")
    if section is not None:
        if not isinstance(section, dict):
            raise ConfigError(f"{r.src.where(('profiling',))}: must be a mapping")
        _check_keys(section, ("model_dir",), r.src, ("profiling",), "allowed keys for placer "
                    "'fixed'")  # fmt: skip
    model_dir = r.text(("profiling", "model_dir"), "")
    _snapkv_model(r, ("variant",), (variant,), model_dir)  # snapkv@1 was normalised to none
    return model_dir


def _url(r: _Reader, at: tuple[str, ...]) -> str:
    """An optional http(s) URL (``""`` when absent), without a trailing slash."""
    value = r.text(at, "").strip()
    parts = urllib.parse.urlsplit(value)
    if value and (parts.scheme not in ("http", "https") or not parts.netloc):
        raise ConfigError(
            f"{r.src.where(at)}: expected an http:// or https:// URL with a host, got {value!r}"
        )
    return value.rstrip("/")


# -- validation helpers ---------------------------------------------------------------------


class _Reader:
    """Typed access to nested keys of the raw document, with errors that point at file:line."""

    def __init__(self, raw: dict[str, Any], src: _Source) -> None:
        self.raw = raw
        self.src = src

    def get(self, at: tuple[str, ...], default: object) -> object:
        node: object = self.raw
        for key in at:
            if not isinstance(node, dict) or key not in node or node[key] is None:
                return default
            node = node[key]
        return node

    def text(self, at: tuple[str, ...], default: str) -> str:
        value = self.get(at, default)
        if not isinstance(value, str) or (not value.strip() and default):
            raise ConfigError(f"{self.src.where(at)}: expected a non-empty string, got {value!r}")
        return value

    def number(
        self, at: tuple[str, ...], default: float, ok: Callable[[float], bool], rule: str
    ) -> float:
        value = self.get(at, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.src.where(at)}: expected a number {rule}, got {value!r}")
        if math.isnan(value) or not ok(float(value)):
            raise ConfigError(f"{self.src.where(at)}: must be {rule}, got {value!r}")
        return float(value)

    def str_list(self, at: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.get(at, default)
        if not isinstance(value, list | tuple) or not value:
            raise ConfigError(f"{self.src.where(at)}: expected a non-empty list, got {value!r}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                where = self.src.where((*at, str(i)))
                raise ConfigError(f"{where}: expected a string, got {item!r}")
        return tuple(dict.fromkeys(value))

    def ratio_list(self, at: tuple[str, ...], default: tuple[float, ...]) -> tuple[float, ...]:
        value = self.get(at, default)
        if not isinstance(value, list | tuple) or not value:
            raise ConfigError(f"{self.src.where(at)}: expected a non-empty list of ratios")
        out: list[float] = []
        for i, item in enumerate(value):
            where = self.src.where((*at, str(i)))
            if isinstance(item, bool) or not isinstance(item, int | float):
                raise ConfigError(f"{where}: expected a ratio in (0, 1], got {item!r}")
            if not 0.0 < float(item) <= 1.0:
                raise ConfigError(f"{where}: ratio must be in (0, 1] (kept/original), got {item}")
            out.append(float(item))
        return tuple(sorted(set(out), reverse=True))


def _check_keys(
    raw: dict[str, Any], allowed: tuple[str, ...], src: _Source, at: tuple[str, ...], what: str
) -> None:
    for key in raw:
        if key not in allowed:
            where = src.where((*at, str(key)))
            raise ConfigError(f"{where}: unknown key; {what}: {', '.join(allowed) or '(none)'}")


def _choice(
    value: object,
    allowed: tuple[str, ...],
    src: _Source,
    at: tuple[str, ...],
    required: bool = False,
) -> str:
    if value is None and required:
        raise ConfigError(f"{src.where(at)}: required key; allowed values: {', '.join(allowed)}")
    if value not in allowed:
        raise ConfigError(f"{src.where(at)}: {value!r} is not allowed; allowed values: "
                          f"{', '.join(allowed)}")  # fmt: skip
    return str(value)


def _method(text: str, src: _Source, at: tuple[str, ...]) -> None:
    """A grid method: a drop method (with options), a quantization, or ``<drop>+<quant>``."""
    try:
        parse_grid_method(text)
    except ValueError as e:
        raise ConfigError(f"{src.where(at)}: {e}") from e


def check_variant(text: str, where: str = "variant") -> str:
    """A single variant: ``none``, ``int8``, ``knorm@0.5``, ``snapkv-window=32@0.5`` or
    ``knorm@0.5+int8``, under its one name (``knorm@0.50`` -> ``knorm@0.5``, ``knorm@1`` ->
    ``none``); raises :class:`ConfigError` naming ``where``."""
    try:
        return str(parse_variant(text).canonical())
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e
