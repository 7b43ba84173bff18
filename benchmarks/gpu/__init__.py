"""``scripts/gpu-check``: the whole GPU path checked in one prepared command (issue 31).

``--prepare`` (here, with a package registry) builds the wheelhouse the device machine lacks
(``wheelhouse.py``); the run (on a lent GPU machine, or here to check that it would run) walks
the steps of ``steps.py``, each in its own process with its own timeout, and writes
``gpu-check.json`` / ``gpu-check.md`` after every step (``report.py``). docs/gpu-check.md says
what each step checks and where its figures go.
"""
