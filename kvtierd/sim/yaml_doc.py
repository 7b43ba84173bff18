"""Reading a YAML settings document by hand, with errors that name the file and the key: the
simulator's calibration (``calibration.py``) and the projection's setting
(``benchmarks/e2e/projection_setting.py``) are both read through :class:`YamlDoc`."""

from __future__ import annotations

import math
from typing import Any

from kvtierd.errors import InvalidArgumentError


class YamlDoc:
    """One document from ``source`` (a file name, for the errors)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.source}: {where}: {problem}")

    def table(
        self, value: object, where: str, keys: tuple[str, ...], *, required: bool = False
    ) -> dict[str, Any]:
        """``value`` as a mapping whose keys are among ``keys`` (all of them if ``required``)."""
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a mapping with keys {', '.join(keys)}")
        unknown = [k for k in value if k not in keys]
        if unknown:
            raise self.fail(where, f"unknown key {unknown[0]!r}; allowed: {', '.join(keys)}")
        missing = [k for k in keys if k not in value] if required else []
        if missing:
            raise self.fail(where, f"missing key {missing[0]!r}; expected: {', '.join(keys)}")
        return value

    def number(self, value: object, where: str, *, positive: bool = False) -> float:
        """A finite number >= 0 (> 0 with ``positive``). A string that reads as one is one:
        YAML 1.1 loads ``2.26e8`` (no dot in the mantissa) as text."""
        try:
            x = float(value) if isinstance(value, int | float | str) else math.nan
        except ValueError:
            x = math.nan
        if isinstance(value, bool) or not math.isfinite(x) or x < 0 or (positive and x == 0):
            raise self.fail(where, f"expected a number {'> 0' if positive else '>= 0'}, "
                                   f"got {value!r}")  # fmt: skip
        return x
