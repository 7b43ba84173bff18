"""HTTP helpers for the tests and benchmarks that talk to ``kvtierd router`` / vLLM, and the
test stack."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# LMCache's chunk size (tokens) in the stacks the tests and benchmarks start.
CHUNK = 16


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), dict(r.headers)


def post_stream(url: str, body: dict[str, Any]) -> tuple[list[Any], dict[str, str]]:
    """A streamed request: its ``data:`` events in order (``"[DONE]"`` as that string, the
    others parsed) and the response headers."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events, dict(r.headers)


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        result: dict[str, Any] = json.loads(r.read())
        return result


@contextlib.contextmanager
def router_stack(
    work: Path, model: Path, vllm_args: tuple[str, ...] = (), dtype: str = ""
) -> Iterator[dict[str, Any]]:
    """A daemon (LRU test config), vLLM with the kvtierd LMCache plugin (and ``vllm_args``),
    and ``kvtierd router`` in front of it, started by the product's own :class:`Stack` on
    ports of its own choosing (0); torn down in reverse order. ``dtype``: "" is the stack's
    choice for this CPU (``cpu_dtype.py``: bf16 only where it is fast and the connector can
    read it); tests whose figures need one dtype name it."""
    from benchmarks._support.daemon_proc import write_config
    from kvtierd.integrations.stack import Stack, StackConfig

    config = StackConfig(
        model=model, work_dir=work, daemon_config=write_config(work / "daemon"),
        vllm_port=0, router_port=0, chunk_size=CHUNK, max_model_len=2048,
        vllm_args=vllm_args, dtype=dtype,
    )  # fmt: skip
    with Stack(config) as stack:
        yield {"router": stack.router_url, "vllm": stack.vllm_url, "socket": stack.socket_path,
               "model": str(model), "vllm_log": work / "vllm.log"}  # fmt: skip
