"""The house rules checked: the import contracts, every module importable on its own, docs that exist."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import shutil
import subprocess
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


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts (pyproject.toml) on the package under `root`/src."""
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_import_contracts_hold():
    """The layers, one way (pyproject.toml's import-linter contracts; `make test` runs them too)."""
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_a_planted_upward_import_breaks_the_layers_contract(tmp_path):
    """The contracts can fail: `config` importing `trainer` (an upward import) in a copy of the package."""
    shutil.copytree(PACKAGE, tmp_path / "src" / "everyprompt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    planted = tmp_path / "src" / "everyprompt" / "config" / "base.py"
    planted.write_text(planted.read_text() + "\nimport everyprompt.trainer  # planted\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0
    assert "everyprompt.config is not allowed to import everyprompt.trainer" in done.stdout
    assert "Layers: each imports only from the layers below it" in done.stdout


def test_no_project_module_is_loaded_by_name():
    """Every import of a project module is an import statement the contracts can see."""
    by_name = re.compile(r"import_module\(|__import__\(|\"everyprompt\.[\w.]+:\w+\"")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if by_name.search(line)
    ]
    # rewards: a user's `package.module:function` reward (the user's module, not the project's)
    assert [f for f in found if not f.startswith("src/everyprompt/rewards/base.py")] == []


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


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
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
# a document outside the repository: by its file name, or a code comment's DESIGN (the design notes' name)
OUTSIDE_DOCS = re.compile(r"\b(?:(?:ALGORITHMS|DESIGN|FACTS|STYLE|LOSSES-2026)\.md|DESIGN\b)")


def test_every_doc_path_named_in_the_code_exists():
    missing = []
    code = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.yaml"), *(ROOT / "bench").rglob("*.py")]
    for path in sorted(code) + sorted((ROOT / "tests").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for named in DOC_PATH.findall(line) if path.is_relative_to(PACKAGE) else ():
                if not (ROOT / named).exists() and not (ROOT / "src" / "everyprompt" / named).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {named}")
            if OUTSIDE_DOCS.search(line) and path != Path(__file__).resolve():
                missing.append(f"{path.relative_to(ROOT)}:{number}: cites a document outside the repository")
    assert not missing, "\n".join(missing)


def test_docs_cite_no_document_outside_the_repository():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = [f"{p.name}: {m}" for p in pages for m in OUTSIDE_DOCS.findall(p.read_text())]
    assert not cited, cited


def _unnamed_in(text: str, folder=PACKAGE) -> list[str]:
    """The packages and modules of `folder` that `text` does not name (as `name/` or `name.py`)."""
    names = sorted(p.name for p in folder.iterdir() if p.name not in ("__init__.py", "__pycache__"))
    return [n for n in names if not re.search(rf"(?<![\w/]){re.escape(n.removesuffix('.py'))}(\.py|/)", text)]


def test_readme_layout_names_every_top_level_module():
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```")[1]
    missing = _unnamed_in(layout)
    assert not missing, f"README's layout does not name: {missing}"


def test_the_architecture_page_names_every_package_and_top_level_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = _unnamed_in(page)
    assert not missing, f"docs/architecture.md does not name: {missing}"
    native = _unnamed_in(page, PACKAGE / "rollout" / "native")  # the engine's rooms, each said in a line
    assert not native, f"docs/architecture.md does not name rollout/native's {native}"


def test_no_file_is_over_400_lines_and_no_command_module_over_200():
    """src/, bench/ and tests/: a file past 400 lines holds more than one room's worth."""
    sizes = {path: len(path.read_text().splitlines()) for path in sorted(PACKAGE.rglob("*.py"))}
    long = [f"{p.relative_to(ROOT)}: {n}" for p, n in sizes.items() if n > 400]
    long += [f"{p.relative_to(ROOT)}: {n}" for p, n in sizes.items() if p.parent.name == "cli" and n > 200]
    long += [
        f"{p.relative_to(ROOT)}: {n}"
        for folder in ("bench", "tests")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 400
    ]
    assert not long, long


def test_the_config_validates_engines_and_fields_without_loading_the_layers_above_it():
    code = (
        "import sys; from everyprompt.config import load_config; "
        "load_config(None, ['rollout.engine=hf', 'data.columns.prompt=question']); "
        "print(sorted(m for m in sys.modules if m.startswith('everyprompt.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307  (our own printed list)
    assert not [m for m in loaded if m.split(".")[1] in ("rollout", "data", "models", "trainer")], loaded


def test_the_built_in_engines_are_the_names_the_config_accepts():
    from everyprompt.choices import ENGINES, HF_ENGINE, NATIVE_ENGINE
    from everyprompt.rollout import registered_engines

    assert {NATIVE_ENGINE, HF_ENGINE} <= ENGINES
    assert set(registered_engines()) == ENGINES  # no name the config accepts lacks its engine


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports, at the top or inside a function (its own packages left out:
    importing a module runs its package's __init__ anyway)."""
    import ast

    own = _module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {n for n in names if n in modules and n != own and not own.startswith(n + ".")}
    return found


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Every cycle of modules that import each other (strongly connected sets of two or more)."""
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in graph:
        if module not in order:
            visit(module)
    return cycles


def test_no_modules_import_each_other_not_even_inside_a_function(tmp_path):
    assert import_cycles(_modules()) == []
    # the check sees a cycle made of a top-level import and a function-level one
    package = tmp_path / "everyprompt"
    package.mkdir()
    (package / "a.py").write_text("from everyprompt.b import f\n")
    (package / "b.py").write_text("def f():\n    from everyprompt.a import g\n")
    planted = {"everyprompt.a": package / "a.py", "everyprompt.b": package / "b.py"}
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "everyprompt"
    try:
        assert import_cycles(planted) == [["everyprompt.a", "everyprompt.b"]]
    finally:
        PACKAGE = saved
