"""The house rules checked: no import cycle inside everyprompt, every module importable, docs that exist."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
from pathlib import Path

import pytest

import everyprompt

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "everyprompt"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the everyprompt modules it imports (at any depth of its code: lazy imports count too).

    `from a.b import c` names module a.b.c when that is a module, else a.b."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_import_graph_resolves_every_import_form(tmp_path, monkeypatch):
    fake = tmp_path / "pkg"
    (fake / "sub").mkdir(parents=True)
    (fake / "__init__.py").write_text("from pkg import alpha\n")
    (fake / "alpha.py").write_text("def f():\n    from pkg.sub import beta\n")
    (fake / "sub" / "__init__.py").write_text("")
    (fake / "sub" / "beta.py").write_text("from .. import alpha\nimport pkg.sub\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    graph = import_graph(_modules())
    assert graph == {
        "pkg": {"pkg.alpha"},
        "pkg.alpha": {"pkg.sub.beta"},
        "pkg.sub": set(),
        "pkg.sub.beta": {"pkg.alpha", "pkg.sub"},
    }
    assert find_cycles(graph) == [["pkg.alpha", "pkg.sub.beta"]]


def test_no_import_cycle_inside_everyprompt():
    cycles = find_cycles(import_graph(_modules()))
    assert not cycles, f"import cycles: {cycles}"


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(everyprompt.__path__, "everyprompt.")]
    assert set(names) | {"everyprompt"} == set(_modules())
    for name in names:
        importlib.import_module(name)


FIRST_IMPORT = """
import os, sys, traceback
import torch, pydantic, rich.progress, yaml, safetensors.torch, pyarrow.parquet, math_verify  # loaded once
import transformers.models.qwen3_moe.modeling_qwen3_moe, transformers.integrations.moe
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from torch.utils.tensorboard import SummaryWriter
failed, running = [], {}
def reap():
    pid, status = os.wait()
    if status != 0:
        failed.append(running[pid])
    del running[pid]
for name in sys.argv[1:]:
    if len(running) >= (os.cpu_count() or 1):  # one child per core at a time
        reap()
    pid = os.fork()
    if pid == 0:  # a child with no everyprompt module loaded yet: `name` is imported first
        try:
            __import__(name)
        except BaseException:
            print(name + ": " + traceback.format_exc().strip().splitlines()[-1], flush=True)
            os._exit(1)
        os._exit(0)
    running[pid] = name
while running:
    reap()
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_every_module_imports_first():
    """A cycle through a package's __init__ shows only when a module of the cycle is imported before the
    others: each module is imported first in a forked interpreter that holds no everyprompt module."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT, *sorted(_modules())], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


DOC_PATH = re.compile(r"\b((?:docs|bench|configs|tests)/[\w./-]*\w)")
OUTSIDE_DOCS = re.compile(r"\b(ALGORITHMS|DESIGN|FACTS|STYLE)\.md\b")


def test_every_doc_path_named_in_the_code_exists():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted(PACKAGE.rglob("*.yaml")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for named in DOC_PATH.findall(line):
                if not (ROOT / named).exists() and not (ROOT / "src" / "everyprompt" / named).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {named}")
            if OUTSIDE_DOCS.search(line):
                missing.append(f"{path.relative_to(ROOT)}:{number}: cites a document outside the repository")
    assert not missing, "\n".join(missing)


def test_docs_cite_no_document_outside_the_repository():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = [f"{p.name}: {m}" for p in pages for m in OUTSIDE_DOCS.findall(p.read_text())]
    assert not cited, cited


def test_readme_layout_names_every_top_level_module():
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```")[1]
    names = sorted(
        p.name if p.is_dir() else p.name
        for p in PACKAGE.iterdir()
        if p.name not in ("__init__.py", "__pycache__")
    )
    missing = [
        n for n in names if not re.search(rf"(?<![\w/]){re.escape(n.removesuffix('.py'))}(\.py|/)", layout)
    ]
    assert not missing, f"README's layout does not name: {missing}"
