"""Start-up probes of the SSD tier: does the filesystem take O_DIRECT, and how fast is it."""

from __future__ import annotations

import errno
import mmap
import os
from typing import TYPE_CHECKING

import numpy as np

from kvtierd.errors import InvalidArgumentError, StorageFullError
from kvtierd.storage.aligned_io import ALIGN, o_direct_supported, open_file
from kvtierd.storage.base import Timer
from kvtierd.storage.ssd_files import Layout, StoredFile, remove_quietly
from kvtierd.storage.ssd_format import encode_header
from kvtierd.types import ObjectMeta

if TYPE_CHECKING:
    from kvtierd.storage.ssd import SsdTier

CALIBRATION_BYTES = 8 << 20
"""Size of the throwaway object written and read at start: a few chunks, a few ms of I/O."""


def probe_o_direct(layout: Layout, option: str | bool) -> bool:
    """Whether to use O_DIRECT: ``option`` False → no; otherwise try an aligned write in
    ``tmp/``. EINVAL (from open or the write) means the filesystem refuses it: with ``"auto"``
    fall back to buffered I/O, with True raise ``InvalidArgumentError``."""
    if option is False:
        return False
    path = str(layout.tmp / "o_direct_probe.tmp")
    try:
        if not o_direct_supported():
            raise OSError(errno.EINVAL, "this platform has no O_DIRECT")
        fd = open_file(path, write=True, direct=True)
        try:
            with mmap.mmap(-1, ALIGN) as page:
                os.pwritev(fd, [page], 0)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        if option is True:
            raise InvalidArgumentError(
                f"o_direct: true, but {layout.root} refuses O_DIRECT ({e.strerror}); "
                "use o_direct: auto to fall back to buffered I/O"
            ) from e
        return False
    finally:
        remove_quietly(path)
    return True


async def calibrate(tier: SsdTier, layout: Layout) -> bool:
    """Write and read back a throwaway object through the tier's own path; record both
    transfers in the tier's meters, then remove the file.

    Returns False, meters untouched, when the disk has no room for the throwaway object: a
    full disk must not stop the tier from starting and serving what it holds; the meters then
    learn from the first real transfers.
    """
    final = str(layout.tmp / "calibration.kvt")  # under tmp/: a crash leaves nothing behind
    # Not closed explicitly: a failed write's traceback may still reference slices of it;
    # the mapping goes with the last reference.
    view = memoryview(mmap.mmap(-1, CALIBRATION_BYTES))
    try:
        view[:] = np.random.default_rng(0).bytes(CALIBRATION_BYTES)  # incompressible
        meta = ObjectMeta(key="\x00calibration", size_bytes=CALIBRATION_BYTES)
        try:
            with Timer() as t:
                stored = await tier.write_file(meta, view, final)
        except StorageFullError:
            return False
        tier.write_meter.record(CALIBRATION_BYTES, t.seconds)
        entry = StoredFile(stored, final, len(encode_header(stored)))
        with Timer() as t:
            await tier.read_file(entry, view, lambda: True)
        tier.read_meter.record(CALIBRATION_BYTES, t.seconds)
        return True
    finally:
        remove_quietly(final)
