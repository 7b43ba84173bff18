"""Profiler fixtures: a tiny random-weight Llama built locally (no downloads, ever)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks._support.tiny_llama import build_tiny_llama

os.environ["HF_HUB_OFFLINE"] = "1"  # a missing local file must fail, not reach the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
