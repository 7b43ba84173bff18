"""Every benchmark says which machine its figures come from, the CPU's model and the flags that
change them included (issue 25: the same benchmark differs between CPUs with and without
AVX-512, and RESULTS.md rows must name their CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks._support.common import cpu_line, cpu_model, machine

REPO = Path(__file__).resolve().parents[1]
EPYC = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n"
    "flags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"
)


def test_the_cpu_line_names_the_model_and_which_flags_it_has(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(EPYC)
    assert cpu_model(info) == "AMD EPYC 7B13"
    assert cpu_line(info) == "CPU AMD EPYC 7B13 [avx2 -avx512f -avx512_bf16 -amx_bf16]"
    info.write_text(EPYC.replace("avx2 fma", "avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile"))
    assert cpu_line(info) == "CPU AMD EPYC 7B13 [avx2 avx512f avx512_bf16 amx_bf16]"


def test_the_machine_line_carries_this_cpu() -> None:
    assert cpu_line() in machine()


# The benchmarks that print figures (the GPU harness records its machine in its report).
BENCHMARK_DIRS = ("e2e", "micro", "quality")


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for folder in BENCHMARK_DIRS
        for p in (REPO / "benchmarks" / folder).glob("*.py")
        if "def main(" in p.read_text()
    ),
    ids=lambda p: p.name,
)
def test_every_benchmark_prints_its_machine(path: Path) -> None:
    text = path.read_text()
    assert "machine()" in text or "print_machine(" in text, path.name
