"""Rendering: rich tables for people, JSON for scripts (``--json``).

JSON keeps protobuf field names and numbers as numbers (the proto3 JSON mapping would turn
uint64 into strings, which every script would then have to convert back).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def to_dict(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` (defaults included) as plain Python values; bytes as hex."""
    out: dict[str, Any] = {}
    field: Any  # the upb and pure-Python descriptor types differ in their stubs
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.is_repeated:
            out[field.name] = [_plain(field, v) for v in value]
        else:
            out[field.name] = _plain(field, value)
    return out


def _plain(field: Any, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_dict(value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes(value).hex()
    return value


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; binary units, as operators size tiers in GiB."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_rate(bytes_per_s: float) -> str:
    return "-" if bytes_per_s <= 0 else f"{human_bytes(bytes_per_s)}/s"


def human_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def human_duration(s: float) -> str:
    """A short latency with 3 significant digits (``12.8 ms``, ``7.44 µs``): TTFT and restore
    times of small contexts are microseconds, which :func:`human_seconds` would show as 0 ms."""
    if s <= 0:
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


class Output:
    """Where a command writes its result: JSON on stdout, or rich renderables."""

    def __init__(self, as_json: bool, prog: str = "kvtierctl") -> None:
        self.as_json = as_json
        self.prog = prog
        # Piped output keeps whole rows (rich would wrap at 80 columns) so grep/awk work.
        wide = None if sys.stdout.isatty() else 200
        self.console = Console(highlight=False, soft_wrap=False, width=wide)
        self.err = Console(stderr=True, highlight=False)

    def json(self, value: object) -> None:
        sys.stdout.write(json.dumps(value, indent=2, sort_keys=False) + "\n")

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
        for c in columns:
            t.add_column(c, justify="left" if c in _LEFT else "right")
        for row in rows:
            t.add_row(*(str(v) for v in row))
        self.console.print(t)

    def fields(self, title: str, pairs: Sequence[tuple[str, object]]) -> None:
        t = Table(title=title, title_justify="left", show_header=False, show_edge=False)
        t.add_column(style="bold")
        t.add_column()
        for k, v in pairs:
            t.add_row(k, str(v))
        self.console.print(t)

    def line(self, text: str) -> None:
        self.console.print(text, soft_wrap=True)

    def error(self, message: str) -> None:
        """One line on stderr, unwrapped, so scripts and logs get it whole."""
        sys.stderr.write(f"{self.prog}: {message}\n")

    def note(self, message: str) -> None:
        """A remark beside the result (e.g. a renamed command), on stderr so that stdout stays
        what scripts parse."""
        sys.stderr.write(f"{self.prog}: note: {message}\n")

    @contextmanager
    def working(self, what: str) -> Iterator[None]:
        """A spinner while a long request runs; nothing for JSON or when piped."""
        live = not self.as_json and self.err.is_terminal
        with self.err.status(what) if live else nullcontext():
            yield

    @contextmanager
    def progress(self, what: str, total: int) -> Iterator[Callable[[str], None]]:
        """A progress bar on stderr for ``total`` steps; yields ``step(label)`` to call after
        each one. Nothing is drawn for JSON or when stderr is not a terminal."""
        if self.as_json or not self.err.is_terminal:
            yield lambda label: None
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[label]}"), TimeElapsedColumn())  # fmt: skip
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(what, total=total, label="")
            yield lambda label: bar.update(task, advance=1, label=label)


_LEFT = {"name", "kind", "context", "variant", "tier", "health", "detail", "method", "key",
         "dtype", "placement", "pinned", "chosen", "placer", "baseline", "path",
         "file"}  # fmt: skip
