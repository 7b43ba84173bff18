"""The plugin's log lines in vLLM's log.

vLLM configures its own ``vllm`` logger and LMCache its ``lmcache`` ones; nobody configures
``kvtierd``. Its records then reach Python's last-resort handler, which prints WARNING and up:
the plugin's INFO lines — a dropped store's "N chunks NOT stored", the end of an outage — never
appeared in vLLM's log (issue 41), only the outage's WARNING did. So where nothing handles the
``kvtierd`` logger (no handler on it or above it), the plugin gives it one, to stderr as vLLM
logs, at INFO. A process that configured logging itself (a handler on ``kvtierd`` or the root)
is left as it is.
"""

from __future__ import annotations

import logging

LOGGER = "kvtierd"
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def ensure_plugin_log() -> bool:
    """Give the ``kvtierd`` logger a stderr handler at INFO unless one handles it already;
    whether one was added."""
    log = logging.getLogger(LOGGER)
    if log.hasHandlers():
        return False
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    return True
