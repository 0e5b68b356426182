"""The native engine's per-row state has one owner: only rows.py writes the arrays of `Rows`; the loop and
what it calls change a row through the rows' operations, and the steps and the queue only read them."""

from __future__ import annotations

import ast
from pathlib import Path

from everyprompt.rollout.native.rows import Rows

NATIVE = Path(__file__).resolve().parents[2] / "src" / "everyprompt" / "rollout" / "native"
FIELDS = {*Rows.STEP, *Rows.HOST, "paused"}
# how the engine's modules name a call's rows: the loop's `self.state`, a function's `state` or `call.rows`
RECEIVERS = {"state", "self.state", "rows", "self.rows", "call.rows", "self.call.rows"}
MUTATING = {"append", "extend", "add", "discard", "clear", "pop", "insert", "remove", "update", "setdefault"}


def _field(node: ast.AST) -> str | None:
    """The Rows field `node` reaches (`state.tokens`, `state.tokens[slot]`, `call.rows.length[index]`)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS and ast.unparse(node.value) in RECEIVERS:
        return f"{ast.unparse(node.value)}.{node.attr}"
    return None


def writes_to_rows(source: str) -> list[tuple[int, str]]:
    """(line, the field) of every assignment to, or in-place change of, a Rows array in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [
                t
                for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method in MUTATING or (method.endswith("_") and not method.startswith("_")):
                targets = [node.func.value]
        found += [(node.lineno, field) for target in targets if (field := _field(target))]
    return found


def test_only_the_rows_module_writes_the_rows_arrays():
    written = [
        f"{path.name}:{line}: {field}"
        for path in sorted(NATIVE.glob("*.py"))
        if path.name != "rows.py"
        for line, field in writes_to_rows(path.read_text())
    ]
    assert not written, "written outside rows.py:\n" + "\n".join(written)


def test_the_walk_finds_each_kind_of_write():
    source = (
        "state.length[rows] = lengths\n"
        "state.request[slot], state.observed[slot] = -1, []\n"
        "call.rows.step[index] += 1\n"
        "self.state.tokens[slot].append(token)\n"
        "state.paused.add(slot)\n"
        "state.logits.zero_()\n"
        "buffers.logits[:rows].copy_(out)\n"  # the static step's own buffers: not the rows' arrays
        "x = state.tokens[slot]\n"  # a read
    )
    assert [field for _, field in writes_to_rows(source)] == [
        "state.length",
        "state.request",
        "state.observed",
        "call.rows.step",
        "self.state.tokens",
        "state.paused",
        "state.logits",
    ]
