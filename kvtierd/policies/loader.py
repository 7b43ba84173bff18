"""Policy documents into :class:`~kvtierd.policy_config.PolicyConfig`: the loader asks the
named placer for its schema.

A document names a placer (``placer:``), may name itself and describe itself (``name:``,
``description:``); every other top-level key belongs to the placer: the class lists the keys it
reads (``Placer.policy_keys``, e.g. ``fixed``: ``variant``) and reads them
(``Placer.read_policy``). A key the placer does not read is an error naming the keys it does;
an unknown placer is an error naming the registered ones (``PLACERS``). Keys and their values:
docs/configuration.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtierd.policies.base import PLACERS
from kvtierd.policy_config import PolicyConfig, PolicyDocument
from kvtierd.yaml_source import read_file

COMMON_KEYS: tuple[str, ...] = ("name", "description", "placer")
"""Top-level keys of every policy, whatever its placer."""

DEFAULT_POLICY_TEXT = """\
# The daemon's embedded default: EvicPress with the default variant grid.
name: evicpress
placer: evicpress
"""


def parse_policy(text: str, source: str) -> PolicyConfig:
    """Validate a whole policy document; ``source`` names it in error messages."""
    doc = PolicyDocument(text, source)
    name = doc.choice(("placer",), PLACERS.names())
    placer = PLACERS.get(name)
    doc.check_keys((), (*COMMON_KEYS, *placer.policy_keys), f"keys for placer {name!r}")
    policy = PolicyConfig(
        name=doc.text_value(("name",), name),
        placer=name,
        description=doc.text_value(("description",), ""),
        source=source,
        text=text,
    )
    return placer.read_policy(doc, policy)


def load_policy(path: str | os.PathLike[str]) -> PolicyConfig:
    """Read and validate a policy file."""
    p = Path(path)
    return parse_policy(read_file(p, "policy"), str(p))


def default_policy() -> PolicyConfig:
    """The policy a daemon runs when its config names none: EvicPress (issue 5), every other
    setting at its default."""
    return parse_policy(DEFAULT_POLICY_TEXT, "embedded")
