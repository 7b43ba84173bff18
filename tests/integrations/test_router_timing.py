"""The router's timing of streamed requests (issue 13.3): it asks vLLM for the stream's usage
and hides the usage event from a client that did not ask for it."""

from __future__ import annotations

import json
from typing import Any

from kvtierd.integrations.router.timing import ServedSample, StreamTiming


def _line(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n"


TOKEN = _line({"choices": [{"index": 0, "text": "Paris"}], "usage": None})
DETAILS = {"cached_tokens": 256}
USAGE = _line({"choices": [], "usage": {"prompt_tokens": 1200, "completion_tokens": 3,
                                        "prompt_tokens_details": DETAILS}})  # fmt: skip
DONE = b"data: [DONE]\n"


def _relay(timing: StreamTiming) -> list[bytes]:
    lines = [TOKEN, b"\n", USAGE, b"\n", DONE, b"\n"]
    return [out for line in lines if (out := timing.event(line)) is not None]


def test_usage_is_asked_for_and_hidden_from_a_client_that_did_not() -> None:
    body = {"prompt": "x", "stream": True}
    timing = StreamTiming(body)
    sent = timing.body(body)
    assert sent["stream_options"] == {"include_usage": True} and "stream_options" not in body
    got = _relay(timing)
    assert USAGE not in got and TOKEN in got and DONE in got
    sample = timing.sample()
    assert sample is not None and sample.prompt_tokens == 1200 and sample.cached_tokens == 256
    assert 0 < sample.ttft_s < 60


def test_a_client_that_asked_for_usage_gets_it() -> None:
    body = {"prompt": "x", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    timing = StreamTiming(body)
    assert timing.body(body)["stream_options"]["continuous_usage_stats"] is True
    assert USAGE in _relay(timing)
    assert isinstance(timing.sample(), ServedSample)


def test_no_sample_without_cached_token_details() -> None:
    timing = StreamTiming({"stream": True})
    plain = _line({"choices": [], "usage": {"prompt_tokens": 1200, "completion_tokens": 3}})
    for line in (TOKEN, plain, DONE):
        timing.event(line)
    assert timing.sample() is None  # vLLM ran without --enable-prompt-tokens-details
    assert StreamTiming({"stream": True}).sample() is None  # nothing streamed
