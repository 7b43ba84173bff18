"""Time to first token of streamed requests, reported to the daemon (issue 13.3).

The daemon prices a recompute at vLLM's prefill speed, which only the serving
path can measure (``kvtierd.profiler.prefill_fit``). Per streamed request the router takes the
seconds from sending it to vLLM to its first data event, and vLLM's usage: the prompt's tokens
and how many of them were cached (``prompt_tokens_details.cached_tokens``: vLLM's prefix cache
plus what the connector loaded; vLLM fills it with ``--enable-prompt-tokens-details``). To get
the usage of a stream the router asks for it (``stream_options.include_usage``) and, when the
client did not, drops the usage-only event from what the client receives.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ServedSample:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


class StreamTiming:
    """Watches one streamed request's events (:meth:`event`) from the moment it is made."""

    def __init__(self, body: dict[str, Any]) -> None:
        options = body.get("stream_options")
        self.client_wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.started = time.perf_counter()
        self.ttft_s: float | None = None
        self._usage: dict[str, Any] | None = None

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` as sent to vLLM: asking for the stream's usage."""
        options = body.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        return {**body, "stream_options": {**options, "include_usage": True}}

    def event(self, line: bytes) -> bytes | None:
        """One line of vLLM's stream: observed, and passed on (``None``: not for the client)."""
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            return line
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started
        if b'"usage"' not in line or b'"usage":null' in line or b'"usage": null' in line:
            return line  # a token event (with include_usage vLLM adds "usage":null to each)
        try:
            data = json.loads(line[len(b"data: ") :])
        except ValueError:
            return line
        usage = data.get("usage") if isinstance(data, dict) else None
        if isinstance(usage, dict):
            self._usage = usage
        usage_only = isinstance(data, dict) and not data.get("choices")
        return None if usage_only and not self.client_wants_usage else line

    def sample(self) -> ServedSample | None:
        """The request's timing, if vLLM said how much of its prompt it had cached."""
        usage = self._usage
        if usage is None or self.ttft_s is None:
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = usage.get("prompt_tokens")
        if not isinstance(prompt, int) or not isinstance(cached, int):
            return None  # vLLM runs without --enable-prompt-tokens-details
        return ServedSample(prompt, cached, self.ttft_s)
