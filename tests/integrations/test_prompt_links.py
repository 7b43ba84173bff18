"""What the router and the plugin report to the daemon about prompts, without vLLM: the router's
best-effort registration (``router/prompts.py``) and the plugin's links (``prompt_links.py``)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvtierd.errors import NotFoundError, UnavailableError
from kvtierd.integrations.plugin_settings import PluginStats
from kvtierd.integrations.prompt_links import PromptLinks
from kvtierd.integrations.put_decision import ContextLinks
from kvtierd.integrations.router import prompts
from kvtierd.integrations.router.prompts import REQUEST_TAG, PromptNote


class FakeDaemon:
    """``note_prompt`` / ``link_prompt`` as the daemon answers them (NOT_FOUND when unknown)."""

    def __init__(self, fail: BaseException | None = None, delay_s: float = 0.0) -> None:
        self.fail, self.delay_s = fail, delay_s
        self.prompts: dict[str, list[int]] = {}
        self.links: list[tuple[str, str]] = []

    async def note_prompt(self, request_id: str, token_ids: list[int]) -> None:
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        self.prompts[request_id] = token_ids

    def link_prompt(self, context_id: str, request_id: str) -> None:
        if request_id not in self.prompts:
            raise NotFoundError(f"no prompt registered for request {request_id!r}")
        self.links.append((context_id, request_id))


async def test_a_registered_prompt_tags_the_request() -> None:
    daemon = FakeDaemon()
    note = PromptNote(daemon, [1, 2, 3])  # type: ignore[arg-type]
    assert await note.tags() == {REQUEST_TAG: note.request_id}
    assert daemon.prompts == {note.request_id: [1, 2, 3]}


@pytest.mark.parametrize(
    "daemon", [FakeDaemon(fail=UnavailableError("daemon down")), FakeDaemon(delay_s=5.0)]
)
async def test_a_failed_registration_sends_the_request_untagged(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(prompts, "NOTE_TIMEOUT_S", 0.05)
    note = PromptNote(daemon, [1, 2, 3])  # type: ignore[arg-type]
    assert await note.tags() == {}
    assert "not registered" in caplog.text
    note.cancel()


class AsyncLinks(FakeDaemon):
    async def link_prompt(self, context_id: str, request_id: str) -> None:  # type: ignore[override]
        super().link_prompt(context_id, request_id)


async def test_a_link_keeps_the_registration_the_request_no_longer_waits_for() -> None:
    """The router links a prompt served from a variant after answering it: the request's
    ``cancel`` must not drop a registration still in flight, or the link finds no prompt."""
    daemon = AsyncLinks(delay_s=0.2)
    note = PromptNote(daemon, [1, 2, 3])  # type: ignore[arg-type]
    task = note.link(daemon, "ctx")  # type: ignore[arg-type]
    note.cancel()  # the request is answered; the registration is still under way
    await task
    assert daemon.links == [("ctx", note.request_id)]
    unlinked = PromptNote(daemon, [4])  # type: ignore[arg-type]
    unlinked.cancel()
    await asyncio.sleep(0.3)
    assert unlinked.request_id not in daemon.prompts  # without a link it is dropped


async def test_a_failed_link_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    daemon = AsyncLinks()
    note = PromptNote(daemon, [1])  # type: ignore[arg-type]
    await note.tags()
    daemon.prompts.clear()  # the daemon restarted and forgot it
    await note.link(daemon, "ctx")  # type: ignore[arg-type]
    assert daemon.links == [] and "not linked to context ctx: NotFoundError" in caplog.text


def key(request: str = "", **tags: str) -> Any:
    all_tags = {**tags, **({"kvtierd_request": request} if request else {})}
    return SimpleNamespace(tags=tuple(all_tags.items()))


def _links(daemon: FakeDaemon) -> tuple[PromptLinks, ContextLinks, PluginStats]:
    contexts, stats = ContextLinks(), PluginStats()
    return PromptLinks(daemon, contexts, stats, threading.Lock()), contexts, stats  # type: ignore[arg-type]


def test_a_prompt_is_linked_once_to_the_context_of_its_first_chunk() -> None:
    daemon = FakeDaemon()
    daemon.prompts = {"r1": [1], "r2": [2]}
    links, contexts, stats = _links(daemon)
    links.looked_up(key("r1"), "k0")  # a miss: the context is not known yet
    contexts.touched("k3", "k0")  # the put of chunks 0-3 (its last chunk)
    links.report(key("r1"))
    assert daemon.links == []  # the first chunk's context is what counts
    contexts.touched("k0", "k0")
    links.report(key("r1"))
    links.report(key("r1"))  # a later load or put of the same request: already linked
    links.looked_up(key("r2"), "k0")  # a hot context: linked at the lookup
    links.looked_up(key(), "k0")  # untagged: nothing to link
    links.looked_up(key("r3", kvtierd_scope="s"), "k0")  # a profiling request
    links.looked_up(key("r4", kvtierd_placeholder_tokens="16"), "k0")  # a rewritten one
    links.close(wait=True)
    assert daemon.links == [("k0", "r1"), ("k0", "r2")]
    assert (stats.prompt_links, stats.prompt_link_errors) == (2, 0)


def test_a_refused_link_is_counted_never_raised() -> None:
    daemon = FakeDaemon()
    links, contexts, stats = _links(daemon)
    contexts.touched("k0", "ctx")
    links.looked_up(key("unknown"), "k0")
    links.close(wait=True)
    assert (stats.prompt_links, stats.prompt_link_errors) == (0, 1)
    assert "NotFoundError" in stats.last_error
