"""Profiles say what they know (issue 39, item 4): ``contexts show`` and ``profile status``
name the reading a context's profile came from; a daemon whose estimator has no model says so
at start and in ``status``; one whose policy names no model profiles with kvtierd's model cache
once the served model's card shows the cached checkpoint is that model.

Real daemons running EvicPress with the default estimator (``query_attention``): one without
``profiling.model_dir`` (every profile is the labels' per-variant prior), one with a tiny
random-weight Llama (mechanics only: its probes are real, its scores mean nothing). They get an
empty model cache (``KVTIERD_MODEL_DIR``), so neither finds a model on its own; the model-cache
test puts the tiny Llama where ``kvtierd model fetch`` puts SmolLM2.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from benchmarks._support.daemon_proc import DaemonProcess, write_config
from benchmarks._support.tiny_vllm_model import VOCAB, build_tiny_llama
from kvtierd.cli.admin import NO_MODEL_LINE
from kvtierd.client import KVClient
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import MODEL_CARD_LAYOUT, ModelCard, model_card_key
from kvtierd.kernels.rope import RopeSpec
from kvtierd.model_fetch import SMOLLM2, SOURCE_FILE
from tests.cli.conftest import Ctl

L, H, D, T, CHUNKS = 2, 2, 64, 16, 4  # the tiny Llama's layers, KV heads and head dim
N = T * CHUNKS


START_S = 300  # a daemon's start imports torch: slow on a loaded 2-core machine


def _policy(model_dir: Path | None) -> str:
    text = "name: evicpress\nplacer: evicpress\nvariants: {methods: [knorm, int8], ratios: [0.5]}\n"
    return text + (f"profiling: {{model_dir: {model_dir}}}\n" if model_dir else "")


def _daemon(directory: Path, policy_text: str, cache: Path | None = None) -> DaemonProcess:
    """A daemon running ``policy_text`` whose model cache is ``cache`` (default: empty)."""
    policy = directory / "policy.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    policy.write_text(policy_text)
    config = write_config(directory, cpu="1MiB", ssd="64MiB", policy_file=str(policy))
    if cache is None:
        cache = directory / "empty-model-cache"
        cache.mkdir()
    d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log",
                      env={"KVTIERD_MODEL_DIR": str(cache)}, given_bandwidths=True)  # fmt: skip
    return d.start(timeout_s=START_S)


TOKENS = [3 + (37 * i) % (VOCAB - 3) for i in range(N)]


def _put_context(d: DaemonProcess, cid: str, *, with_tokens: bool) -> None:
    """A context of ``N`` tokens as LMCache chunks of random bf16 KV; its token ids too when
    ``with_tokens`` (the probes of a first put are recomputed from them)."""
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    g = torch.Generator().manual_seed(len(cid))
    with KVClient(d.socket_path) as c:
        for i in range(CHUNKS):
            x = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
            c.put(f"{cid}/{i}", x, context_id=cid, layout=layout, token_count=T)
        if with_tokens:
            c.set_context_tokens(cid, TOKENS)


def _with_doc(
    directory: Path, model_dir: Path | None, *, with_tokens: bool = True
) -> Iterator[DaemonProcess]:
    """A daemon (:func:`_daemon`) holding the context ``doc`` (and its token ids)."""
    d = _daemon(directory, _policy(model_dir))
    try:
        _put_context(d, "doc", with_tokens=with_tokens)
        yield d
    finally:
        d.kill()


@pytest.fixture(scope="module")
def prior_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """No model, and no token ids for ``doc``: nothing but the prior to read."""
    yield from _with_doc(tmp_path_factory.mktemp("prior-only"), None, with_tokens=False)


@pytest.fixture(scope="module")
def tokens_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """No model, but ``doc``'s token ids: its token-dropping variants read their coverage."""
    yield from _with_doc(tmp_path_factory.mktemp("tokens-only"), None)


