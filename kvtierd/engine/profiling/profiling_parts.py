"""What the profiling service is handed: the parts the engine builds for it (the engine is the
one place that builds parts, so a test or another wiring can replace any of them)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.profiling.ancestor_kv import AncestorReader
from kvtierd.engine.profiling.profile_inputs import ProfileInputs
from kvtierd.engine.profiling.profile_runs import RunLog
from kvtierd.engine.profiling.profiling_model import ProfilingModel
from kvtierd.engine.profiling.refinement import Refinement
from kvtierd.engine.servable import Servability
from kvtierd.engine.tokens import TokenBudget
from kvtierd.profiler.prefill_fit import PrefillFit, ServedReports
from kvtierd.profiler.yield_gate import YieldGate


@dataclass(frozen=True, slots=True)
class ProfilingParts:
    """``worker``: the one thread the profiler runs on (it is not thread-safe);
    ``prefill_fit``/``served``: vLLM's prefill speed, kept across policy reloads;
    ``yield_gate``: where profiling steps wait for serving; ``options``: the contexts priced
    for the placer; ``inputs``: their token ids and queries; ``ancestors``: the KV a child
    context is scored after; ``refinement``: which context the refining evaluator takes next;
    ``model``: which checkpoint profiles read (the policy's, or the model cache's)."""

    worker: ThreadPoolExecutor
    prefill_fit: PrefillFit
    served: ServedReports
    yield_gate: YieldGate
    run_log: RunLog
    tokens: TokenBudget
    servable: Servability
    options: ContextOptions
    inputs: ProfileInputs
    ancestors: AncestorReader
    refinement: Refinement
    model: ProfilingModel
