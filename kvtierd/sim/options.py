"""Command-line options of ``kvtierd sim``, turned into a :class:`SimulationConfig`.

* The **placer** (every command): a policy file (``--policy``: placer, alpha, selection,
  variant grid, frequency half-life) or a name (``--placer``: ``evicpress``, ``lru``, ``lfu``,
  ``prefill``, ``fixed:knorm@0.5``); what EvicPress knows of frequencies (``--frequency``);
  whether a load slower than prefill is recomputed (``--no-recompute`` turns that off); how
  long a lookup holds what it finds (``--hold-s``).
* The **synthetic workload** (``run``, ``sweep``, ``report``): contexts drawn from the paper's
  datasets (after a shared system prompt of ``--system-prompt-tokens``), Zipf popularity,
  Poisson arrivals or a CSV trace's timestamps, the paper's tiers (§6.1: DRAM 20 GB/s, SSD
  2 GB/s, unbounded remote 1 GB/s) with capacities from ``--dram`` and ``--ssd``. ``predict``
  takes a workload file and a calibration instead (:mod:`.predict`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from kvtierd.cli.exit_codes import CliError, ExitCode
from kvtierd.cli.policy import read_policy
from kvtierd.config import parse_size
from kvtierd.errors import ConfigError
from kvtierd.policy_config import PolicyConfig
from kvtierd.sim.frontier import DEFAULT_ALPHAS
from kvtierd.sim.replay import FREQUENCIES, PAPER_TIERS, SimulationConfig
from kvtierd.sim.variant_space import METHOD_MEDIAN, VariantSpace
from kvtierd.sim.workload import MODELS, WorkloadConfig
from kvtierd.types import TierModel
from kvtierd.variants import QUANT_BITS, expand_variants, parse_grid_method


def add_placer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placer")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--policy",
        metavar="FILE",
        help="placer, alpha, selection, variant grid and frequency half-life "
        "from a policy file (configs/policies/*.yaml)",
    )
    src.add_argument(
        "--placer",
        default="evicpress",
        help="placer name: evicpress, lru, lfu, prefill, fixed:VARIANT (default: evicpress)",
    )
    g.add_argument(
        "--alpha",
        type=float,
        default=None,
        help="EvicPress quality weight in 1/s (default: the policy's, else 1)",
    )
    g.add_argument(
        "--frequency",
        choices=FREQUENCIES,
        default="online",
        help="what EvicPress knows of each context's frequency: the decayed count of the "
        "requests seen so far (online, default) or the true expected count (oracle)",
    )
    g.add_argument(
        "--no-recompute",
        action="store_true",
        help="load from a tier even when recomputing would be faster (the old baselines); "
        "by default a request loads only when the daemon's rule says so "
        "(kvtierd.utility.loaded_prefix: the load beats the prefill it saves by 10%%)",
    )
    g.add_argument(
        "--hold-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="a lookup that finds a context holds it this long against the placer's drops and "
        "compressions, as kvtierd's LMCache plugin does (its kvtierd.hold_s: 30); default 0",
    )


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated workload")
    g.add_argument(
        "--model",
        default="llama-3.1-8b",
        choices=sorted(MODELS),
        help="model preset (KV bytes per token, prefill roofline)",
    )
    g.add_argument(
        "--trace",
        metavar="CSV",
        default="",
        help="arrival timestamps from an Azure / BurstGPT CSV trace",
    )
    g.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    g.add_argument("--contexts", type=int, default=555, help="distinct contexts (default 555)")
    g.add_argument("--requests", type=int, default=20000, help="requests (default 20000)")
    g.add_argument("--zipf", type=float, default=0.8, help="Zipf exponent of popularity")
    g.add_argument("--qps", type=float, default=5.4, help="Poisson arrival rate without --trace")
    g.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the same N-token system prompt before every context, a context every request "
        "needs (default 0: none)",
    )
    g.add_argument("--dram", default="80GB", help="DRAM tier capacity (default 80GB)")
    g.add_argument("--ssd", default="800GB", help="SSD tier capacity (default 800GB)")


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--alphas",
        type=float,
        nargs="+",
        default=list(DEFAULT_ALPHAS),
        metavar="A",
        help="EvicPress alphas of the sweep",
    )
    g.add_argument(
        "--quality-target",
        type=float,
        default=0.8,
        help="quality floor for the QPS-at-equal-TTFT comparison (default 0.8)",
    )
    g.add_argument(
        "--no-oracle",
        action="store_true",
        help="skip EvicPress with oracle frequencies (the upper bound; half the sweep's runs)",
    )


@dataclass(frozen=True, slots=True)
class PlacerChoice:
    """The placer a command line names, with what its policy file sets."""

    placer: str
    alpha: float
    selection: str
    half_life_s: float
    policy: PolicyConfig | None

    @property
    def grid(self) -> tuple[str, ...]:
        """The policy's variant names (``none`` first), or ``()`` without a policy."""
        p = self.policy
        return expand_variants(p.methods, p.ratios) if p is not None else ()


def positive(value: float, flag: str) -> None:
    if value <= 0:
        raise CliError(ExitCode.USAGE, f"{flag} must be > 0, got {value:g}")


