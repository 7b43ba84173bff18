"""Issue 27.9: what a client sends the router cannot make it answer 500, nor reach vLLM as
kvtierd's own parameters; its HTTP API can require a token; it talks to the daemon as the
tenant it is given. A real router app in front of a vLLM stand-in (test_router_errors) and a
real daemon on its Unix socket."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestClient, TestServer

from kvtierd.integrations.router.app import MAX_JSON_DEPTH, ROUTER, RouterConfig, make_app
from tests.integrations.test_router_errors import ANSWER, Upstream, upstream  # noqa: F401

Client = TestClient[Any, Any]


@pytest.fixture
async def router(start_daemon, upstream) -> AsyncIterator[tuple[Client, Upstream]]:  # noqa: F811
    d = start_daemon(tenants=[{"name": "r"}])
    up, url = upstream
    config = RouterConfig(url, d.socket_path, chunk_tokens=16, tenant="r", api_token="s3cret")
    client: Client = TestClient(TestServer(make_app(config)))
    await client.start_server()
    try:
        yield client, up
    finally:
        await client.close()


AUTH = {"Authorization": "Bearer s3cret"}


async def _post(router: Client, data: str) -> tuple[int, Any]:
    r = await router.post("/v1/completions", data=data, headers={**AUTH,
                          "Content-Type": "application/json"})  # fmt: skip
    return r.status, await r.json()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('{"prompt": "w1 w2", "kvtierd": {"context_tokens": 1e400, "variant": "knorm@0.5"}}',
         "context_tokens"),
        ('{"prompt": "w1", "kvtierd": {"context_tokens": 99999999999999999999999}}',
         "context_tokens"),
        ('{"prompt": "w1", "kvtierd": {"context_tokens": 16, "variant": ["x"]}}', "variant"),
        ('{"prompt": [1, 2, 18446744073709551616]}', "token ids"),
        ('{"prompt": [1, 2, -1]}', "token ids"),
        ('{"prompt": "w1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "not JSON"),
        ('{"prompt": "w1", "x": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
         + "}", "nests deeper"),
        ('{"prompt": "w1", "kv_transfer_params": [1]}', "kv_transfer_params"),
    ],
)  # fmt: skip
async def test_bad_fields_are_a_400_with_the_reason(router, body, why) -> None:
    client, up = router
    status, answer = await _post(client, body)
    assert status == 400, answer
    assert why in answer["error"]["message"]
    assert up.bodies == []


async def test_a_clients_kvtierd_params_never_reach_vllm(router) -> None:
    client, up = router
    params = {"lmcache.tag.kvtierd_manifest": "kvtierd-ph@someone-else",
              "lmcache.tag.kvtierd_variant": "knorm@0.1", "lmcache.skip_save": True,
              "do_remote_prefill": False}  # fmt: skip
    body = {"model": "m", "prompt": "w1 w2 w3", "max_tokens": 1, "kv_transfer_params": params}
    status, answer = await _post(client, json.dumps(body))
    assert (status, answer) == (200, ANSWER)
    sent = up.bodies[-1]["kv_transfer_params"]
    assert sent.get("do_remote_prefill") is False
    assert sent.get("lmcache.skip_save") is True  # LMCache's own option stays the client's
    assert sent.get("lmcache.tag.kvtierd_manifest") != "kvtierd-ph@someone-else"
    assert sent.get("lmcache.tag.kvtierd_variant") != "knorm@0.1"


async def test_the_api_token_is_required_when_set(router) -> None:
    client, _ = router
    body = {"model": "m", "prompt": "w1", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status == 401
        assert (await client.get("/v1/models", headers=headers)).status == 401
    r = await client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status == 200
    # the router's daemon calls carry its tenant
    assert ("x-kvtierd-tenant", "r") in client.server.app[ROUTER].client.metadata
