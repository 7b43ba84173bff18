"""Every configuration key is documented and shown in the example config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TlsConfig, load_daemon_config
from kvtierd.policy_config import PolicyConfig, parse_policy

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "configuration.md").read_text()
EXAMPLE = ROOT / "configs" / "kvtierd.yaml"


def test_example_config_loads_and_sets_every_key() -> None:
    config = load_daemon_config(EXAMPLE)
    assert [t.name for t in config.tiers] == ["cpu", "ssd"]
    text = EXAMPLE.read_text()
    for f in dataclasses.fields(DaemonConfig):
        assert f"{f.name}:" in text, f.name
    for f in dataclasses.fields(TlsConfig):
        assert f"{f.name}:" in text, f.name


def test_every_daemon_key_is_documented() -> None:
    for f in dataclasses.fields(DaemonConfig):
        assert f"`{f.name}`" in DOC, f.name
    for f in dataclasses.fields(TlsConfig):
        assert f"`tls.{f.name}`" in DOC, f.name
    for option in ("staging_bytes", "arena_dir"):
        assert f"`{option}`" in DOC


@pytest.mark.parametrize("module", ["kvtierd.storage.ssd_options", "kvtierd.storage.remote_format"])
def test_every_tier_option_is_documented(module: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    cls = getattr(mod, "SsdOptions", None) or mod.RemoteOptions
    for f in dataclasses.fields(cls):
        assert f"`{f.name}`" in DOC, f"{module}: {f.name}"


def test_every_policy_key_is_documented() -> None:
    keys = ["placer", "name", "description", "alpha", "selection", "variants.methods",
            "variants.ratios", "profiling.reprofile_threshold", "profiling.interval_s",
            "frequency.half_life_s", "variant"]  # fmt: skip
    for key in keys:
        assert f"`{key}`" in DOC, key
    # and each of them is accepted by the validator
    p = parse_policy(
        "placer: evicpress\nname: n\ndescription: d\nalpha: 2\nselection: absolute\n"
        "variants: {methods: [knorm], ratios: [0.5]}\n"
        "profiling: {reprofile_threshold: 0.1, interval_s: 5}\nfrequency: {half_life_s: 9}\n",
        "all.yaml",
    )
    assert isinstance(p, PolicyConfig) and p.frequency_half_life_s == 9.0


def test_every_kvtierctl_command_is_documented() -> None:
    import argparse

    from kvtierd.cli.main import build_parser

    doc = (ROOT / "docs" / "kvtierctl.md").read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"`{name}" in doc, name
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and name in ("simulate", "report", "bench"):
                    assert flag in doc or flag in _COMMON_FLAGS, (name, flag)


_COMMON_FLAGS = {"--help", "--json", "--socket", "--address", "--tls-ca", "--token",
                 "--token-file", "--timeout", "--debug"}  # fmt: skip
