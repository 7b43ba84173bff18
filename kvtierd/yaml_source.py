"""The YAML reader of kvtierd's documents (the daemon config, policies): refuses aliases and
oversized input, refuses duplicate keys, and remembers the file and line of every key so that
an error names ``file:line: key``. Used by ``config.py`` and ``policy_config.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from kvtierd.errors import ConfigError

MAX_YAML_BYTES = 1 << 20
"""A kvtierd config or policy document is a few KiB; anything larger is refused unread."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: a document of a few hundred bytes can alias its
    way to gigabytes ("billion laughs": a 248-byte policy took 21 s and 1.3 GB), and no
    kvtierd document needs them."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event: Any = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None,
                None,
                f"aliases (*{event.anchor}) are not allowed in kvtierd documents; "
                "write the value out",
                event.start_mark,
            )
        return super().compose_node(parent, index)  # type: ignore[arg-type]


class YamlSource:
    """Parses a document once (refusing aliases and oversized input) and remembers the file
    and line of every mapping key so errors can point at them; ``data`` is the document as
    Python values."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.lines: dict[tuple[str, ...], int] = {}
        self.data: Any = None
        if len(text.encode()) > MAX_YAML_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_YAML_BYTES} bytes: not a kvtierd document")
        try:
            loader = _StrictLoader(text)  # reads the text: characters YAML refuses raise here
            try:
                node = loader.get_single_node()
                if node is not None:
                    self._walk(node, ())
                    self.data = loader.construct_document(node)
            finally:
                loader.dispose()
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        except RecursionError as e:
            raise ConfigError(f"{path}: nested too deeply to be a kvtierd document") from e

    def _walk(self, node: yaml.Node, at: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = (*at, str(k.value))
                if key in self.lines:  # YAML's loaders keep the last silently: a lost setting
                    raise ConfigError(
                        f"{self.path}:{k.start_mark.line + 1}: {'.'.join(key)}: duplicate key "
                        f"(first at line {self.lines[key]}); each key may appear once"
                    )
                self.lines[key] = k.start_mark.line + 1
                self._walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self.lines[(*at, str(i))] = v.start_mark.line + 1
                self._walk(v, (*at, str(i)))

    def where(self, at: tuple[str, ...]) -> str:
        for n in range(len(at), 0, -1):
            if at[:n] in self.lines:
                return f"{self.path}:{self.lines[at[:n]]}: {'.'.join(at)}"
        return f"{self.path}: {'.'.join(at) or '(top level)'}"


def read_file(path: str | os.PathLike[str], what: str) -> str:
    """The text of a ``what`` file (``"config"``, ``"policy"``); ``ConfigError`` naming it and
    the reason when it cannot be read."""
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {what} file {path}: {e.strerror}") from e
