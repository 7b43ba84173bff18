"""Contexts as the tree they form (issue 29): ``kvtierctl contexts ls`` draws each child under
its parent, indented, in the order the rows were asked for."""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.rpc import kvtier_pb2 as pb

INDENT = "  "
BRANCH = "└ "


def as_tree(rows: Sequence[pb.ContextSummary]) -> list[tuple[int, pb.ContextSummary]]:
    """``rows`` with each context's depth, every child right under its parent (children in
    the rows' order). A context whose parent is not among the rows (filtered out, or gone) is
    drawn as a root."""
    ids = {c.context_id for c in rows}
    children: dict[str, list[pb.ContextSummary]] = {}
    roots = []
    for c in rows:
        if c.parent_context_id and c.parent_context_id in ids:
            children.setdefault(c.parent_context_id, []).append(c)
        else:
            roots.append(c)
    out: list[tuple[int, pb.ContextSummary]] = []
    stack = [(0, c) for c in reversed(roots)]
    seen: set[str] = set()
    while stack:
        depth, c = stack.pop()
        if c.context_id in seen:  # the daemon refuses cycles; a listing never loops on one
            continue
        seen.add(c.context_id)
        out.append((depth, c))
        stack.extend((depth + 1, k) for k in reversed(children.get(c.context_id, [])))
    return out


def drawn(depth: int, context_id: str) -> str:
    """A context's name indented to its depth."""
    return f"{INDENT * (depth - 1)}{BRANCH}{context_id}" if depth else context_id
