"""No test or benchmark helper picks a port by binding a socket to port 0, reading the port and
closing the socket (issue 25): by the time the server binds that port another process may hold
it ("address already in use" under load). Servers bind port 0 themselves and report the port
(``kvtierd router --port-file``, the daemon's start-up line, ``metrics_port: any``); a test
that needs a port nobody listens on keeps its socket bound while it runs (a fixture that
``yield``s inside the ``with``).

The check reads the code's syntax: a function that calls ``.bind((host, 0))`` and returns
something built from ``.getsockname()`` hands out a port it no longer holds. A generator (a
fixture) keeps the socket open for as long as its caller uses the port, so it is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("tests", "benchmarks", "scripts")


def _binds_port_zero(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "bind"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Tuple)
        and len(node.args[0].elts) == 2
        and isinstance(node.args[0].elts[1], ast.Constant)
        and node.args[0].elts[1].value == 0
    )


def _reads_the_port(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and n.func.attr == "getsockname"
        for n in ast.walk(node)
    )  # fmt: skip


def _own_nodes(fn: ast.AST) -> list[ast.AST]:
    """The nodes of ``fn``'s own body: a function nested in it returns for itself."""
    out, todo = [], list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return out


def port_pickers(source: str, name: str) -> list[str]:
    """``name:line function`` of every function that hands out a port it bound and let go."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        inner = _own_nodes(fn)
        if any(isinstance(n, ast.Yield | ast.YieldFrom) for n in inner):
            continue  # a fixture holding the socket while its caller runs
        # names a port was read into (``port = s.getsockname()[1]``) count as the port
        ports = {
            t.id
            for n in inner
            if isinstance(n, ast.Assign) and _reads_the_port(n.value)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        returned = [n.value for n in inner if isinstance(n, ast.Return) and n.value is not None]
        if any(_binds_port_zero(n) for n in inner) and any(
            _reads_the_port(value)
            or any(isinstance(n, ast.Name) and n.id in ports for n in ast.walk(value))
            for value in returned
        ):
            found.append(f"{name}:{fn.lineno} {fn.name}")
    return found


def test_no_helper_picks_a_port_and_closes_it() -> None:
    files = [p for top in CHECKED for p in sorted((ROOT / top).rglob("*.py"))]
    assert len(files) > 100  # the walk found the code
    found = [
        hit for path in files for hit in port_pickers(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


@pytest.mark.parametrize(
    "code",
    [
        # the helper issue 25 removed from the daemon harness (then tests/daemon_proc.py)
        "def free_port() -> int:\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n"
        "        return int(s.getsockname()[1])\n",
        # the same, closed by hand
        "def port():\n"
        "    s = socket.socket()\n"
        "    s.bind(('', 0))\n"
        "    port = s.getsockname()[1]\n"
        "    s.close()\n"
        "    return port\n",
        "def url():\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n"
        "        return f'http://127.0.0.1:{s.getsockname()[1]}'\n",
    ],
)
def test_a_port_picker_is_found(code: str) -> None:
    assert port_pickers(code, "x.py") != []


@pytest.mark.parametrize(
    "code",
    [
        # a fixture: the port stays bound (refusing connections) while the test runs
        "def dead_url():\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n"
        "        yield f'http://127.0.0.1:{s.getsockname()[1]}'\n",
        # a server that binds port 0 and reports what it bound
        "def serve():\n    server.bind(('127.0.0.1', 0))\n    server.listen()\n    run(server)\n",
        # a test holding a port that a nested helper hands out while the socket is held
        "def test_offer():\n"
        "    with socket.socket() as taken:\n"
        "        taken.bind(('127.0.0.1', 0))\n"
        "        offers = [taken.getsockname()[1]]\n"
        "        def offer():\n"
        "            return offers.pop(0)\n"
        "        start(offer)\n",
        # a test holding a port to see a clean "address in use" error
        "def test_taken():\n"
        "    with socket.socket() as taken:\n"
        "        taken.bind(('127.0.0.1', 0))\n"
        "        start(port=taken.getsockname()[1])\n",
    ],
)
def test_holding_a_port_is_not_a_port_picker(code: str) -> None:
    assert port_pickers(code, "x.py") == []
