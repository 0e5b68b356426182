"""Every benchmark command the README and docs name is a module of bench/ that starts and parses its
arguments from the repository's root (`python -m bench.ROOM.NAME --help`): a moved or renamed benchmark
fails here, not in a reader's terminal. (Each one's short run: tests/test_bench_runs.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"python -m (bench(?:\.[a-z0-9_]+)*)")


def named_modules() -> dict[str, list[str]]:
    """Each bench module a page names in a command -> the pages naming it."""
    named: dict[str, list[str]] = {}
    for page in PAGES:
        for module in COMMAND.findall(page.read_text()):
            if module != "bench":  # `python -m bench.ROOM.NAME`, the README's pattern, stops at "bench"
                named.setdefault(module, []).append(page.name)
    return named


def test_the_pages_name_benchmark_commands():
    assert len(named_modules()) > 25


@pytest.mark.long  # about a second each: `make test-long`
@pytest.mark.parametrize("module", sorted(named_modules()))
def test_each_named_benchmark_command_starts(module):
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{module} (named in {named_modules()[module]}):\n{done.stderr[-2000:]}"
    assert "usage" in done.stdout.lower(), done.stdout[-500:]
