"""Given tier bandwidths for tests whose placement is not about speed.

EvicPress places a context by comparing each tier's load time with the prefill time; the load
time comes from the tier's read fit, calibrated at start-up and refitted from real reads
(``Tier.load_fit``). Under load a calibration can come out several times slower, and then a
test's context lands elsewhere, or is dropped as cheaper to recompute (issue 25:
``test_profile_beside_pinned`` failed with ``KeyError: 'b'`` beside a busy CPU). Tests that are
not about speed give every tier its kind's documented figure instead (``read_prior``: CPU
arena 8.3 GB/s, SSD 0.55 GB/s + 0.54 ms, remote 0.4 GB/s + 1 ms, GPU 5 GB/s), whatever the
machine does:

* in-process engines: the ``given_bandwidths`` fixture (tests/conftest.py);
* daemon processes: ``DaemonProcess(..., given_bandwidths=True)``, which starts the daemon as
  ``python -m tests.given_bandwidths serve --config ...``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from kvtierd.storage.base import Tier, TransferFit


def _given_fit(self: Tier) -> TransferFit:
    return self.read_prior


@contextmanager
def given_bandwidths() -> Iterator[None]:
    """Within the block, every tier's load fit is its kind's ``read_prior``."""
    measured = Tier.load_fit
    Tier.load_fit = _given_fit  # type: ignore[method-assign]
    try:
        yield
    finally:
        Tier.load_fit = measured  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    """``kvtierd.server.main`` with given bandwidths (a process of its own, as the command's)."""
    from kvtierd.server.main import main as serve

    with given_bandwidths():
        return serve(argv, exit_at_stop=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