def placer_choice(args: argparse.Namespace) -> PlacerChoice:
    """The placer of ``--policy`` or ``--placer``, ``--alpha`` applied (CliError if bad)."""
    if args.policy:
        _, policy = read_policy(args.policy)
        # a placer's argument (``fixed:<variant>``) is the policy's fixed variant
        spec = f"{policy.placer}:{policy.fixed_variant}" if policy.fixed_variant else policy.placer
        choice = PlacerChoice(
            spec, policy.alpha, policy.selection, policy.frequency_half_life_s, policy
        )
    else:
        from kvtierd.policies import placer_class

        try:
            placer_class(args.placer)
        except ValueError as e:
            raise CliError(ExitCode.INVALID, str(e)) from e
        choice = PlacerChoice(args.placer, 1.0, "per_byte", 3600.0, None)
    if args.alpha is not None:
        positive(args.alpha, "--alpha")
        choice = replace(choice, alpha=args.alpha)
    return choice


def apply_choice(
    cfg: SimulationConfig, choice: PlacerChoice, args: argparse.Namespace
) -> SimulationConfig:
    """``cfg`` running ``choice`` with the command line's frequency, recompute and hold
    options."""
    if args.hold_s < 0:
        raise CliError(ExitCode.USAGE, f"--hold-s must be >= 0, got {args.hold_s:g}")
    return replace(
        cfg,
        placer=choice.placer,
        alpha=choice.alpha,
        selection=choice.selection,
        half_life_s=choice.half_life_s,
        frequency=args.frequency,
        recompute_slower_loads=not args.no_recompute,
        hold_s=args.hold_s,
    )


def _tiers(args: argparse.Namespace) -> tuple[TierModel, ...]:
    sizes: dict[str, int] = {}
    for name, flag in (("dram", "--dram"), ("ssd", "--ssd")):
        try:
            sizes[name] = parse_size(getattr(args, name), flag)
        except ConfigError as e:
            raise CliError(ExitCode.USAGE, str(e)) from e
    return tuple(
        replace(t, capacity_bytes=sizes[t.name]) if t.name in sizes else t for t in PAPER_TIERS
    )


def _workload(args: argparse.Namespace) -> WorkloadConfig:
    for value, flag in (
        (args.contexts, "--contexts"),
        (args.requests, "--requests"),
        (args.qps, "--qps"),
    ):
        positive(value, flag)
    if args.system_prompt_tokens < 0:
        raise CliError(
            ExitCode.USAGE, f"--system-prompt-tokens must be >= 0, got {args.system_prompt_tokens}"
        )
    if args.trace and not Path(args.trace).is_file():
        raise CliError(ExitCode.INVALID, f"trace {args.trace}: no such file")
    return WorkloadConfig(
        model=args.model,
        n_contexts=args.contexts,
        n_requests=args.requests,
        zipf_s=args.zipf,
        arrival="trace" if args.trace else "poisson",
        qps=args.qps,
        trace_path=args.trace,
        seed=args.seed,
        shared_prefix_tokens=args.system_prompt_tokens,
    )


def variant_space(policy: PolicyConfig) -> VariantSpace:
    """The simulator's variants for a policy's grid. The simulator models the quality of
    keydiff, knorm and snapkv and of int8/int4; a composed ``<drop>+<quant>`` method adds that
    quantization on top of every modelled drop method (the simulator's grid is a product)."""
    drops, quants, composed = [], [], []
    for m in policy.methods:
        v = parse_grid_method(m)  # the policy checked it
        if not v.drops_tokens:
            quants.append(v.quant)
        elif v.drop_method in METHOD_MEDIAN:
            drops.append(v.drop_method)
            if v.quant:
                composed.append(v.quant)
        else:
            modelled = ", ".join([*METHOD_MEDIAN, *QUANT_BITS])
            raise CliError(
                ExitCode.INVALID,
                f"{policy.source}: method {m!r} has no quality model in the simulator "
                f"(modelled: {modelled}, and <drop>+<quant> of those)",
            )
    ratios = tuple(r for r in policy.ratios if r < 1.0)
    return VariantSpace(
        methods=tuple(dict.fromkeys(drops)),
        ratios=ratios if drops else (),
        quant=tuple(dict.fromkeys(quants)),
        compose_with=tuple(dict.fromkeys(composed)),
    )


def build_config(args: argparse.Namespace) -> SimulationConfig:
    """The simulation of the synthetic workload the command line describes (raises CliError
    on bad input)."""
    choice = placer_choice(args)
    policy = choice.policy
    space = variant_space(policy) if policy and policy.placer == "evicpress" else VariantSpace()
    fixed = choice.placer.partition(":")[2]
    if fixed and fixed not in space.names():
        raise CliError(
            ExitCode.INVALID,
            f"placer {choice.placer!r}: the simulator has no variant {fixed!r}; "
            f"known: {', '.join(space.names())}",
        )
    base = SimulationConfig(workload=_workload(args), variants=space, tiers=_tiers(args))
    return apply_choice(base, choice, args)
