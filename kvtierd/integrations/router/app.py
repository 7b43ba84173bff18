# Long because each OpenAI route is here beside the request rewriting it shares.
"""``kvtierd router``: an OpenAI-compatible HTTP proxy in front of ``vllm serve``.

``/v1/completions`` and ``/v1/chat/completions`` (streaming or not) go to vLLM; a request whose
prompt starts with a context stored compressed is sent as ``[M placeholder ids] + suffix``
with the context named in ``kv_transfer_params`` (``rewrite.py``). If vLLM fails such a request
(its ``kv_load_failure_policy`` is ``fail`` by default: a failed load is an error, never a
prefill of placeholder ids), the router sends the real prompt. A streamed answer is held back
until vLLM's first event: the KV load happens before the first token, so a failed load shows
there (HTTP status, an ``error`` event, or an ``error``/``abort`` finish reason) and the real
prompt can still be sent. A failure after the first event reaches the client as vLLM sent it:
tokens already streamed cannot be taken back. A request may carry
``"kvtierd": {"context_tokens": N, "variant": "knorm@0.5"}`` to have its first ``N`` tokens
stored in that variant; it is answered once the variant is checked to be in the daemon, or with
an error saying why not (``store.py``). With ``"scope": s`` the context is stored under a
scoped identity no production prompt is rewritten to, and ``"kvtierd": {"scope": s,
"variant": v}`` loads it (``kvtierd.router_protocol``). Chat requests are rewritten after
vLLM's chat template (``/tokenize`` with ``messages``) and sent as completions, answered in
chat format. Every real-traffic prompt sent as it is (plain, store, or a rewrite's fallback; not
a scoped profiling request) is registered with the daemon and tagged, best effort, so that the
daemon learns its context's tokens and records it as a query (``prompts.py``).

Serving does not depend on the daemon: a request whose manifests it cannot look up (daemon down,
failing, or silent for ``lookup_timeout_s``) goes out as the real prompt, logged and counted in
``/health``'s ``lookup_errors``; only a store request, which needs the daemon, is refused (503).
So the router is ready (``/readyz``, ``/health``) whenever vLLM is, with the daemon's state
reported beside it (``probes.py``). A malformed request is a 400, an unreachable vLLM a 502.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvtierd.client import AsyncKVClient
from kvtierd.errors import AlreadyExistsError, InvalidArgumentError, KvtierError
from kvtierd.integrations.router.in_flight import InFlightReporter
from kvtierd.integrations.router.probes import (
    PROBE_PATHS,
    Readiness,
    RouterCounts,
    metrics_text,
    readiness,
)
from kvtierd.integrations.router.prompts import PromptNote
from kvtierd.integrations.router.rewrite import Rewrite, find_rewrite
from kvtierd.integrations.router.store import (
    KEPT_HEADER,
    StoreTarget,
    checked_variant,
    prepare_store,
    store_failure,
)
from kvtierd.integrations.router.timing import StreamTiming
from kvtierd.integrations.salt import salt_key_prefix
from kvtierd.router_protocol import LOADED_HEADER, ContextRequest, loaded_value

logger = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 10.0  # a served request's timing to the daemon (background)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    upstream: str  # e.g. http://127.0.0.1:8000
    socket_path: str
    chunk_tokens: int = 256
    hold_s: float = 30.0
    lookup_timeout_s: float = 2.0  # a request waits this long for its manifest lookup
    tenant: str = ""  # the daemon tenant the router stores and looks up contexts as
    api_token: str = ""  # when set, every request needs "Authorization: Bearer <api_token>"


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._client: AsyncKVClient | None = None
        self.session: aiohttp.ClientSession | None = None
        self.model_root = ""
        self.rewrites = 0
        self.fallbacks = 0
        self.lookup_errors = 0  # requests sent as they are because the daemon did not answer
        self._links: set[asyncio.Future[None]] = set()  # PromptNote.link tasks in flight
        # real-traffic requests at vLLM, reported to the daemon (its profiling waits for 0)
        self.in_flight = InFlightReporter(lambda: self.client)

    @property
    def client(self) -> AsyncKVClient:
        # grpc.aio channels belong to the loop they are made on: make it inside the server's.
        if self._client is None:
            self._client = AsyncKVClient(self.config.socket_path or None, tenant=self.config.tenant)
        return self._client

    @property
    def http(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        return self.session

    async def _root(self) -> str:
        """The model path vLLM loaded (LMCache's model name, part of every context digest)."""
        if not self.model_root:
            async with self.http.get(f"{self.config.upstream}/v1/models") as r:
                self.model_root = str((await r.json())["data"][0]["root"])
        return self.model_root

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        req: dict[str, Any] = {"model": body.get("model", "")}
        if "messages" in body:
            req.update(messages=body["messages"], add_generation_prompt=True)
        elif "prompt" not in body:
            raise InvalidArgumentError("the request has no 'prompt' (chat requests: 'messages')")
        elif isinstance(body["prompt"], list) and all(isinstance(x, int) for x in body["prompt"]):
            return list(body["prompt"])
        else:
            req["prompt"] = body["prompt"]
        async with self.http.post(f"{self.config.upstream}/tokenize", json=req) as r:
            if r.status != 200:  # vLLM's reason, not only its status line
                message = f"vLLM /tokenize: {(await r.text())[:500]}"
                raise aiohttp.ClientResponseError(
                    r.request_info, r.history, status=r.status, message=message
                )
            return [int(x) for x in (await r.json())["tokens"]]

    # -- handlers ----------------------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        """Liveness: this answer itself (``probes.py``)."""
        return web.json_response({"status": "alive"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: vLLM answers; the daemon's state beside it (``probes.py``)."""
        state = await self._readiness()
        return web.json_response(state.body(), status=200 if state.ready else 503)

    async def health(self, request: web.Request) -> web.Response:
        """``/readyz``'s answer with the router's counters."""
        state = await self._readiness()
        c = self._counts()
        body = {**state.body(), "rewrites": c.rewrites, "fallbacks": c.fallbacks,
                "lookup_errors": c.lookup_errors}  # fmt: skip
        return web.json_response(body, status=200 if state.ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = metrics_text(await self._readiness(), self._counts())
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})  # fmt: skip

    async def _readiness(self) -> Readiness:
        return await readiness(self.http, self.config.upstream, self.client)

    def _counts(self) -> RouterCounts:
        return RouterCounts(self.rewrites, self.fallbacks, self.lookup_errors)

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._forward("/v1/models", None, request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(request, chat=True)

    async def _counted(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        """:meth:`_generate`, counted in flight unless it is a profiler's scoped request
        (``in_flight.py``; the body is read once, aiohttp keeps it for ``_generate``)."""
        if await _scoped(request):
            return await self._generate(request, chat=chat)
        with self.in_flight.request():
            return await self._generate(request, chat=chat)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        note: PromptNote | None = None
        try:
            try:
                body = _client_params(await _json_object(request))
                salt = _salt_prefix(body)
                field = body.pop("kvtierd", None)
                spec = ContextRequest() if field is None else ContextRequest.from_json(field)
                tokens = await self._tokenize(body)
                # Real traffic only: a scoped request is a profiler's (router_protocol).
                note = None if spec.scope else PromptNote(self.client, tokens)
                model = await self._root()
                if spec.is_store:
                    if body.get("stream"):
                        raise InvalidArgumentError(
                            "a store request (kvtierd.context_tokens) cannot be streamed: the "
                            "router answers it only once it has checked that the variant is "
                            "stored"
                        )
                    target = await prepare_store(
                        self.client, model, tokens, spec, self.config.chunk_tokens, salt=salt
                    )
                    return await self._store(path, body, target, request, note)
                rw = await self._find_rewrite(model, tokens, spec, salt)
            except AlreadyExistsError as e:
                return _error(str(e), 409)
            except aiohttp.ClientResponseError as e:  # vLLM refused what the router asked
                return _error(e.message, e.status if 400 <= e.status < 500 else 502)
            except aiohttp.ClientError as e:
                return _error(f"vLLM at {self.config.upstream}: {type(e).__name__}: {e}", 502)
            except (ValueError, KeyError) as e:  # InvalidArgumentError too
                return _error(str(e), 400)
            except KvtierError as e:  # the daemon, which a store request needs
                return _error(str(e), 503)
            if rw is None:
                return await self._forward(path, await _tagged(body, note), request)
            return await self._rewritten(body, rw, request, chat=chat, note=note)
        finally:
            if note is not None:
                note.cancel()  # sent or refused by now: nothing waits for the registration

    async def _find_rewrite(
        self, model: str, tokens: list[int], spec: ContextRequest, salt: str
    ) -> Rewrite | None:
        """A production request loads whatever its context is stored as; a scoped one only
        the variant it names, else nothing (``kvtierd.router_protocol``); a salted one only
        what was stored under its salt (``salt``: its key prefix)."""
        if spec.scope and not spec.variant:
            return None
        variant = str(checked_variant(spec.variant)) if spec.variant else ""
        c = self.config
        lookup = find_rewrite(
            self.client, model, tokens, c.chunk_tokens, c.hold_s, scope=spec.scope,
            variant=variant, salt=salt,
        )  # fmt: skip
        # A production request is better served now from its real prompt than late; a scoped
        # one (a profiler's) is worth nothing without its variant, so it waits for the daemon.
        timeout = None if spec.scope else c.lookup_timeout_s
        try:
            return await asyncio.wait_for(lookup, timeout)
        except TimeoutError:
            why = f"kvtierd did not answer in {c.lookup_timeout_s:g} s"
        except KvtierError as e:
            why = str(e)
        # Serving never needs the daemon: the real prompt is always safe (fail closed).
        self.lookup_errors += 1
        logger.warning("no manifest lookup for a prompt of %d tokens (%s); sending the real "
                       "prompt", len(tokens), why)  # fmt: skip
        return None

    async def _store(
        self,
        path: str,
        body: dict[str, Any],
        target: StoreTarget,
        request: web.Request,
        note: PromptNote | None,
    ) -> web.StreamResponse:
        """Forward a store request; a 502 with the reason if vLLM answered but the variant was
        not stored (``store.py``)."""
        tags = target.tags | (await note.tags() if note is not None else {})
        answer = await self._forward(path, _with_params(body, tags), request)
        if answer.status != 200:
            return answer
        why = await store_failure(self.client, target)
        if why:
            logger.error("store request: %s", why)
            return _error(why, 502)
        if target.kept_tokens:
            answer.headers[KEPT_HEADER] = str(target.kept_tokens)
        return answer

    async def _rewritten(
        self,
        body: dict[str, Any],
        rw: Rewrite,
        request: web.Request,
        *,
        chat: bool,
        note: PromptNote | None,
    ) -> web.StreamResponse:
        """Send ``[placeholder ids] + suffix``; the real prompt if vLLM fails it. Only the real
        prompt is reported to the daemon (``note``): the rewritten one reads a token-dropped
        variant, whose KV is not the context's and whose prompt is not its tokens. Served from
        the variant, the real prompt is linked to the context the variant was built from."""
        new = {k: v for k, v in body.items() if k not in ("messages", "prompt")}
        new["prompt"] = rw.prompt_ids
        new = _with_params(new, rw.kv_transfer_params)
        if body.get("stream"):
            streamed = await self._stream_rewritten(new, rw, request, chat=chat)
            if streamed is not None:
                self._link_source(note, rw)
                return streamed
            body = await _tagged(body, note)
            return await self._fallback(body, rw, "its first stream event", request, chat=chat)
        async with self.http.post(f"{self.config.upstream}/v1/completions", json=new) as r:
            try:
                data = await r.json(content_type=None)
            except ValueError:  # not JSON (content_type=None: any content type is parsed)
                data = {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            ok = r.status == 200 and isinstance(data, dict) and _choices_ok(data)
        if not ok:
            return await self._fallback(await _tagged(body, note), rw, data, request, chat=chat)
        self.rewrites += 1
        self._link_source(note, rw)
        return web.json_response(_as_chat(data) if chat else data, headers=_loaded(rw))

    def _link_source(self, note: PromptNote | None, rw: Rewrite) -> None:
        """Report a prompt served from a variant to the context the variant was built from
        (its tokens, and the rest of the prompt as a real query of it), in the background."""
        if note is None or not rw.manifest.source_context:
            return
        task = note.link(self.client, rw.manifest.source_context)
        self._links.add(task)
        task.add_done_callback(self._links.discard)

    async def _stream_rewritten(
        self, new: dict[str, Any], rw: Rewrite, request: web.Request, *, chat: bool
    ) -> web.StreamResponse | None:
        """Stream the rewritten request, answering the client only once vLLM's first data
        event shows the placeholder load worked; ``None`` (nothing sent) when it did not."""
        timing = StreamTiming(new)
        async with self.http.post(
            f"{self.config.upstream}/v1/completions", json=timing.body(new)
        ) as r:
            held: list[bytes] = []
            ok = False
            lines = _observed(r.content, timing)
            if r.status == 200:
                try:
                    async for line in lines:
                        held.append(line)
                        if line.startswith(b"data: "):
                            ok = _first_event_ok(line)
                            break
                except aiohttp.ClientError as e:
                    logger.warning("stream of %s broke before its first event: %s",
                                   rw.manifest.digest, e)  # fmt: skip
            if not ok:
                return None  # leaving the block closes the stream: vLLM aborts the request
            self.rewrites += 1
            headers = {"Content-Type": r.content_type, **_loaded(rw)}
            out = web.StreamResponse(status=200, headers=headers)
            await out.prepare(request)
            await _relay(out, _chained(held, lines), _chat_line if chat else None)
        self._report(timing)
        return out

    async def _fallback(
        self, body: dict[str, Any], rw: Rewrite, why: Any, request: web.Request, *, chat: bool
    ) -> web.StreamResponse:
        self.fallbacks += 1
        logger.warning("placeholder load of %s failed (%s); sending the real prompt",
                       rw.manifest.digest, why)  # fmt: skip
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await self._forward(path, body, request)

    async def _forward(
        self, path: str, body: dict[str, Any] | None, request: web.Request
    ) -> web.StreamResponse:
        """``body`` to vLLM's ``path`` as it is (``None``: a GET), its answer as vLLM gave it."""
        url = f"{self.config.upstream}{path}"
        method = "GET" if body is None else "POST"
        if body is None or not body.get("stream"):
            async with self.http.request(method, url, json=body) as r:
                payload = await r.read()
                return web.Response(body=payload, status=r.status, content_type=r.content_type)
        timing = StreamTiming(body)
        async with self.http.post(url, json=timing.body(body)) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.content_type})
            await out.prepare(request)
            await _relay(out, _observed(r.content, timing), None)
        if r.status == 200:
            self._report(timing)
        return out

    def _report(self, timing: StreamTiming) -> None:
        """A streamed request's timing to the daemon, in the background (best effort: the
        TTFT model keeps its configured prefill speed without it)."""
        sample = timing.sample()
        if sample is None:
            return

        async def report() -> None:
            try:
                await asyncio.wait_for(self.client.report_served(sample), REPORT_TIMEOUT_S)
            except (KvtierError, TimeoutError) as e:
                logger.debug("timing of a served request not reported: %s", e)

        task = asyncio.ensure_future(report())
        self._links.add(task)
        task.add_done_callback(self._links.discard)


async def _relay(
    out: web.StreamResponse,
    lines: AsyncIterable[bytes],
    convert: Callable[[bytes], bytes] | None,
) -> None:
    """vLLM's stream to the client, line by line. A client that closes its connection —
    typically right after ``data: [DONE]``, before the stream's end — is an ordinary end, not
    an error (aiohttp logged each as a traceback): the rest is not read, and leaving the
    caller's ``async with`` closes vLLM's stream, which aborts the request there."""
    try:
        async for line in lines:
            await out.write(convert(line) if convert is not None else line)
        await out.write_eof()
    except ConnectionResetError:
        logger.debug("the client closed its stream before the end; vLLM's is closed too")


async def _observed(lines: AsyncIterable[bytes], timing: StreamTiming) -> AsyncIterator[bytes]:
    """vLLM's stream as the client gets it, its timing taken on the way."""
    async for line in lines:
        passed = timing.event(line)
        if passed is not None:
            yield passed


async def _chained(first: list[bytes], rest: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    for line in first:
        yield line
    async for line in rest:
        yield line


MAX_JSON_DEPTH = 64  # an OpenAI request nests a few levels (messages, content parts, tools)
MAX_TOKEN_ID = (1 << 32) - 1
# kv_transfer_params entries only the router and the kvtierd plugin write: a client's own
# (lmcache.tag.kvtierd_manifest: load another context's variant) went to vLLM unchanged.
# LMCache's own options (lmcache.skip_save, other tags) stay the client's: the served
# evaluator itself sends skip_save through the router.
INTERNAL_PARAM_PREFIXES = ("lmcache.tag.kvtierd",)


async def _scoped(request: web.Request) -> bool:
    """Whether the request names a profiling scope (``"kvtierd": {"scope": ...}``); a body
    that is not such an object is real traffic (``_generate`` answers it)."""
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        return False  # _generate answers it with the reason
    field = body.get("kvtierd") if isinstance(body, dict) else None
    return isinstance(field, dict) and bool(field.get("scope"))


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object nested at most :data:`MAX_JSON_DEPTH` deep (deeper answered
    500 with a traceback: RecursionError), a prompt of token ids being ids."""
    try:
        body = await request.json()
    except (ValueError, RecursionError) as e:
        raise InvalidArgumentError(f"the request body is not JSON: {type(e).__name__}") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError(f"the request body must be a JSON object, not {body!r:.80}")
    if _depth(body) > MAX_JSON_DEPTH:
        raise InvalidArgumentError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and any(
        isinstance(x, int) and not 0 <= x <= MAX_TOKEN_ID for x in prompt
    ):
        raise InvalidArgumentError(f"prompt token ids must be integers in [0, {MAX_TOKEN_ID}]")
    return body


def _depth(value: Any) -> int:
    """How deep ``value`` nests, without recursion (iteratively, level by level)."""
    depth, level = 0, [value]
    while level and depth <= MAX_JSON_DEPTH:
        depth += 1
        level = [c for v in level if isinstance(v, dict | list)
                 for c in (v.values() if isinstance(v, dict) else v)]  # fmt: skip
    return depth


def _client_params(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without the ``kv_transfer_params`` entries only kvtierd writes."""
    params = body.get("kv_transfer_params")
    if params is None:
        return body
    if not isinstance(params, dict):
        raise InvalidArgumentError("kv_transfer_params must be a JSON object")
    kept = {k: v for k, v in params.items() if not str(k).startswith(INTERNAL_PARAM_PREFIXES)}
    if len(kept) < len(params):
        logger.info("dropped %d kvtierd-internal kv_transfer_params entries a client sent",
                    len(params) - len(kept))  # fmt: skip
    return {**body, "kv_transfer_params": kept}


def _salt_prefix(body: dict[str, Any]) -> str:
    """The key prefix of the request's ``cache_salt`` (``""``: none), which every key the
    kvtierd plugin writes for the request begins with (docs/integration.md, "cache_salt"): a
    salted request is rewritten only to a variant stored under its own salt."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise InvalidArgumentError(f"cache_salt must be a non-empty string, not {salt!r:.40}")
    return salt_key_prefix(salt)


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _loaded(rw: Rewrite) -> dict[str, str]:
    """The header that tells the client its request was served from a compressed context."""
    return {LOADED_HEADER: loaded_value(rw.manifest.digest, rw.manifest.variant)}


def _choices_ok(data: dict[str, Any]) -> bool:
    """No ``error`` object and no choice that vLLM finished with ``error`` or ``abort`` (what
    a failed KV load under ``kv_load_failure_policy: fail`` gives)."""
    if "error" in data:
        return False
    return all(c.get("finish_reason") not in ("error", "abort") for c in data.get("choices", []))


def _first_event_ok(line: bytes) -> bool:
    """vLLM's first streamed event of a request: ``data: [DONE]`` (nothing generated) and an
    ``{"error": ...}`` event (vLLM's stream of a failed KV load) are failures."""
    payload = line[len(b"data: ") :].strip()
    if payload == b"[DONE]":
        return False
    try:
        data = json.loads(payload)
    except ValueError:
        return False
    return isinstance(data, dict) and _choices_ok(data)


async def _tagged(body: dict[str, Any], note: PromptNote | None) -> dict[str, Any]:
    """``body`` naming its registered prompt to the plugin (``prompts.py``), if it was."""
    tags = await note.tags() if note is not None else {}
    return _with_params(body, tags) if tags else body


def _with_params(body: dict[str, Any], tags: dict[str, str]) -> dict[str, Any]:
    params = dict(body.get("kv_transfer_params") or {})
    params.update(tags)
    return {**body, "kv_transfer_params": params}


def _as_chat(data: dict[str, Any]) -> dict[str, Any]:
    """A completions answer in chat-completions form (for a rewritten chat request)."""
    choices = [
        {"index": c["index"], "finish_reason": c.get("finish_reason"),
         "message": {"role": "assistant", "content": c.get("text", "")}}
        for c in data.get("choices", [])
    ]  # fmt: skip
    return {**data, "object": "chat.completion", "choices": choices,
            "created": data.get("created", int(time.time()))}  # fmt: skip


def _chat_line(line: bytes) -> bytes:
    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
        return line
    data = json.loads(line[6:])
    choices = [
        {"index": c["index"], "finish_reason": c.get("finish_reason"),
         "delta": {"content": c.get("text", "")}}
        for c in data.get("choices", [])
    ]  # fmt: skip
    chunk = {**data, "object": "chat.completion.chunk", "choices": choices}
    return b"data: " + json.dumps(chunk).encode() + b"\n"


ROUTER = web.AppKey("router", Router)
"""The app's :class:`Router` (its counters), for tests and embedding."""


def _bearer(token: str) -> Any:
    """A middleware that answers 401 to a request without ``Authorization: Bearer <token>``
    (the probes excepted: ``probes.PROBE_PATHS``)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if request.path not in PROBE_PATHS and not hmac.compare_digest(given, expected):
            return _error("missing or wrong bearer token (Authorization: Bearer <token>)", 401)
        response: web.StreamResponse = await handler(request)
        return response

    return check


def make_app(config: RouterConfig) -> web.Application:
    router = Router(config)
    app = web.Application(middlewares=[_bearer(config.api_token)] if config.api_token else [])
    app.router.add_get("/livez", router.live)
    app.router.add_get("/readyz", router.ready)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics)
    app.router.add_get("/v1/models", router.models)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)

    async def close(_: web.Application) -> None:
        if router.session is not None:
            await router.session.close()
        await router.in_flight.close()
        if router._client is not None:
            await router._client.close()

    app.on_cleanup.append(close)
    app[ROUTER] = router
    return app
