"""The benchmarks: run each as a module from the repository root,
``.venv/bin/python -m benchmarks.bench_daemon`` (results in benchmarks/RESULTS.md).

As modules, ``benchmarks`` and ``tests`` (whose daemon harness, ``tests/daemon_proc.py``, and
stack helpers the benchmarks share with the tests) are this checkout's packages, with no path
edits: started as a file instead, Python would put ``benchmarks/`` first on the path and could
take another ``tests`` package from site-packages (one ships with cufile-python). A benchmark
started as a file stops here with the command to use.
"""

import sys
from pathlib import Path

_main = sys.modules.get("__main__")
_script = getattr(_main, "__file__", None)
_as_file = _script is not None and getattr(_main, "__spec__", None) is None
if _as_file and Path(str(_script)).resolve().parent == Path(__file__).resolve().parent:
    sys.exit(
        f"run the benchmarks as modules from the repository root: "
        f"python -m benchmarks.{Path(str(_script)).stem} (not python {_script})"
    )
