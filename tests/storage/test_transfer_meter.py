"""TransferMeter: the online overhead + bandwidth fit behind every tier's load-time figure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvtierd.storage.base import TransferFit, TransferMeter

MiB = 1 << 20
SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)


def line(overhead_s: float, bytes_per_s: float, nbytes: int) -> float:
    return overhead_s + nbytes / bytes_per_s


def test_exact_samples_of_several_sizes_give_the_line() -> None:
    m = TransferMeter()
    for size in itertools.islice(itertools.cycle(SIZES), 200):
        m.record(size, line(0.5e-3, 2e9, size))
    assert m.overhead_s == pytest.approx(0.5e-3, rel=1e-6)
    assert m.bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert m.samples == 200


def test_two_sizes_separate_overhead_from_bandwidth_within_a_few_samples() -> None:
    """What a tier's start-up calibration does: two sizes, alternately, twice."""
    m = TransferMeter()
    for size in (1 * MiB, 16 * MiB) * 2:
        m.record(size, line(2e-3, 1e9, size))
    assert m.overhead_s == pytest.approx(2e-3, rel=0.1)
    assert m.fit().seconds(64 * MiB) == pytest.approx(line(2e-3, 1e9, 64 * MiB), rel=0.02)


def test_first_sample_is_a_line_through_the_origin() -> None:
    m = TransferMeter()
    m.record(8 * MiB, 4e-3)
    assert (m.overhead_s, m.bytes_per_s) == (0.0, pytest.approx(8 * MiB / 4e-3))


def calibrated(overhead_s: float, bytes_per_s: float) -> TransferMeter:
    m = TransferMeter()
    for size in (1 * MiB, 16 * MiB) * 3:
        m.record(size, line(overhead_s, bytes_per_s, size))
    return m


def test_one_size_only_keeps_the_overhead() -> None:
    """Loads of one size cannot tell overhead from bandwidth: the fit keeps what the varied
    sizes said instead of solving a near-singular system once the calibration has faded."""
    m = calibrated(1e-3, 2e9)
    for _ in range(300):
        m.record(64 * MiB, line(1e-3, 2e9, 64 * MiB))
    assert m.overhead_s == pytest.approx(1e-3, rel=1e-6)
    assert m.bytes_per_s == pytest.approx(2e9, rel=1e-6)


def test_one_size_on_a_slower_disk_moves_the_line_through_it() -> None:
    m = calibrated(1e-3, 2e9)
    for _ in range(300):
        m.record(64 * MiB, line(1e-3, 1e9, 64 * MiB))
    assert m.fit().seconds(64 * MiB) == pytest.approx(line(1e-3, 1e9, 64 * MiB), rel=1e-3)
    assert m.bytes_per_s == pytest.approx(1e9, rel=0.03)
    assert 0 <= m.overhead_s <= 1e-3


def test_a_device_that_got_much_slower_is_followed_within_a_few_dozen_transfers() -> None:
    """Old fast transfers must not outweigh new slow ones (they would with an error relative
    to the measured time: a 1 ms error is 200 % of a 0.5 ms transfer, 7 % of a 14 ms one)."""
    m = calibrated(0.3e-3, 2e9)
    for _ in range(30):
        m.record(4 * MiB, 14e-3)
    assert m.fit().seconds(4 * MiB) == pytest.approx(14e-3, rel=0.05)


def test_old_samples_fade() -> None:
    m = TransferMeter(weight=0.2)
    for size in itertools.islice(itertools.cycle(SIZES), 40):
        m.record(size, line(1e-3, 4e9, size))
    for size in itertools.islice(itertools.cycle(SIZES), 100):
        m.record(size, line(3e-3, 1e9, size))
    assert m.overhead_s == pytest.approx(3e-3, rel=1e-3)
    assert m.bytes_per_s == pytest.approx(1e9, rel=1e-3)


def test_error_is_relative_so_small_loads_are_not_drowned_by_large_ones() -> None:
    """+-10% multiplicative noise: every size's prediction stays within the noise."""
    rng = np.random.default_rng(0)
    m = TransferMeter()
    for size in itertools.islice(itertools.cycle(SIZES), 400):
        m.record(size, line(2e-3, 1.5e9, size) * rng.uniform(0.9, 1.1))
    for size in SIZES:
        assert m.fit().seconds(size) == pytest.approx(line(2e-3, 1.5e9, size), rel=0.05)


def test_overhead_is_never_negative() -> None:
    """Times that a line would meet below zero (a per-byte cost that falls with size): the
    best line through the origin, not a negative overhead."""
    m = TransferMeter()
    for size in SIZES * 5:
        m.record(size, size / 1e9 - 0.5e-3)
    assert m.overhead_s == 0.0
    assert m.bytes_per_s > 0


def test_small_empty_and_non_positive_transfers_are_ignored() -> None:
    m = TransferMeter()
    m.record(4096, 1e-3)  # under min_bytes: latency, not on the line
    m.record(0, 1e-3)
    m.record(8 * MiB, 0.0)
    m.record(8 * MiB, float("inf"))
    assert m.samples == 0 and m.fit() == TransferFit()
    empty = TransferMeter(min_bytes=0)
    empty.record(0, 1e-3)  # an empty transfer: no division by zero, and nothing learnt
    assert empty.samples == 0 and empty.fit() == TransferFit()


def test_fit_in_sequence_adds_overheads_and_seconds_per_byte() -> None:
    staged = TransferFit(1e-3, 2e9).then(TransferFit(1e-4, 2e9))
    assert staged.overhead_s == pytest.approx(1.1e-3)
    assert staged.bytes_per_s == pytest.approx(1e9)
    assert staged.seconds(10**9) == pytest.approx(1.0011)
    assert TransferFit().then(TransferFit(0.0, 1e9)).bytes_per_s == 0.0  # unknown stays unknown
    assert TransferFit().seconds(1) == float("inf")
