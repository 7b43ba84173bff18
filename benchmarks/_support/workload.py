"""Deterministic object contents for the crash and concurrency tests: the bytes of a key are a
function of the key, so any process can check any object it reads."""

from __future__ import annotations

import zlib

import numpy as np


def payload(key: str, size: int) -> bytes:
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def size_of(key: str, low: int = 1024, high: int = 1 << 20) -> int:
    return low + zlib.crc32(key.encode() + b"size") % (high - low)
