"""Prompts the router registers with the daemon, so that it can profile what they read.

The daemon's ``engine`` evaluator needs a context's token ids and real queries of it; LMCache
gives the daemon only chunk hashes. The router knows each prompt's tokens but not the context
ids LMCache's chunks are stored under; the LMCache plugin knows those but never sees tokens.
So the router registers the prompt under a fresh request id (``KVStore.SetContextTokens``,
``note_prompt``) and passes the id to the plugin as ``lmcache.tag.kvtierd_request``; the plugin
names the context the request stored or read (``link_prompt``, ``prompt_links.py``).

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


class PromptNote:
    """One request's registration, started at once and collected when the request is sent."""

    def __init__(self, client: AsyncKVClient, token_ids: list[int]) -> None:
        self.request_id = uuid.uuid4().hex
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

    def cancel(self) -> None:
        """The request is not sent (refused before vLLM): drop a registration in flight."""
        self._task.cancel()
