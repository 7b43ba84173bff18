"""The benchmarks, by purpose (benchmarks/README.md lists each one and what it measures):
``e2e/`` (the end-to-end family and the simulator's projection), ``micro/`` (one part of the
daemon against a limit or a baseline), ``quality/`` (labels, estimators, answer quality),
``gpu/`` (``scripts/gpu-check``'s harness and its recorded runs) and ``_support/`` (helpers
the benchmarks share with the tests: the daemon harness, the tiny models, the test stack).
Results are in benchmarks/RESULTS.md.

Run each as a module from the repository root, ``.venv/bin/python -m
benchmarks.micro.bench_daemon``: then ``benchmarks`` is this checkout's package, with no path
edits. Started as a file instead, Python would put the benchmark's own folder first on the path
and could take ``benchmarks`` from another checkout or site-packages; a benchmark started as a
file stops here with the command to use.
"""

import sys
from pathlib import Path

_main = sys.modules.get("__main__")
_script = getattr(_main, "__file__", None)
_as_file = _script is not None and getattr(_main, "__spec__", None) is None
_here = Path(__file__).resolve().parent
if _as_file and Path(str(_script)).resolve().is_relative_to(_here):
    _module = ".".join(Path(str(_script)).resolve().relative_to(_here.parent).with_suffix("").parts)
    sys.exit(
        f"run the benchmarks as modules from the repository root: "
        f"python -m {_module} (not python {_script})"
    )
