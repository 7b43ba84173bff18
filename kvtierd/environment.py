"""What the host offers a daemon started without a config: where its socket and data go (the
XDG directories), how much memory is free, whether CUDA is there. Probes only; the schema they
fill is ``config.py``."""

from __future__ import annotations

import os
from pathlib import Path


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvtierd-{os.getuid()}"
    return Path(base) / "kvtierd" if os.environ.get("XDG_RUNTIME_DIR") else Path(base)


def default_socket_path() -> str:
    """The socket :func:`default_config` serves, without probing CUDA (which imports torch):
    clients and kvtierctl resolve it on every start."""
    return str(runtime_dir() / "kvtierd.sock")


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvtierd"


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo; 4 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def cuda_available() -> bool:
    # Without an NVIDIA device node there is no CUDA; skip importing torch (seconds) then.
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
