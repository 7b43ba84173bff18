"""The profiler a policy asks for: its quality evaluator, built with the options the policy
gives it (the one place where policy keys become evaluator options), and the TTFT model that
prices restore and prefill."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvtierd.config import DaemonConfig
from kvtierd.policy_config import PolicyConfig
from kvtierd.profiler.prefill_fit import PrefillFit
from kvtierd.profiler.yield_gate import YieldGate

if TYPE_CHECKING:
    from kvtierd.profiler import Profiler


def evaluator_options(policy: PolicyConfig, name: str, daemon_socket: str) -> dict[str, str]:
    """What the policy's evaluator ``name`` is built with (``make_evaluator``): ``answer``
    decodes with the policy's model; ``served`` asks the policy's router (and vLLM) and
    evicts what it stored from the daemon at ``daemon_socket``; ``query_attention`` runs
    questions through the policy's model; ``attention`` needs nothing."""
    return {
        "answer": {"model_path": policy.evaluator_model_dir,
                   "scoring": policy.evaluator_scoring},
        "served": {"router_url": policy.evaluator_router_url,
                   "vllm_url": policy.evaluator_vllm_url,
                   "daemon_socket": daemon_socket},
        "query_attention": {"model_dir": policy.evaluator_model_dir},
    }.get(name, {})  # fmt: skip


def make_profiler(
    policy: PolicyConfig,
    config: DaemonConfig,
    *,
    prefill_fit: PrefillFit,
    yield_gate: YieldGate,
    is_busy: Callable[[], bool],
) -> Profiler:
    """A profiler for ``policy`` (not loaded yet), keeping its files in the daemon's
    ``data_dir``: the policy's estimator, and its refining evaluator when it names one
    (``PolicyConfig.refines``); their steps wait at ``yield_gate`` while requests are served."""
    from kvtierd.profiler import Profiler, QualityEvaluator, TtftModel, make_evaluator

    def made(name: str) -> QualityEvaluator:
        evaluator = make_evaluator(name, evaluator_options(policy, name, config.socket_path))
        evaluator.yield_gate = yield_gate
        return evaluator

    # Restore and prefill times; the load times are the tiers' own (``tier_models``).
    ttft = TtftModel(prefill_tokens_per_s=config.prefill_tokens_per_s, fit=prefill_fit)
    refiner = made(policy.evaluator) if policy.refines else None
    directory = Path(config.data_dir) / "profiler"
    return Profiler(made(policy.estimator), ttft, policy=policy, refiner=refiner,
                    directory=directory, is_busy=is_busy)  # fmt: skip
