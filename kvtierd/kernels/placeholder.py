"""Placeholder identities for token-dropped variants (DESIGN.md §1): the one servable form.

A context of ``N`` tokens compressed to ``M`` kept entries is loaded into unmodified vLLM as the
prompt ``[M placeholder ids] + suffix``. The placeholder ids are a deterministic pseudo-random
sequence per (context, variant), so vLLM's prefix cache never confuses two of them, and the
``M`` kept entries (keys rotated by ``M - N``) are stored in chunks. A :class:`Manifest`,
stored in the daemon under a key derived from the context's tokens
(``kvtierd.router_protocol.context_digest``), tells the router the placeholder ids and the
daemon keys of those chunks (``chunk_keys``), in order.

Whoever builds a variant writes this form: the LMCache plugin for a ``kvtierd router`` store
request (its chunk keys are then LMCache's keys of the placeholder prompt), and the daemon's
executor when the placer compresses a context (keys the daemon derives). The plugin serves the
``i``-th placeholder chunk of a rewritten request from ``chunk_keys[i]`` either way.

It sits in ``kernels`` (pure Python + numpy, torch only inside :meth:`ModelCard.rope`) so that
the daemon's engine and the integrations share it; the model's rope parameters reach the
daemon as a :class:`ModelCard` the plugin registers when it starts.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtierd.errors import InvalidArgumentError
from kvtierd.sizes import count_unit, variant_kept_tokens
from kvtierd.variants import Variant

if TYPE_CHECKING:
    from kvtierd.kernels.rope import RopeSpec

MANIFEST_PREFIX = "kvtierd-ph@"
MODEL_CARD_PREFIX = "kvtierd-model@"
MODEL_CARD_LAYOUT = "kvtierd-model-card"
# Layouts of a placeholder variant's other objects as the plugin stores them: its kept indices
# (int32 [L, H, M]) and its manifest (bytes). Stored in objects' metadata: never renamed.
KEPT_LAYOUT = "kept[L,H,M]"
MANIFEST_LAYOUT = "manifest"
# A card is a model name, head_dim / 2 frequencies and a few special ids: ~6 KiB for a head
# of 256. The bound keeps a client's card from costing the daemon more than its quota says.
MAX_CARD_BYTES = 64 << 10
MAX_CARD_HEAD_DIM = 1024
MAX_CARD_SPECIAL_IDS = 1024
MAX_CARD_VOCAB = 1 << 24
MAX_CARD_TEXT = 4096  # model name and refusal reason, in characters

SNAPKV_UNAVAILABLE = (
    "snapkv through the LMCache plugin needs the context's last window of token ids (vLLM's "
    "paged cache keeps no queries: the plugin recomputes them from the model's weights), which "
    "kvtierd router sends with a store request (lmcache.tag.kvtierd_window); this request "
    "carries none: send it through a kvtierd router of this version"
)

# rope_type values whose rotation angle does not depend on the sequence length: a constant
# delta rotation is exact for them (YaRN's mscale is already inside the stored keys).
_EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def manifest_key(digest: str, variant: str = "") -> str:
    """Where the manifest of ``digest`` is stored: one per production context (``variant``
    ``""``: a request loads whichever variant is stored), one per (context, variant) for a
    scoped context (``kvtierd.router_protocol``: a request names the variant it loads)."""
    return f"{MANIFEST_PREFIX}{digest}/{variant}" if variant else f"{MANIFEST_PREFIX}{digest}"


def kept_key(digest: str, variant: str = "") -> str:
    """The kept indices ``[L, H, M]`` beside the manifest (same rule as :func:`manifest_key`)."""
    return f"{manifest_key(digest, variant)}@kept"


def kept_tokens(num_tokens: int, variant: Variant, chunk_tokens: int) -> int:
    """``M``, the entries a store of ``num_tokens`` tokens as ``variant`` keeps, as the plugin
    builds it: ``ratio * N`` rounded to the nearest whole chunk (half up), at least one chunk,
    at most ``N`` (``kvtierd.sizes.kept_token_count``; knorm@0.25 of 1,536 tokens in chunks
    of 256 keeps 384 -> 1.5 -> 2 chunks = 512). A page method (``paged_eviction_block``) keeps
    whole pages of its own instead, which are whole chunks only by chance: the router refuses
    it then (``router/store.py``)."""
    return variant_kept_tokens(num_tokens, variant, chunk_tokens=count_unit(variant, chunk_tokens))


def placeholder_ids(
    digest: str, variant: str, count: int, vocab_size: int, reserved: Sequence[int] = ()
) -> list[int]:
    """``count`` ids in ``[0, vocab_size)`` avoiding ``reserved`` (special tokens), seeded by
    (context, variant): the same in every process, different for every context and variant."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(reserved, dtype=np.int64))
    if allowed.size < 2:
        raise InvalidArgumentError(f"vocabulary of {vocab_size} leaves no placeholder ids")
    seed = int.from_bytes(hashlib.sha256(f"{digest}/{variant}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.choice(allowed, size=count, replace=True)]


@dataclass(frozen=True, slots=True)
class Manifest:
    """What the router needs to serve a context from its token-dropped variant;
    ``source_context`` is the daemon context holding the original chunks it was built from
    (``""``: unknown, or a scoped variant), which the router reports its real prompts to."""

    digest: str
    variant: str
    num_tokens: int
    num_kept: int
    rope_delta: int
    placeholder_ids: tuple[int, ...]
    chunk_keys: tuple[str, ...]
    source_context: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        d = json.loads(data)
        return cls(
            digest=d["digest"],
            variant=d["variant"],
            num_tokens=int(d["num_tokens"]),
            num_kept=int(d["num_kept"]),
            rope_delta=int(d["rope_delta"]),
            placeholder_ids=tuple(int(x) for x in d["placeholder_ids"]),
            chunk_keys=tuple(d["chunk_keys"]),
            source_context=str(d.get("source_context", "")),  # absent in older manifests
        )


@dataclass(frozen=True, slots=True)
class ModelRope:
    """The rope parameters of a Hugging Face config that token dropping needs; ``rope_type``
    is one of the exact kinds (``default``, ``linear``, ``llama3``, ``yarn``)."""

    theta: float
    head_dim: int
    rotary_dim: int
    vocab_size: int
    special_ids: tuple[int, ...]
    rope_type: str = "default"


# Architectures vLLM (0.32.0, model_executor/models) builds with ``is_neox_style=False``: they
# rotate adjacent pairs (GPT-J style), while the delta rotation here pairs the two halves of
# the head (NeoX style, as Llama, Mistral, Qwen, Gemma, Phi-3 do).
_INTERLEAVED_ROPE = frozenset({
    "GPTJForCausalLM", "Glm4ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
    "Cohere2MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "BailingMoeV2_5ForCausalLM",
    "BailingMoeV3ForCausalLM", "AXK1ForCausalLM", "SarvamMoEForCausalLM", "SarvamMLAForCausalLM",
    "PanguProMoEV2ForCausalLM", "PanguUltraMoEForCausalLM",
})  # fmt: skip


def _interleaved(config: Mapping[str, Any]) -> str:
    """The architecture that rotates adjacent pairs, or ``""``."""
    for arch in config.get("architectures") or ():
        if arch in _INTERLEAVED_ROPE:
            return str(arch)
        if arch in ("ChatGLMModel", "ChatGLMForConditionalGeneration") and config.get(
            "original_rope", True
        ):  # vLLM: is_neox_style = not config.original_rope
            return str(arch)
    return ""


def model_rope(config: Mapping[str, Any]) -> ModelRope:
    """Read a HF ``config.json``; refuse models whose position encoding makes a constant delta
    rotation inexact (ALiBi, dynamic NTK, LongRoPE, M-RoPE) or that rotate adjacent pairs
    (GPT-J style) with the reason."""
    model_type = str(config.get("model_type", ""))
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    why = ""
    if arch := _interleaved(config):
        why = f"{arch} rotates adjacent pairs (GPT-J style); token dropping rotates NeoX style"
    elif config.get("alibi") or config.get("position_embedding_type") == "alibi" or model_type in (
        "bloom", "mpt", "baichuan"):  # fmt: skip
        why = "ALiBi position biases are not rotations"
    elif "mrope_section" in params or rope_type in ("mrope", "default_mrope"):
        why = "M-RoPE mixes several position axes"
    elif rope_type not in _EXACT_ROPE_TYPES:
        why = f"rope_type {rope_type!r} has length-dependent frequencies"
    if why:
        raise InvalidArgumentError(
            f"model type {model_type!r} cannot load token-dropped contexts exactly: {why}; "
            "use a shape-preserving variant (int8, int4, none) for it"
        )
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    partial = float(config.get("partial_rotary_factor", 1.0))
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    special = [config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    flat: list[int] = []
    for s in special:
        flat.extend(s if isinstance(s, list) else [] if s is None else [int(s)])
    return ModelRope(
        theta=theta,
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        vocab_size=int(config["vocab_size"]),
        special_ids=tuple(flat),
        rope_type=rope_type,
    )


def read_model_rope(model: str) -> ModelRope:
    """:func:`model_rope` of a local model directory's ``config.json``."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise InvalidArgumentError(
            f"token dropping needs the model's config.json; {path} does not exist"
        )
    return model_rope(json.loads(path.read_text()))


def lmcache_model(key: str) -> str:
    """The model name in an LMCache chunk key as the plugin names objects
    (``model@world_size@worker_id@chunk_hash@dtype``, ``plugin_settings.key_string``), or
    ``""`` when ``key`` is not one."""
    parts = key.rsplit("@", 4)
    return parts[0] if len(parts) == 5 and parts[0] else ""


def model_card_key(model: str) -> str:
    """Where the plugin registers the :class:`ModelCard` of ``model`` (LMCache's model name)."""
    return f"{MODEL_CARD_PREFIX}{model}"


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the daemon needs to store a token-dropped variant of a model's context in the
    servable form: the rotation (``inv_freq`` as the model computes it, scaling included;
    NeoX pairing), the vocabulary the placeholder ids come from, and the model name that
    context digests hash. ``refused`` says why the model cannot load token-dropped KV exactly
    (``""``: it can); the plugin registers a refused card too, so that the daemon can say why."""

    model: str
    head_dim: int = 0
    inv_freq: tuple[float, ...] = ()
    vocab_size: int = 0
    special_ids: tuple[int, ...] = ()
    refused: str = ""
    style: str = field(default="neox")

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ModelCard:
        """Parse and check a card a client sent: size-bounded before JSON reads it (a card
        nested 100,000 deep raised RecursionError mid-commit and leaked its arena block,
        issue 27.2), every field of the type and range a card has."""
        if len(data) > MAX_CARD_BYTES:
            raise InvalidArgumentError(f"model card is {len(data)} bytes; at most {MAX_CARD_BYTES}")
        try:
            d = json.loads(data)
            if not isinstance(d, dict):
                raise TypeError(f"a card is a JSON object, got {type(d).__name__}")
            card = cls(
                model=_text(d["model"], "model"),
                head_dim=_integer(d["head_dim"], "head_dim"),
                inv_freq=tuple(_number(x, "inv_freq") for x in _array(d["inv_freq"], "inv_freq")),
                vocab_size=_integer(d["vocab_size"], "vocab_size"),
                special_ids=tuple(
                    _integer(x, "special_ids") for x in _array(d["special_ids"], "special_ids")
                ),
                refused=_text(d.get("refused", ""), "refused"),
                style=_text(d.get("style", "neox"), "style"),
            )
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise InvalidArgumentError(f"model card is not valid: {type(e).__name__}: {e}") from e
        if why := card._invalid():
            raise InvalidArgumentError(f"model card of {card.model[:200]!r} is not valid: {why}")
        return card

    def _invalid(self) -> str:
        """Why the card's values cannot describe a model, or ``""``."""
        if not self.model or len(self.model) > MAX_CARD_TEXT:
            return f"model must be a name of 1 to {MAX_CARD_TEXT} characters"
        if self.refused:
            return ""  # a refused card carries only the reason
        if not 2 <= self.head_dim <= MAX_CARD_HEAD_DIM or self.head_dim % 2:
            return f"head_dim {self.head_dim} must be even, in [2, {MAX_CARD_HEAD_DIM}]"
        if not 1 <= len(self.inv_freq) <= self.head_dim // 2:
            return f"inv_freq has {len(self.inv_freq)} values; 1 to head_dim / 2 are allowed"
        if not all(math.isfinite(f) and f > 0 for f in self.inv_freq):
            return "every inv_freq value must be a finite number > 0"
        if not 2 <= self.vocab_size <= MAX_CARD_VOCAB:
            return f"vocab_size {self.vocab_size} must be in [2, {MAX_CARD_VOCAB}]"
        if len(self.special_ids) > MAX_CARD_SPECIAL_IDS or not all(
            0 <= i < self.vocab_size for i in self.special_ids
        ):
            return f"special_ids must be at most {MAX_CARD_SPECIAL_IDS} ids in [0, vocab_size)"
        return ""

    def rope(self) -> RopeSpec:
        """The rotation the kept keys get (``kernels.rope``)."""
        from kvtierd.kernels.rope import RopeSpec

        if self.refused:
            raise InvalidArgumentError(self.refused)
        if self.style != "neox":
            raise InvalidArgumentError(f"model {self.model}: rope style {self.style!r} is not neox")
        return RopeSpec(inv_freq=self.inv_freq, head_dim=self.head_dim)


def _text(x: object, name: str) -> str:
    if not isinstance(x, str) or len(x) > MAX_CARD_TEXT:
        raise TypeError(f"{name} must be a string of at most {MAX_CARD_TEXT} characters")
    return x


def _integer(x: object, name: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"{name} must be an integer, got {type(x).__name__}")
    return x


def _number(x: object, name: str) -> float:
    if not isinstance(x, int | float) or isinstance(x, bool):
        raise TypeError(f"{name} must hold numbers, got {type(x).__name__}")
    return float(x)


def _array(x: object, name: str) -> list[object]:
    if not isinstance(x, list):
        raise TypeError(f"{name} must be a list, got {type(x).__name__}")
    return x