@pytest.fixture(scope="module")
def lru(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A placer that does not use quality: no context is profiled."""
    d = _daemon(tmp_path_factory.mktemp("lru"), "name: lru\nplacer: lru\n")
    try:
        yield d
    finally:
        d.kill()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def with_model(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[DaemonProcess]:
    yield from _with_doc(tmp_path_factory.mktemp("with-model"), tiny)


def _profiled(run: Ctl, cid: str) -> None:
    # a first pass through the model loads transformers: minutes on a loaded 2-core machine
    r = run("profile", "run", cid, "--json", "--timeout", str(START_S))
    assert r.code == 0 and r.json()["profiled"] == 1, (r.out, r.err)


@pytest.mark.parametrize(
    ("daemon", "reading"),
    # no model and no token ids; no model, coverage from the token ids; the model's probes
    [("prior_only", "prior"), ("tokens_only", "first put"), ("with_model", "first put")],
)
def test_contexts_show_and_profile_status_name_the_reading(
    daemon: str, reading: str, request: pytest.FixtureRequest, ctl: Callable
) -> None:
    d: DaemonProcess = request.getfixturevalue(daemon)
    run: Ctl = ctl(d)
    _profiled(run, "doc")
    shown = run("contexts", "show", "doc", "--json").json()["profile"]
    assert (shown["reading"], shown["evaluator"]) == (reading, "query_attention")
    # no question is known either way; the prior reads no query, a first put its probes
    assert shown["query_source"] == "initial"
    assert (shown["num_queries"] > 0) == (reading == "first put")
    assert 0 <= shown["age_s"] < START_S
    human = run("contexts", "show", "doc")
    assert human.code == 0, human.err
    assert f"{reading} (query_attention), " in human.out and " ago" in human.out
    status = run("profile", "status", "doc", "--json").json()
    assert (status["reading"], status["profile_evaluator"]) == (reading, "query_attention")
    assert f"{reading} (query_attention)" in run("profile", "status", "doc").out


def test_a_context_not_profiled_says_so(lru: DaemonProcess, ctl: Callable) -> None:
    run: Ctl = ctl(lru)
    _put_context(lru, "doc", with_tokens=False)
    assert run("contexts", "show", "doc", "--json").json()["profile"]["reading"] == ""
    human = run("contexts", "show", "doc")
    rows = {ln.split("│")[0].strip(): ln.split("│")[-1].strip() for ln in human.out.splitlines()}
    assert rows["profile"] == "not profiled"


def _status(run: Ctl) -> tuple[dict, str]:
    doc = run("status", "--json").json()["quality"]
    human = run("status")
    rows = {ln.split("│")[0].strip(): ln.split("│")[-1].strip() for ln in human.out.splitlines()}
    return doc, rows["quality profiles"]


def test_a_daemon_profiling_with_the_prior_only_says_so(
    prior_only: DaemonProcess, with_model: DaemonProcess, tiny: Path, ctl: Callable
) -> None:
    warned = [ln for ln in prior_only.logs().splitlines() if " INFO " in ln]
    assert any("quality profiles: no model" in ln and "set profiling.model_dir" in ln
               for ln in warned), warned  # fmt: skip
    doc, line = _status(ctl(prior_only))
    assert (doc["estimator"], doc["prior_only"], doc["model_dir"]) == ("query_attention", True, "")
    assert line == NO_MODEL_LINE

    assert "quality profiles: no model" not in with_model.logs()
    doc, line = _status(ctl(with_model))
    assert (doc["prior_only"], doc["model_dir"], doc["model_dir_from"]) == (
        False,
        str(tiny),
        "policy",
    )
    assert line == f"query_attention with model {tiny}"


def test_a_placer_without_quality_profiles_nothing(lru: DaemonProcess, ctl: Callable) -> None:
    doc, line = _status(ctl(lru))
    assert (doc["estimator"], doc["prior_only"]) == ("", False)
    assert line == "not used (placer lru does not place by quality)"
    assert "quality profiles: no model" not in lru.logs()


def _card(model: str, vocab_size: int = VOCAB) -> bytes:
    """The card the plugin registers for the tiny Llama (``placeholder_serve.model_card``)."""
    return ModelCard(model, D, RopeSpec.standard(D).inv_freq, vocab_size, (0, 1, 2)).to_bytes()


def test_the_model_cache_serves_when_its_geometry_is_the_served_model_s(
    tmp_path: Path, tiny: Path, ctl: Callable
) -> None:
    """No profiling.model_dir: the daemon starts prior only; a card of another geometry
    changes nothing; the card of the checkpoint in kvtierd's model cache makes the daemon
    profile with it, and a context profiled from the prior is profiled again with it."""
    cache = tmp_path / "cache"
    cached = cache / SMOLLM2.name  # where `kvtierd model fetch` puts it
    shutil.copytree(tiny, cached)
    (cached / SOURCE_FILE).write_text(json.dumps({"wheel_sha256": SMOLLM2.wheel_sha256}))
    d = _daemon(tmp_path / "d", _policy(None), cache)
    try:
        run: Ctl = ctl(d)
        _put_context(d, "doc", with_tokens=False)  # no token ids: no coverage either
        _profiled(run, "doc")
        assert run("contexts", "show", "doc", "--json").json()["profile"]["reading"] == "prior"
        assert _status(run)[0]["prior_only"]
        with KVClient(d.socket_path) as c:
            # its token ids arrive after that profile: the model's probes are made from them
            c.set_context_tokens("doc", TOKENS)
            other = "/models/other"
            c.put(model_card_key(other), _card(other, VOCAB * 2), context_id="card",
                  layout=MODEL_CARD_LAYOUT)  # fmt: skip
            assert _status(run)[0]["prior_only"]
            served = "/served/tiny"  # vLLM's name for it: a path the daemon never loads
            c.put(model_card_key(served), _card(served), context_id="card2",
                  layout=MODEL_CARD_LAYOUT)  # fmt: skip
        doc, line = _status(run)
        assert (doc["model_dir"], doc["model_dir_from"]) == (str(cached), "model cache")
        assert line == f"query_attention with model {cached} (model cache)"
        assert "(kvtierd's model cache)" in d.logs()
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:  # profiled again in the background, with the model
            shown = run("contexts", "show", "doc", "--json").json()["profile"]
            if shown["reading"] == "first put":
                break
            time.sleep(0.5)
        assert shown["reading"] == "first put"
    finally:
        d.kill()
