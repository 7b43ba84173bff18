"""Policy YAML: presets load, bad documents are rejected whole with file:line, key and choices."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtierd.errors import ConfigError
from kvtierd.policies import PLACERS
from kvtierd.policies.loader import default_policy, load_policy, parse_policy
from kvtierd.policy_config import EVALUATORS, PLACER_PARAMS_FIELDS, PolicyConfig
from kvtierd.variants import expand_variants, parse_variant

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs" / "policies").glob("*.yaml"))


def test_presets_exist() -> None:
    names = {p.stem for p in PRESETS}
    assert {"evicpress", "lru", "fixed-knorm-0.5"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_and_names_itself_after_its_file(path: Path) -> None:
    policy = load_policy(path)
    assert policy.name == path.stem
    assert policy.placer in PLACERS.names()
    assert policy.source == str(path)
    assert policy.text == path.read_text()
    assert policy.variants[0] == "none"


def test_evicpress_preset_values() -> None:
    p = load_policy(ROOT / "configs/policies/evicpress.yaml")
    assert p.placer == "evicpress"
    assert p.alpha == 1.0
    assert p.selection == "per_byte"
    assert p.ratios == (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
    assert "knorm+int8" in p.methods
    assert p.reprofile_threshold == 0.05
    assert p.frequency_half_life_s == 3600.0
    # 2 drop methods x 9 ratios + int8 + int4 + knorm+int8 at 9 ratios + none (no snapkv:
    # it needs profiling.model_dir, a path no preset can know)
    assert len(p.variants) == 1 + 18 + 2 + 9
    assert {"knorm@0.5", "int8", "int4", "knorm@0.1+int8"} <= set(p.variants)


def test_fixed_preset() -> None:
    p = load_policy(ROOT / "configs/policies/fixed-knorm-0.5.yaml")
    assert (p.placer, p.fixed_variant, p.variants) == ("fixed", "knorm@0.5", ("none", "knorm@0.5"))


def test_defaults_of_a_minimal_evicpress_policy() -> None:
    p = parse_policy("placer: evicpress\n", "mem.yaml")
    assert p.name == "evicpress"
    assert p.ratios[0] == 1.0 and p.ratios[-1] == 0.1 and len(p.ratios) == 10
    assert p.selection == "per_byte"


def test_expand_variants_grammar() -> None:
    got = expand_variants(("knorm", "int8", "snapkv+int4"), (1.0, 0.5))
    assert got == ("none", "knorm@0.5", "int8", "int4", "snapkv@0.5+int4")


def test_policy_is_frozen() -> None:
    p = default_policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.alpha = 2.0  # type: ignore[misc]
    assert p.placer == "evicpress"


BAD = [
    ("placer: lru\nalpha: 2\n", 2, "alpha", "keys for placer 'lru': name, description, placer"),
    (
        "name: x\nplacer: magic\n",
        2,
        "placer",
        "allowed values: evicpress, fixed, lfu, lru, prefill",
    ),
    ("name: x\n", 0, "placer", "allowed values: evicpress, fixed, lfu, lru, prefill"),
    (
        "placer: evicpress\nvariants:\n  methods:\n    - knorm\n    - zip\n",
        5,
        "variants.methods.1",
        "allowed values: keydiff, knorm",
    ),
    ("placer: evicpress\nvariants:\n  ratios: [1.0, 0]\n", 3, "variants.ratios.1", "(0, 1]"),
    ("placer: evicpress\nalpha: -1\n", 2, "alpha", "> 0"),
    ("placer: evicpress\nalpha: yes\n", 2, "alpha", "expected a number"),
    ("placer: evicpress\nselection: best\n", 2, "selection", "per_byte, absolute"),
    (
        "placer: evicpress\nprofiling:\n  threshold: 0.1\n",
        3,
        "profiling.threshold",
        "reprofile_threshold, interval_s",
    ),
    ("placer: evicpress\nfrequency:\n  half_life_s: 0\n", 3, "frequency.half_life_s", "> 0"),
    ("placer: evicpress\nvariants: [knorm]\n", 2, "variants", "must be a mapping"),
    ("placer: fixed\n", 0, "variant", "requires key 'variant'"),
    ("placer: fixed\nvariant: knorm\n", 2, "variant", "<method>@<ratio>"),
    ("placer: fixed\nvariant: knorm@0.5+int3\n", 2, "variant", "int8, int4"),
    (
        "placer: evicpress\nvariants:\n  methods: [knorm, snapkv-pool=4]\n",
        3,
        "variants.methods.1",
        "pool=4 is not allowed; pool must be an integer >= 1, odd",
    ),
    ("placer: fixed\nvariant: snapkv-window=64@0.5\n", 2, "variant", "window at the default"),
    (
        "placer: evicpress\nvariants:\n  methods: [knorm, snapkv-window=32+int8]\n",
        3,
        "variants.methods",
        "snapkv-window=32+int8 without profiling.model_dir: snapkv scores tokens by the attention",
    ),
    ("placer: fixed\nvariant: snapkv@0.5\n", 2, "variant", "Set profiling.model_dir to that"),
    (
        "placer: fixed\nvariant: knorm@0.5\nprofiling:\n  evaluator: answer\n",
        4,
        "profiling.evaluator",
        "allowed keys for placer 'fixed': model_dir",
    ),
]


@pytest.mark.parametrize(("text", "line", "key", "allowed"), BAD)
def test_bad_documents_name_line_key_and_allowed_values(
    text: str, line: int, key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "p.yaml")
    msg = str(info.value)
    assert msg.startswith(f"p.yaml:{line}: {key}") if line else msg.startswith("p.yaml")
    assert key in msg
    assert allowed in msg


def test_not_yaml_and_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"p.yaml: not valid YAML"):
        parse_policy("placer: [\n", "p.yaml")
    with pytest.raises(ConfigError, match=r"must be a mapping"):
        parse_policy("- lru\n", "p.yaml")


def test_load_policy_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read policy file"):
        load_policy(tmp_path / "nope.yaml")


def test_snapkv_needs_the_model_that_recomputes_its_window_queries() -> None:
    """The daemon builds and profiles snapkv with window queries recomputed from
    ``profiling.model_dir``: a grid or fixed variant with snapkv names it, or is refused
    (BAD above); snapkv at ratio 1.0 alone is the original and needs nothing."""
    grid = "variants:\n  methods: [knorm, snapkv]\n  ratios: [1.0, 0.5]\n"
    p = parse_policy(f"placer: evicpress\n{grid}profiling:\n  model_dir: /m\n", "p.yaml")
    assert "snapkv@0.5" in p.variants and p.evaluator_model_dir == "/m"
    fixed = "placer: fixed\nvariant: snapkv@0.5\nprofiling:\n  model_dir: /m\n"
    assert parse_policy(fixed, "p.yaml").evaluator_model_dir == "/m"
    only_original = "placer: evicpress\nvariants:\n  methods: [knorm, snapkv]\n  ratios: [1.0]\n"
    assert parse_policy(only_original, "p.yaml").variants == ("none",)
    assert parse_policy("placer: fixed\nvariant: snapkv@1\n", "p.yaml").variants == ("none",)
    assert not any(v.startswith("snapkv") for v in default_policy().variants)


def test_fixed_variant_is_normalised() -> None:
    p = parse_policy("placer: fixed\nvariant: ' knorm@0.50+int8'\n", "p.yaml")
    assert p.fixed_variant == "knorm@0.5+int8"


# -- the policy accepts exactly what the variant grammar accepts -------------------------------


OPTION_TEXTS = [
    "snapkv-window=32", "snapkv-pool=7", "snapkv-window=1-pool=1", "snapkv-window=64",
    "snapkv-pool=7-window=32", "snapkv-pool=4", "snapkv-window=0", "snapkv-window=032",
    "snapkv-window", "snapkv-window=8-window=9", "knorm-window=8", "streamingllm-sinks=0",
    "streamingllm-sinks=4", "paged_eviction_block-page=8-keep_ends=1",
    "paged_eviction_block-keep_ends=2", "paged_eviction_block-page=0", "keydiff-",
]  # fmt: skip


@pytest.mark.parametrize("method", OPTION_TEXTS)
def test_method_options_accepted_exactly_where_the_kernels_accept_them(method: str) -> None:
    model = "profiling:\n  model_dir: /m\n"  # snapkv needs it (test above)
    text = f"placer: evicpress\nvariants:\n  methods: [{method}]\n  ratios: [0.5]\n{model}"
    try:
        kernel_ok = str(parse_variant(f"{method}@0.5")) == f"{method}@0.5"
    except ValueError:
        kernel_ok = False
    try:
        variants = parse_policy(text, "p.yaml").variants
    except ConfigError:
        assert not kernel_ok, method
    else:
        assert kernel_ok and variants == ("none", f"{method}@0.5"), method
    fixed = f"placer: fixed\nvariant: {method}@0.5\n{model}"
    if kernel_ok:
        assert parse_policy(fixed, "p.yaml").fixed_variant == f"{method}@0.5"
    else:
        with pytest.raises(ConfigError, match="bad variant"):
            parse_policy(fixed, "p.yaml")


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_expanded_variant_parses_in_the_kernel_grammar(path: Path) -> None:
    for name in load_policy(path).variants:
        assert str(parse_variant(name)) == name


def test_evaluator_names_are_the_registered_built_ins() -> None:
    from kvtierd.profiler import EVALUATORS as REGISTRY

    assert set(EVALUATORS) == set(REGISTRY.names())


def test_expensive_evaluators_are_the_ones_that_decode_answers() -> None:
    from kvtierd.policy_config import DEFAULT_ESTIMATOR, EXPENSIVE_EVALUATORS

    assert set(EXPENSIVE_EVALUATORS) == {"answer", "served"} <= set(EVALUATORS)
    assert DEFAULT_ESTIMATOR in EVALUATORS and DEFAULT_ESTIMATOR not in EXPENSIVE_EVALUATORS


EVICPRESS = "placer: evicpress\n"


@pytest.mark.parametrize(
    ("profiling", "estimator", "evaluator", "error"),
    [
        # the default estimator alone: nothing refines
        ("", "query_attention", "query_attention", 0.1),
        ("{evaluator: answer, model_dir: /m}", "query_attention", "answer", 0.1),
        ("{evaluator: attention}", "attention", "attention", 0.1),  # before issue 26's keys
        ("{estimator: attention, evaluator: answer, estimator_error: 0.25}", "attention",
         "answer", 0.25),
        ("{estimator: attention, evaluator: attention}", "attention", "attention", 0.1),
    ],
)  # fmt: skip
def test_the_estimator_and_the_evaluator_that_refines_it(
    profiling: str, estimator: str, evaluator: str, error: float
) -> None:
    text = EVICPRESS + (f"profiling: {profiling}\n" if profiling else "")
    p = parse_policy(text, "p.yaml")
    assert (p.estimator, p.evaluator, p.estimator_error) == (estimator, evaluator, error)
    assert p.refines == (evaluator != estimator)


@pytest.mark.parametrize(
    ("profiling", "match"),
    [
        ("{estimator: answer}", r"p.yaml:2: profiling.estimator: 'answer' decodes answers"),
        ("{estimator: served}", r"profiling.estimator: 'served' decodes answers .* attention"),
        ("{estimator: nope}", r"profiling.estimator: 'nope' is not allowed; allowed values: "
                              r"attention"),
        ("{estimator_error: 1.5}", r"profiling.estimator_error: must be in \[0, 1\]"),
        ("{estimator_error: x}", r"profiling.estimator_error: expected a number"),
    ],
)  # fmt: skip
def test_a_bad_estimator_is_refused_naming_the_key(profiling: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_policy(EVICPRESS + f"profiling: {profiling}\n", "p.yaml")


def test_a_cheap_evaluator_beside_another_estimator_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two cheap names: which one profiles? (A refiner is ``answer`` or ``served``.) Another
    cheap estimator is what issue 26 adds beside ``attention``."""
    import kvtierd.policy_config as config

    monkeypatch.setattr(config, "EVALUATORS", (*config.EVALUATORS, "cheap-b"))
    text = EVICPRESS + "profiling: {estimator: attention, evaluator: cheap-b}\n"
    with pytest.raises(ConfigError, match=r"profiling.evaluator: 'cheap-b' is a cheap estimator "
                                          r"and profiling.estimator is 'attention'"):  # fmt: skip
        parse_policy(text, "p.yaml")
    alone = parse_policy(EVICPRESS + "profiling: {evaluator: cheap-b}\n", "p.yaml")
    assert (alone.estimator, alone.refines) == ("cheap-b", False)  # the old spelling


