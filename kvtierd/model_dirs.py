"""Which checkpoints a policy applied at run time may load (issue 27.8): ``ApplyPolicy`` is an
admin's call, over TCP too, and ``profiling.model_dir`` is a directory the daemon loads weights
from, so it must lie in a directory the daemon's own configuration names (``model_dirs``;
kvtierd's model cache when none) or be the one the daemon started with, and no other user may
be able to write it (``/etc`` was accepted, and so was a directory another user can write).

The same rules decide whether the daemon may profile with the model cache's checkpoint when
its policy names none (issue 39, ``engine/profiling/profiling_model.py``), so they live in the
bottom layer, below both the servicer and the engine.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from kvtierd.errors import PermissionDeniedError
from kvtierd.model_fetch import model_cache_dir


def allowed_model_roots(configured: Sequence[str]) -> tuple[str, ...]:
    """The directories a loaded ``profiling.model_dir`` may lie in: the daemon config's
    ``model_dirs``, else kvtierd's model cache."""
    return tuple(configured) or (str(model_cache_dir()),)


def check_model_dir(model_dir: str, allowed: Sequence[str], started_with: str = "") -> None:
    """Raise ``PermissionDeniedError`` unless ``model_dir`` (``""``: none) may be loaded."""
    if not model_dir or model_dir == started_with:
        return
    real = Path(model_dir).resolve()
    roots = [Path(a).resolve() for a in allowed]
    if not any(real == r or r in real.parents for r in roots):
        raise PermissionDeniedError(
            f"profiling.model_dir {model_dir!r} is not in a directory the daemon allows "
            f"({', '.join(map(str, roots)) or 'none'}): name it in the daemon's config "
            "(model_dirs), or in its policy_file"
        )
    try:
        st = real.stat()
    except OSError as e:
        raise PermissionDeniedError(f"profiling.model_dir {model_dir!r}: {e.strerror}") from e
    if st.st_uid not in (0, os.getuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionDeniedError(
            f"profiling.model_dir {model_dir!r} is writable by other users or belongs to "
            f"uid {st.st_uid}: another user could change the weights the daemon loads"
        )
