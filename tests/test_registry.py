"""The one registry helper (kvtierd/registry.py) and the four registries built on it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest

from kvtierd.errors import ConfigError, InvalidArgumentError
from kvtierd.kernels.registry import METHODS
from kvtierd.policies import PLACERS
from kvtierd.profiler.quality import EVALUATORS
from kvtierd.registry import Registry
from kvtierd.storage import TIERS


class Shape:
    name: ClassVar[str] = ""


class Square(Shape):
    name = "square"


def shapes() -> Registry[Shape]:
    return Registry("shape", Shape, {"circle": "tests.test_registry:Circle"})


class Circle(Shape):
    name = "circle"


def test_lookup_register_and_unknown_names() -> None:
    reg = shapes()
    assert reg.names() == ("circle",)
    assert reg.get("circle") is Circle
    assert reg.register(Square) is Square
    assert reg.names() == ("circle", "square") and "square" in reg
    with pytest.raises(ValueError, match=r"unknown shape 'hexagon'; known: circle, square$"):
        reg.get("hexagon")
    reg.unregister("square")
    assert "square" not in reg


def test_duplicates_and_bad_classes_are_refused() -> None:
    reg = shapes()
    reg.register(Square)
    with pytest.raises(ValueError, match=r"shape 'square' is already registered by "
                       r"tests\.test_registry\.Square$"):  # fmt: skip
        reg.register(type("Square2", (Shape,), {"name": "square"}))
    with pytest.raises(
        ValueError, match=r"shape 'circle' is built in \(tests.test_registry:Circle\)"
    ):
        reg.register(type("C", (Shape,), {"name": "circle"}))
    with pytest.raises(TypeError, match="is not a Shape subclass"):
        reg.register(int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Nameless has no name"):
        reg.register(type("Nameless", (Shape,), {}))
    with pytest.raises(ValueError, match="no registered shape 'circle' to remove"):
        reg.unregister("circle")


def test_a_built_in_must_name_itself_as_listed() -> None:
    reg: Registry[Shape] = Registry("shape", Shape, {"round": "tests.test_registry:Circle"})
    with pytest.raises(TypeError, match=r"built-in shape 'round' .* names itself 'circle'"):
        reg.get("round")


def test_registered_lasts_for_the_block() -> None:
    reg = shapes()
    with reg.registered(Square):
        assert reg.get("square") is Square
    assert "square" not in reg
    with pytest.raises(RuntimeError), reg.registered(Square):
        raise RuntimeError
    assert "square" not in reg


def _load(path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # as an import statement leaves it
    spec.loader.exec_module(module)
    return module


def test_a_module_imported_twice_cannot_register_both_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ordering bug of commit c1da812: a test module imported by another test module
    exists twice (``test_x`` and ``tests.daemon.test_x``); the registry kept the first copy of
    its evaluator and the test read the other copy's list. A second copy is refused, saying
    why; each copy registered only while it is used is the cure."""
    source = tmp_path / "plugin_shapes.py"
    source.write_text(
        textwrap.dedent("""
        from tests.test_registry import Shape

        class Star(Shape):
            name = "star"
    """)
    )
    one = _load(source, "plugin_shapes", monkeypatch)
    two = _load(source, "pkg.plugin_shapes", monkeypatch)
    assert one.Star is not two.Star
    reg = shapes()
    reg.register(one.Star)
    with pytest.raises(ValueError, match=r"plugin_shapes\.py was imported twice, as "
                       r"'plugin_shapes' and 'pkg\.plugin_shapes'"):  # fmt: skip
        reg.register(two.Star)
    reg.unregister("star")
    with reg.registered(two.Star):
        assert reg.get("star") is two.Star


REGISTRIES = {"methods": METHODS, "tiers": TIERS, "placers": PLACERS, "evaluators": EVALUATORS}


@pytest.mark.parametrize("registry", REGISTRIES.values(), ids=list(REGISTRIES))
def test_every_built_in_loads_under_its_name(registry: Registry[object]) -> None:
    for name in registry.names():
        cls = registry.get(name)
        assert isinstance(cls, type) and issubclass(cls, registry.base), name


def test_errors_of_unknown_names_are_each_layers_own() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown compression method 'x'; known: "):
        METHODS.get("x")
    with pytest.raises(ConfigError, match="unknown tier kind 'x'; known: cpu, gpu, remote, ssd"):
        TIERS.get("x")
    with pytest.raises(ValueError, match="unknown placer 'x'; known: evicpress, fixed, lfu, lru"):
        PLACERS.get("x")
    with pytest.raises(InvalidArgumentError, match="unknown quality evaluator 'x'; known: "):
        EVALUATORS.get("x")


def test_importing_a_package_registers_nothing_and_loads_no_implementation() -> None:
    """Built-ins are imported on first lookup: listing names imports none of them."""
    code = textwrap.dedent("""
        import sys
        from kvtierd.kernels.registry import METHODS
        from kvtierd.policies import PLACERS
        from kvtierd.profiler.quality import EVALUATORS
        from kvtierd.storage import TIERS
        for r in (METHODS, PLACERS, EVALUATORS, TIERS):
            r.names()
        loaded = [m for m in ("kvtierd.kernels.knorm", "kvtierd.policies.evicpress",
                              "kvtierd.profiler.answer", "kvtierd.integrations.served_eval",
                              "kvtierd.storage.remote", "kvtierd.storage.gpu") if m in sys.modules]
        print(loaded)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
