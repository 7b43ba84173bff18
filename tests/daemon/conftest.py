"""The daemon's tests are about what it does, not how fast this machine is: every in-process
engine here loads at its tiers' given bandwidths (``tests/given_bandwidths.py``), so EvicPress
places the same way on a busy machine as on a quiet one (issue 25)."""

from collections.abc import Iterator

import pytest

from tests.given_bandwidths import given_bandwidths


@pytest.fixture(scope="module", autouse=True)
def _given_bandwidths() -> Iterator[None]:
    # Module scope: set up before the modules' own engine fixtures, undone after the last one.
    with given_bandwidths():
        yield
