"""Prompts the router registers with the daemon, so that it can profile what they read.

The daemon's ``served`` evaluator needs a context's token ids and real queries of it; LMCache
gives the daemon only chunk hashes. The router knows each prompt's tokens but not the context
ids LMCache's chunks are stored under; the LMCache plugin knows those but never sees tokens.
So the router registers the prompt under a fresh request id (``KVStore.SetContextTokens``,
``note_prompt``) and passes the id to the plugin as ``lmcache.tag.kvtierd_request``; the plugin
names the context the request stored or read (``link_prompt``, ``prompt_links.py``).

A request served from a token-dropped variant carries placeholder ids, so the plugin cannot
link it; the router links its real prompt to the variant's source context itself
(:meth:`PromptNote.link`, the manifest's ``source_context``) once vLLM has answered.

Registration is best effort: it never fails or holds up a user request. It runs while the
router does its own work for the request (manifest lookups), is awaited for at most
:data:`NOTE_TIMEOUT_S`, and a daemon that is down, slow or refuses only costs the tag (logged).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from kvtierd.client import AsyncKVClient
from kvtierd.integrations.plugin_settings import PROMPT_TAG

logger = logging.getLogger(__name__)

NOTE_TIMEOUT_S = 1.0
"""How long a request waits for its prompt's registration before it goes out untagged."""
REQUEST_TAG = f"lmcache.tag.{PROMPT_TAG}"
LINK_TIMEOUT_S = 10.0
"""How long a background link of a served prompt may take before it is given up (logged)."""


class PromptNote:
    """One request's registration, started at once and collected when the request is sent."""

    def __init__(self, client: AsyncKVClient, token_ids: list[int]) -> None:
        self.request_id = uuid.uuid4().hex
        self._linking = False
        self._task = asyncio.ensure_future(self._note(client, token_ids))

    async def _note(self, client: AsyncKVClient, token_ids: list[int]) -> str:
        """``""`` once registered, else why not (a user request never fails for it)."""
        try:
            await client.note_prompt(self.request_id, token_ids)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return ""

    async def tags(self) -> dict[str, str]:
        """``kv_transfer_params`` naming the registered prompt; ``{}`` if it was not registered
        (the request is then served as it would be without the registration)."""
        try:
            why = await asyncio.wait_for(self._task, NOTE_TIMEOUT_S)
        except TimeoutError:
            why = f"no answer in {NOTE_TIMEOUT_S}s"
        if why:
            logger.warning(
                "prompt of request %s not registered with the daemon (%s); it is served, but "
                "the daemon will not learn its context's tokens nor record it as a query",
                self.request_id, why,
            )  # fmt: skip
            return {}
        return {REQUEST_TAG: self.request_id}

    def link(self, client: AsyncKVClient, context_id: str) -> asyncio.Future[None]:
        """Link the registered prompt to ``context_id`` (``link_prompt``) in the background:
        for a request the plugin cannot link, one served from a variant built from that
        context. Best effort: logged, never raised. The registration is no longer cancelled."""
        self._linking = True
        return asyncio.ensure_future(self._link(client, context_id))

    async def _link(self, client: AsyncKVClient, context_id: str) -> None:
        if not await self.tags():
            return  # not registered: already logged
        try:
            await asyncio.wait_for(client.link_prompt(context_id, self.request_id), LINK_TIMEOUT_S)
        except Exception as e:
            logger.warning("prompt of request %s not linked to context %s: %s: %s",
                           self.request_id, context_id, type(e).__name__, e)  # fmt: skip

    def cancel(self) -> None:
        """Nothing waits for the registration any more: drop it if still in flight (unless a
        :meth:`link` needs it)."""
        if not self._linking:
            self._task.cancel()
