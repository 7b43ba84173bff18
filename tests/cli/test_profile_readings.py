"""Profiles say what they know (issue 39, item 4): ``contexts show`` and ``profile status``
name the reading a context's profile came from, and a daemon whose estimator has no model
says so at start and in ``status``.

Two real daemons running EvicPress with the default estimator (``query_attention``): one
without ``profiling.model_dir`` (every profile is the labels' per-variant prior), one with a
tiny random-weight Llama (mechanics only: its probes are real, its scores mean nothing).
Both get an empty model cache (``KVTIERD_MODEL_DIR``), so neither finds a model on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvtierd.client import KVClient
from kvtierd.kernels.chunk_codec import ChunkFormat
from tests.cli.conftest import Ctl
from tests.daemon_proc import DaemonProcess, write_config
from tests.integrations.tiny_model import VOCAB, build_tiny_llama

L, H, D, T, CHUNKS = 2, 2, 64, 16, 4  # the tiny Llama's layers, KV heads and head dim
N = T * CHUNKS


def _policy(model_dir: Path | None) -> str:
    text = "name: evicpress\nplacer: evicpress\nvariants: {methods: [knorm, int8], ratios: [0.5]}\n"
    return text + (f"profiling: {{model_dir: {model_dir}}}\n" if model_dir else "")


def _daemon(directory: Path, model_dir: Path | None) -> DaemonProcess:
    policy = directory / "evicpress.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    policy.write_text(_policy(model_dir))
    config = write_config(directory, cpu="1MiB", ssd="64MiB", policy_file=str(policy))
    cache = directory / "empty-model-cache"
    cache.mkdir()
    d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log",
                      env={"KVTIERD_MODEL_DIR": str(cache)}, given_bandwidths=True)  # fmt: skip
    return d.start()


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
            c.set_context_tokens(cid, [3 + (37 * i) % (VOCAB - 3) for i in range(N)])


@pytest.fixture(scope="module")
def prior_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = _daemon(tmp_path_factory.mktemp("prior-only"), None)
    try:
        _put_context(d, "doc", with_tokens=True)
        yield d
    finally:
        d.kill()


@pytest.fixture(scope="module")
def with_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tiny = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    d = _daemon(tmp_path_factory.mktemp("with-model"), tiny)
    try:
        _put_context(d, "doc", with_tokens=True)
        yield d
    finally:
        d.kill()


def _profiled(run: Ctl, cid: str) -> None:
    r = run("profile", "run", cid, "--json")
    assert r.code == 0 and r.json()["profiled"] == 1, (r.out, r.err)


def test_a_profile_without_a_model_reads_as_the_prior(
    prior_only: DaemonProcess, ctl: Callable
) -> None:
    run: Ctl = ctl(prior_only)
    _profiled(run, "doc")
    shown = run("contexts", "show", "doc", "--json").json()["profile"]
    assert (shown["reading"], shown["evaluator"]) == ("prior", "query_attention")
    assert (shown["num_queries"], shown["query_source"]) == (0, "initial")
    assert 0 <= shown["age_s"] < 60
    human = run("contexts", "show", "doc")
    assert human.code == 0, human.err
    assert "prior (query_attention), " in human.out and " ago" in human.out
    status = run("profile", "status", "doc", "--json").json()
    assert (status["reading"], status["profile_evaluator"]) == ("prior", "query_attention")
    assert "prior (query_attention)" in run("profile", "status", "doc").out


def test_a_profile_from_the_context_s_own_probes_reads_as_first_put(
    with_model: DaemonProcess, ctl: Callable
) -> None:
    run: Ctl = ctl(with_model)
    _profiled(run, "doc")
    shown = run("contexts", "show", "doc", "--json").json()["profile"]
    assert (shown["reading"], shown["evaluator"]) == ("first put", "query_attention")
    assert shown["num_queries"] > 0 and shown["query_source"] == "initial"
    assert "first put (query_attention), " in run("contexts", "show", "doc").out
    assert run("profile", "status", "doc", "--json").json()["reading"] == "first put"


def test_a_context_not_profiled_says_so(start_daemon: Callable, ctl: Callable) -> None:
    """Under LRU (a placer that does not use quality) no context is profiled."""
    d = start_daemon()
    run: Ctl = ctl(d)
    _put_context(d, "doc", with_tokens=False)
    assert run("contexts", "show", "doc", "--json").json()["profile"]["reading"] == ""
    human = run("contexts", "show", "doc")
    rows = {ln.split("│")[0].strip(): ln.split("│")[-1].strip() for ln in human.out.splitlines()}
    assert rows["profile"] == "not profiled"
