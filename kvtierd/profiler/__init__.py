"""The EvicPress profiler (paper §4.1, §4.3, §6.3): quality per variant, TTFT model, decayed
frequency, drift-triggered re-profiling, profiles persisted per context. See docs/profiler.md.

Importing this package loads neither torch nor transformers: the quality evaluators
(``attention``, ``answer``, ``served``) are imported on first lookup through
:func:`make_evaluator`, the restore-cost measurement imports the kernels when it first runs.
"""

from kvtierd.profiler.frequency import DecayedCounter, FrequencyTracker
from kvtierd.profiler.profiler import Profiler
from kvtierd.profiler.quality import (
    EVALUATORS,
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
    evaluator_class,
    make_evaluator,
)
from kvtierd.profiler.queries import INITIAL_QUERIES, QueryStore
from kvtierd.profiler.reprofile import (
    Decision,
    DriftSample,
    ReprofileLoop,
    ReprofileScheduler,
    TokenBucket,
)
from kvtierd.profiler.store import ProfileRecord, ProfileStore
from kvtierd.profiler.ttft import RestoreCost, TtftModel

__all__ = [
    "EVALUATORS",
    "INITIAL_QUERIES",
    "ContextKV",
    "DecayedCounter",
    "Decision",
    "DriftSample",
    "FrequencyTracker",
    "ProfileRecord",
    "ProfileStore",
    "Profiler",
    "ProfilingQuery",
    "QualityEvaluator",
    "QualityResult",
    "QueryStore",
    "ReprofileLoop",
    "ReprofileScheduler",
    "RestoreCost",
    "StoredForm",
    "TokenBucket",
    "TtftModel",
    "evaluator_class",
    "make_evaluator",
]
