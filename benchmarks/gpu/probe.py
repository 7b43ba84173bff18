"""Step ``env``: what the image actually has, printed first so a wrong guess shows in seconds.

Versions come from the installed distributions' metadata (nothing imported but torch and
triton); ``figures`` carries them into the report, and ``cuda`` decides the run's mode.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys

from benchmarks.gpu.record import PASS, Check, Recorder, step_args

DISTRIBUTIONS = (
    "torch",
    "triton",
    "numpy",
    "protobuf",
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "pyyaml",
    "xxhash",
    "aiofiles",
    "prometheus-client",
    "rich",
    "highspy",
    "redis",
    "pytest",
    "pytest-asyncio",
    "pytest-timeout",
    "hypothesis",
    "pluggy",
    "packaging",
    "pygments",
    "typing-extensions",
    "pip",
)


def versions() -> dict[str, str]:
    out = {}
    for name in DISTRIBUTIONS:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


def cuda_facts() -> dict[str, object]:
    import torch

    facts: dict[str, object] = {"torch_cuda": torch.version.cuda, "cuda": False}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts |= {
            "cuda": True,
            "device": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "device_count": torch.cuda.device_count(),
        }
    return facts


def main() -> None:
    args = step_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.result)
    rec.figures["python"] = f"{platform.python_version()} ({sys.executable})"
    rec.figures["versions"] = versions()
    rec.figures |= cuda_facts()
    for key, value in rec.figures.items():
        print(f"  {key}: {value}", flush=True)
    v = rec.figures["versions"]
    assert isinstance(v, dict)
    figure = (
        f"python {platform.python_version()}, torch {v['torch']} (CUDA "
        f"{rec.figures['torch_cuda']}), triton {v['triton']}, protobuf {v['protobuf']}, "
        f"grpcio {v['grpcio']}, pytest {v['pytest']}, device "
        f"{rec.figures.get('device', 'none')}"
    )
    rec.add(Check("versions", PASS, figure))


if __name__ == "__main__":
    main()
