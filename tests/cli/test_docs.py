"""Every configuration key is documented and shown in the example config."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TlsConfig, load_daemon_config
from kvtierd.policies.loader import parse_policy
from kvtierd.policy_config import PolicyConfig

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
    """Every command and subcommand (`contexts ls`, `profile run`, ...) and every flag of each
    appears in docs/kvtierctl.md."""
    import argparse

    from kvtierd.cli.main import build_parser

    doc = (ROOT / "docs" / "kvtierctl.md").read_text()

    def commands(
        parser: argparse.ArgumentParser, prefix: str
    ) -> list[tuple[str, argparse.ArgumentParser]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [(prefix, parser)]
        found = [(prefix, parser)] if prefix else []
        for name, child in subs[0].choices.items():
            found += commands(child, f"{prefix} {name}".strip())
        return found

    listed = commands(build_parser(), "")
    names = [name for name, _ in listed]
    for expected in ("profile run", "profile status", "queries add", "contexts show"):
        assert expected in names
    for name, parser in listed:
        assert f"`{name}" in doc, name
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--"):
                    assert flag in doc or flag in _COMMON_FLAGS, (name, flag)


_COMMON_FLAGS = {"--help", "--json", "--socket", "--address", "--tls-ca", "--token",
                 "--token-file", "--timeout", "--debug"}  # fmt: skip


def _documented_kvtierctl_lines() -> list[tuple[str, str]]:
    """``(file, command line)`` for every ``kvtierctl ...`` the docs give: inline code spans
    and code-block lines (``$ `` prompt or not), cut at a shell pipe or comment."""
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
             *sorted((ROOT / "configs").rglob("*.sh"))]  # fmt: skip
    found = []
    for path in files:
        text = path.read_text()
        spans = re.findall(r"`(kvtierctl(?: [^`]*)?)`", text)
        lines = [
            line.strip().removeprefix("$ ")
            for line in text.splitlines()
            if line.strip().removeprefix("$ ").startswith("kvtierctl ")
        ]
        for line in [*spans, *lines]:
            found.append((path.name, re.split(r" [|#]|\s{2,}", line)[0].strip()))
    return found


def test_every_documented_kvtierctl_command_line_is_a_real_command() -> None:
    """A doc naming a command the CLI lacks (``contexts describe`` for ``contexts show``) or a
    flag it does not take fails here: words name subcommands down to a command, and every
    ``--flag`` after it is one of that command's."""
    import argparse

    from kvtierd.cli.main import build_parser

    lines = _documented_kvtierctl_lines()
    assert any("contexts show" in line for _, line in lines)
    for name, line in lines:
        parser = build_parser()
        words = line.split()[1:]
        while words:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not subs or words[0].startswith("-"):
                break
            assert words[0] in subs[0].choices, f"{name}: `{line}`: no command {words[0]!r}"
            parser = subs[0].choices[words.pop(0)]
        flags = {f for a in parser._actions for f in a.option_strings}
        for word in words:
            flag = word.split("=")[0]
            if flag.startswith("--"):
                assert flag in flags, f"{name}: `{line}`: {flag} is not an option of it"
