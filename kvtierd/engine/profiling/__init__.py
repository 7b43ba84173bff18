"""Profiling in the daemon (EvicPress §4.1, §4.3): which contexts are profiled when, by which
evaluator, with which inputs; the engine builds the parts and hands them to
:class:`~kvtierd.engine.profiling.profiling_service.ProfilingService`.

Nothing is imported here: ``observation_window`` is also read by the executor's builds
(``context_kv.py``, ``servable.py``), which must not load the service with it.
"""
