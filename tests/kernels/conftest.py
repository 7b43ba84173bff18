"""Kernel tests run every Triton kernel under the interpreter on CPU (TRITON_INTERPRET=1).

The variable must be set before triton is imported (triton picks the interpreter when a
kernel is decorated); the Triton modules of kvtierd.kernels are imported lazily, after this.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and Path(str(item.path)).is_relative_to(here):
            item.add_marker(skip)
