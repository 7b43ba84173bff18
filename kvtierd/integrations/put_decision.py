"""Which context one put's chunks join, and the form they are stored in (the put decision).

**Context ids.** A put is the chunks one request stores (LMCache skips the prefix it loaded or
stored before). Its context is, in this order:

1. the request's ``lmcache.tag.kvtierd_context`` (the router names token-dropped contexts);
2. the daemon's answer from the chunk before the put's first one (``after_key`` of
   ``KVStore.Advise``; the plugin learns which chunk comes before which from the prompt's
   lookup, :class:`ContextLinks`): when that chunk ends its context, the put extends it and
   joins it (a longer prompt; a request's later put when vLLM prefills its prompt in several
   steps, chunked prefill); when it is inside its context, the put branches off a shared
   prefix: the daemon splits that context there and the put becomes a child context of the
   prefix, keyed by its first new chunk (``kvtierd/engine/tree_joins.py``). Its chunks carry
   the parent (``parent_context_id``), so the placer places a child only with its prefix
   (LMCache only ever loads a chunk after its whole prefix). A rewritten placeholder
   request's put continues the placeholder variant's context the plugin saw it load;
3. the key of the put's first new chunk (a new root context).

**Form.** A request tag ``lmcache.tag.kvtierd_variant`` or a fixed ``kvtierd.variant`` forces
one; otherwise the daemon's write advice for the context (``KVStore.Advise``, docs/daemon.md). The
plugin applies the advice's quantization (int8/int4) to every chunk before shipping it. It cannot
drop tokens: that needs the router's placeholder identity and the context's token count, and
vLLM maps KV slot ``i`` to prompt position ``i`` (DESIGN.md §1). So advice such as
``knorm@0.5+int8`` is applied as ``int8``, ``knorm@0.5`` as the original, with a note the
plugin logs once per context; the daemon compresses the context itself when it places it
(from the int8 chunks when it keeps no copy of the original: docs/daemon.md, "its own source").

**One form per context.** When the daemon holds the context (advice source ``placed``) in a form
other than the one the chunks will have (a forced variant, or a token-dropped placement whose
original chunk keys no longer hit), the chunks go to ``<context>/<form>``: the daemon never
holds a context whose objects disagree with its variant. A rewritten placeholder request's new
chunks (its suffix) are computed on top of the placeholder chunks: they continue that
variant's context and are recorded in its variant (``knorm@0.5``), encoded as its quantization
part says.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtierd.types import ORIGINAL_VARIANT
from kvtierd.variants import parse_variant

if TYPE_CHECKING:
    from kvtierd.rpc import kvtier_pb2 as pb


@dataclass(frozen=True, slots=True)
class PutDecision:
    """What one put stores: the context its chunks join, the variant the daemon records for
    them, how each chunk is encoded (``quant``, ``""`` = as it is), whether that came from the
    daemon's write advice (``advised``), and why the advice was only partly applied (``note``,
    ``""`` when whole)."""

    context_id: str
    variant: str
    quant: str
    advised: bool
    note: str = ""
    parent: str = ""  # the context ``context_id`` continues ("" = a root; issue 29)


def decide(
    base_context: str, forced: str, advice: pb.WriteAdvice, *, rewritten: bool = False
) -> PutDecision:
    """The decision for one put (module docstring): ``forced`` is a tag's or the config's
    variant (``""`` = ask the daemon), ``advice`` the daemon's write advice for ``base_context``;
    ``rewritten``: the put is a placeholder request's suffix."""
    wanted = parse_variant(forced or advice.variant)
    note = ""
    if not forced and wanted.drops_tokens:
        applied = wanted.quant or "the original"
        w = advice
        note = (
            f"the daemon advises {w.variant} ({w.source}: {w.reason}); the plugin cannot "
            "drop tokens (that needs the router's placeholder identity and the context's token "
            f"count), so it stores {applied} and the daemon compresses the context itself"
        )
    form = str(wanted) if rewritten else wanted.quant or ORIGINAL_VARIANT
    context_id = base_context
    if advice.source == "placed" and str(parse_variant(advice.variant)) != form:
        context_id = f"{base_context}/{form}"
    parent = advice.parent_context_id
    return PutDecision(context_id, form, wanted.quant, not forced, note, parent)


class ContextLinks:
    """Which context a put continues (module docstring, rule 2), from what the plugin saw.

    A lookup of a prompt's chunk keys that hits ``h`` of them links each missing key to the
    key before it; a load (or a put) tells the context of the keys it touched (a put: its first
    and last). A later put whose first key was such a missing key continues the context of the
    key before it: a longer prompt's put after its loaded prefix, or a request's next put after
    its previous one (chunked prefill). Bounded (least recently recorded entries go first;
    ``capacity`` keys a table, enough for the missing chunks of many long prompts) and
    thread-safe: lookups, loads and puts run on different LMCache threads.
    """

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        self._previous: OrderedDict[str, str] = OrderedDict()  # first missing key -> last hit
        self._context_of: OrderedDict[str, str] = OrderedDict()  # chunk key -> context id
        self._lock = threading.Lock()

    def _remember(self, table: OrderedDict[str, str], key: str, value: str) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def looked_up(self, keys: Sequence[str], prefix_hits: int) -> None:
        if len(keys) > max(prefix_hits, 1):
            with self._lock:
                for i in range(max(prefix_hits, 1), len(keys)):
                    self._remember(self._previous, keys[i], keys[i - 1])

    def touched(self, key: str, context_id: str) -> None:
        """``key`` belongs to ``context_id`` (a loaded or stored chunk)."""
        with self._lock:
            self._remember(self._context_of, key, context_id)

    def context_of(self, key: str) -> str:
        """The context a stored or loaded chunk ``key`` belongs to, ``""`` if not seen."""
        with self._lock:
            return self._context_of.get(key, "")

    def previous(self, keys: Sequence[str], start: int) -> str:
        """The key of the chunk before ``keys[start]``, ``""`` if not known: ``keys[start - 1]``
        when the put itself starts earlier, else the key a lookup found before ``keys[0]``."""
        if start > 0:
            return keys[start - 1]
        with self._lock:
            return self._previous.get(keys[0], "")

    def continued(self, keys: Sequence[str], start: int) -> str:
        """The context a put storing ``keys[start:]`` continues, or ``""``: that of
        ``keys[start - 1]`` when the put itself starts earlier (LMCache re-puts stored chunks),
        else that of the key a lookup found before ``keys[0]``."""
        with self._lock:
            previous = keys[start - 1] if start > 0 else self._previous.get(keys[0])
            return self._context_of.get(previous, "") if previous is not None else ""