def test_each_placer_reads_only_its_own_keys() -> None:
    """The loader asks the placer: a key another placer reads is refused, naming the keys this
    placer allows, and a placer registered with its own schema is read by it."""
    from dataclasses import replace

    from kvtierd.policies.lru import LruPlacer
    from kvtierd.policy_config import PolicyDocument

    keys = "name, description, placer, alpha, selection, variants, profiling, frequency"
    with pytest.raises(ConfigError, match=rf"p\.yaml:2: variant: unknown key; keys for placer "
                       rf"'evicpress': {keys}$"):  # fmt: skip
        parse_policy("placer: evicpress\nvariant: int8\n", "p.yaml")

    class Tagged(LruPlacer):
        name = "tagged"
        policy_keys = ("tag",)

        @classmethod
        def read_policy(cls, doc: PolicyDocument, policy: PolicyConfig) -> PolicyConfig:
            return replace(policy, description=doc.text_value(("tag",), "none"))

    with PLACERS.registered(Tagged):
        assert parse_policy("placer: tagged\ntag: x\n", "p.yaml").description == "x"
        with pytest.raises(ConfigError, match=r"keys for placer 'tagged': name, description, "
                           r"placer, tag$"):  # fmt: skip
            parse_policy("placer: tagged\nalpha: 2\n", "p.yaml")


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_mapping_onto_placer_params(path: Path) -> None:
    from kvtierd.policies import PlacerParams

    names = {f.name for f in dataclasses.fields(PlacerParams)}
    assert set(PLACER_PARAMS_FIELDS) == names
    policy = load_policy(path)
    params = PlacerParams(**{f: getattr(policy, a) for f, a in PLACER_PARAMS_FIELDS.items()})
    assert params.alpha == policy.alpha
    assert params.fixed_variant == policy.fixed_variant
    assert isinstance(policy, PolicyConfig)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_a_placer_declares_every_attribute_its_schema_sets(path: Path) -> None:
    """``Placer.policy_fields`` (what ``kvtierctl policy validate`` shows) covers every
    attribute a policy of that placer sets beyond the common ones."""
    policy = load_policy(path)
    bare = PolicyConfig(policy.name, policy.placer, policy.description, source=policy.source,
                        text=policy.text)  # fmt: skip
    changed = {f.name for f in dataclasses.fields(PolicyConfig)
               if getattr(policy, f.name) != getattr(bare, f.name)}  # fmt: skip
    assert changed <= set(PLACERS.get(policy.placer).policy_fields)


def test_profiling_scoring_reaches_the_answer_evaluators() -> None:
    """``profiling.scoring`` (issue 26): similarity by default, exact_match on request, built
    into ``answer``; anything else is refused naming the allowed values."""
    from kvtierd.engine.profiling.profiler_factory import evaluator_options

    base = "placer: evicpress\nprofiling:\n  evaluator: answer\n  model_dir: /m\n"
    assert parse_policy(base, "p.yaml").evaluator_scoring == "similarity"
    exact = parse_policy(base + "  scoring: exact_match\n", "p.yaml")
    assert evaluator_options(exact, "answer", "/s") == {
        "model_path": "/m",
        "scoring": "exact_match",
    }
    with pytest.raises(ConfigError, match="'bleu' is not allowed; allowed values: similarity"):
        parse_policy(base + "  scoring: bleu\n", "p.yaml")
    qa = parse_policy("placer: evicpress\nprofiling:\n  evaluator: query_attention\n", "p.yaml")
    assert evaluator_options(qa, "query_attention", "/s") == {"model_dir": ""}
