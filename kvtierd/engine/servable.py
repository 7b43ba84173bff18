"""Whether the daemon can store a context's token-dropped variant in the servable form
(``kernels/placeholder.py``), and what that form is built from.

vLLM loads a token-dropped context only as ``[M placeholder ids] + suffix`` through
``kvtierd router``, which finds it by the digest of the context's tokens. So the daemon can
write such a variant only when it knows

* the model (the name in the context's LMCache chunk keys) and its :class:`ModelCard`, which
  the LMCache plugin registers when vLLM starts (rope, vocabulary); a model whose position
  encoding a constant rotation cannot move exactly is refused;
* the context's token ids: the router registers every prompt it forwards, the plugin links it
  to the context (``KVStore.SetContextTokens``, prompt links). ``N``, the tokens the variant
  covers, is the longest whole-chunk prefix of the context that every registered prompt
  agrees on, short of each prompt's last token (a rewrite keeps at least one token of
  suffix) — so the digest is of exactly the tokens whose KV it holds. One prompt does not say
  where the reusable part ends (a document, or the document and its question?), so prompts
  fix ``N`` from the second one on: a document asked two questions covers the document. Ids
  given as the context's own (``SetContextTokens`` with a context id) fix it at once;
* a kept count ``M`` of whole chunks (a page method keeps whole pages, which are whole chunks
  only by chance);
* for snapkv, the checkpoint in the policy's ``profiling.model_dir``, whose weights recompute
  the queries of the ``N`` tokens' last window (``window.py``).

Until then the placer is not offered the variant (``ContextOptions.grid``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtierd.engine.profiling.observation_window import window_of
from kvtierd.errors import CorruptObjectError, InvalidArgumentError
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import ModelCard, kept_tokens, lmcache_model
from kvtierd.policy_config import SNAPKV_NEEDS_MODEL
from kvtierd.router_protocol import context_digest
from kvtierd.types import ObjectMeta
from kvtierd.variants import parse_variant

if TYPE_CHECKING:
    from kvtierd.profiler.queries import QueryStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServableForm:
    """A token-dropped variant's servable form: the first ``num_tokens`` tokens of the context
    (``num_chunks`` whole chunks of ``chunk_tokens``, ``num_kv_heads`` KV heads), kept
    ``num_kept``, named ``digest`` (set once the tokens are read). snapkv: the checkpoint
    that recomputes its window queries (``model_dir``) and the window's token ids, the last
    of the ``num_tokens`` (``window_ids``, set with the digest)."""

    model: str
    num_tokens: int
    num_chunks: int
    chunk_tokens: int
    num_kv_heads: int
    num_kept: int
    card: ModelCard
    digest: str = ""
    model_dir: str = ""
    window_ids: tuple[int, ...] = ()


def leading_chunks(originals: Sequence[ObjectMeta]) -> tuple[ChunkFormat | None, int]:
    """The format of the first chunk and how many chunks of its size lead the context
    (``(None, 0)`` when its first object is not a chunk)."""
    first: ChunkFormat | None = None
    count = 0
    for meta in originals:
        try:
            fmt = ChunkFormat.parse(meta.layout)
        except CorruptObjectError:
            break
        if first is not None and fmt.shape[2] != first.shape[2]:
            break
        first, count = first or fmt, count + 1
    return first, count


def servable_form_of(
    variant: str,
    originals: Sequence[ObjectMeta],
    agreed_tokens: int,
    cards: Mapping[str, ModelCard],
    model_dir: str = "",
    *,
    lead: tuple[ChunkFormat | None, int] | None = None,
) -> ServableForm | str:
    """The servable form of ``variant`` for a context whose original objects are
    ``originals`` and whose registered prompts agree on their first ``agreed_tokens`` tokens,
    or why there is none (module docstring); without its digest, which needs the token ids.
    ``model_dir``: the policy's, which snapkv needs."""
    model = lmcache_model(originals[0].key) if originals else ""
    if not model:
        return "its objects are not LMCache chunks (keys model@world@worker@hash@dtype)"
    card = cards.get(model)
    if card is None:
        return (
            f"no model card for {model} (the kvtierd LMCache plugin registers it when vLLM starts)"
        )
    if card.refused:
        return card.refused
    if _window(variant) and not model_dir:
        return SNAPKV_NEEDS_MODEL
    fmt, count = leading_chunks(originals) if lead is None else lead
    if fmt is None:
        return "its first object is not a KV_2LTD chunk"
    chunk = fmt.shape[2]
    chunks = min(count, agreed_tokens // chunk)
    if not chunks:
        return (
            "no token ids agreed for its first chunk (kvtierd router registers the prompts it "
            "forwards, and two of them fix where the context ends; requests sent to vLLM "
            "directly leave them unknown)"
        )
    n = chunks * chunk
    m = _kept(variant, n, chunk)
    if m % chunk:
        return f"{variant} keeps {m} of {n} tokens, not whole chunks of {chunk}"
    return ServableForm(model, n, chunks, chunk, fmt.num_kv_heads, m, card, model_dir=model_dir)


@functools.lru_cache(maxsize=1 << 16)
def _kept(variant: str, num_tokens: int, chunk_tokens: int) -> int:
    """``kept_tokens``, once per (variant, length): every context's options ask for it."""
    return kept_tokens(num_tokens, parse_variant(variant), chunk_tokens)


@functools.lru_cache(maxsize=4096)
def _window(variant: str) -> int:
    return window_of(variant)


def agreed_prefix(known: Sequence[int], new: Sequence[int]) -> int:
    """How many leading token ids ``known`` and ``new`` share."""
    n = min(len(known), len(new))
    if not n:
        return 0
    a = np.asarray(known[:n], dtype=np.int64)
    b = np.asarray(new[:n], dtype=np.int64)
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else n


class Servability:
    """Per context: the leading token ids its registered prompts agree on, and why its
    token-dropped variants are left out of its options (for DescribeContext). ``agree`` runs on
    the profiling service's queries thread, the rest on the event loop (one dict item each)."""

    def __init__(
        self, cards: Mapping[str, ModelCard], model_dir: Callable[[], str] = lambda: ""
    ) -> None:
        self.cards = cards  # the engine's: model name -> the card its plugin registered
        # the running policy's profiling.model_dir (snapkv's window queries), read at each
        # call: a policy being applied is weighed before the profiler is rebuilt for it
        self.model_dir = model_dir
        self._agreed: dict[str, int] = {}
        self._prompts: dict[str, int] = {}  # prompts agreed so far; -1: ids given as context's
        self.why: dict[str, str] = {}

    def agree(
        self, context_id: str, queries: QueryStore, tokens: Sequence[int], *, prompt: bool
    ) -> None:
        """Narrow the agreed prefix to what ``tokens`` (about to be stored) shares with the
        ids known; ``prompt``: a registered prompt, else ids given as the context's."""
        known = queries.tokens(context_id, queries.known_tokens(context_id))
        common = agreed_prefix(known, tokens) if known else len(tokens)
        self._agreed[context_id] = min(self._agreed.get(context_id, common), common)
        seen = self._prompts.get(context_id, 0)
        self._prompts[context_id] = seen + 1 if prompt and seen >= 0 else -1

    def agreed(self, context_id: str, queries: QueryStore) -> int:
        """Leading token ids the registrations agree on, once they say where the context ends
        (module docstring); ids an earlier run kept count as agreed (which prompts gave them is
        not kept)."""
        agreed = self._agreed.get(context_id)
        if agreed is None:
            return queries.known_tokens(context_id)
        return agreed if self._prompts.get(context_id, 0) not in (0, 1) else 0

    def options(
        self,
        context_id: str,
        stored_as: str,
        lossy: list[str],
        originals: Sequence[ObjectMeta],
        queries: QueryStore,
    ) -> list[str]:
        """``lossy`` less the token-dropped variants that cannot be served yet (the one the
        context is stored as stays); the first reason is kept in :attr:`why`."""
        out, why = [], ""
        lead: tuple[ChunkFormat | None, int] | None = None
        agreed = 0
        for name in lossy:
            if name != stored_as and parse_variant(name).drops_tokens:
                if lead is None:  # once per context, not per variant: a pass over its chunks
                    lead, agreed = leading_chunks(originals), self.agreed(context_id, queries)
                form = servable_form_of(name, originals, agreed, self.cards, self.model_dir(),
                                        lead=lead)  # fmt: skip
                if isinstance(form, str):
                    why = why or f"{name}: {form}"
                    continue
            out.append(name)
        if why:
            self.why[context_id] = why
        else:
            self.why.pop(context_id, None)
        return out

    def form(
        self,
        context_id: str,
        variant: str,
        originals: Sequence[ObjectMeta],
        queries: QueryStore,
    ) -> ServableForm:
        """The servable form of ``variant`` with its digest, or ``InvalidArgumentError``."""
        agreed = self.agreed(context_id, queries)
        form = servable_form_of(variant, originals, agreed, self.cards, self.model_dir())
        if isinstance(form, str):
            # kept as why its options changed: ids that arrive later place it again
            self.why[context_id] = f"{variant}: {form}"
            raise InvalidArgumentError(
                f"context {context_id!r}: {variant} cannot be served: {form}"
            )
        tokens = queries.tokens(context_id, form.num_tokens)
        if len(tokens) != form.num_tokens:
            raise InvalidArgumentError(f"context {context_id!r}: its token ids are gone")
        window = min(window_of(variant), form.num_tokens)
        ids = tuple(tokens[form.num_tokens - window :]) if window else ()
        return replace(form, digest=context_digest(form.model, tokens), window_ids=ids)

    def forget(self, context_id: str) -> None:
        self._agreed.pop(context_id, None)
        self._prompts.pop(context_id, None)
        self.why.pop(context_id, None)


def _cards_dir(data_dir: str) -> Path:
    return Path(data_dir) / "model_cards"


def card_tenant(name: str, tenants: Collection[str]) -> str:
    """The tenant a kept card belongs to (its name is ``<tenant>/<model>``, ``<model>`` for
    the default tenant's, whose model names may hold a ``/`` too): ``""`` for the default."""
    owner, sep, _ = name.partition("/")
    return owner if sep and owner in tenants else ""


def save_card(data_dir: str, card: ModelCard) -> None:
    """Keep ``card`` across restarts (a plugin registers it only when vLLM starts)."""
    folder = _cards_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(card.model.encode()).hexdigest()[:16]
    tmp = folder / f".{name}.tmp"
    tmp.write_bytes(card.to_bytes())
    os.replace(tmp, folder / f"{name}.json")


def load_cards(data_dir: str) -> dict[str, ModelCard]:
    """The cards kept by :func:`save_card`, by model name (an unreadable one is skipped)."""
    out = {}
    folder = _cards_dir(data_dir)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            card = ModelCard.from_bytes(path.read_bytes())
        except (OSError, InvalidArgumentError) as e:
            logger.warning("model card %s ignored: %s", path, e)
            continue
        out[card.model] = card
    return out
