"""Every benchmark command the README and docs name runs, from the repository's root, as a reader would
start it: `python -m bench.ROOM.NAME` with the short arguments of bench/__init__.py's SMOKE (a tiny model,
a few steps), what it writes in a fresh directory. A command a page names without a smoke entry fails here;
so does a run that fails, writes nothing, or writes into the repository."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from bench import SMOKE
from bench.learner.speed_table import MARKERS

from tests.test_bench import _saved_tiny_model
from tests.test_bench_commands import named_modules

ROOT = Path(__file__).resolve().parents[1]
# what a smoke run needs that the core install lacks: it skips, saying so, without the extra
NEEDS = {
    "bench.distributed.ray_checkpoint": "ray",
    "bench.quality.gym_agreement": "reasoning_gym",
    "bench.learner.rl_growth": "trl",  # each point against TRL's GRPOTrainer
}
# the two that read the repository's results and print, writing nothing: what their output must hold
PRINTS = {"bench.evidence": "pre-registered contrasts", "bench.gpu.gpu_tables": "| batch"}


def test_every_named_benchmark_command_has_a_smoke_run():
    assert sorted(set(named_modules()) - set(SMOKE)) == []


def _repo_state() -> str:
    done = subprocess.run(
        ["git", "status", "--porcelain", "--", "bench", "README.md", "docs", "configs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    from everyprompt.models.tokenizer import CHAT_TEMPLATE

    base = tmp_path_factory.mktemp("bench_runs")
    recipe = base / "tiny.yaml"
    recipe.write_text(
        "model:\n  dtype: fp32\nrollout:\n  max_new_tokens: 8\ndata:\n  num_train: 16\n"
        "rl:\n  prompts_per_step: 2\n  group_size: 2\n  micro_batch_size: 2\n  mini_batches: 1\n"
    )
    completions = base / "completions.jsonl"
    rows = [
        {
            "prompt": f"What is {n} + 1?",
            "completion": f"It is \\boxed{{{n + 1}}}.",
            "answer": str(n + 1),
            "reward": 1.0,
        }
        for n in range(4)
    ]
    completions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "model": _saved_tiny_model(base / "tiny"),
        "chat_model": _saved_tiny_model(base / "chat", chat_template=CHAT_TEMPLATE),
        "recipe": recipe,
        "completions": completions,
        "results": ROOT / "bench" / "results",
    }


def _blanked_readme(path: Path) -> str:
    """The README with its speed table emptied, at `path`; returns the README as it is."""
    text = (ROOT / "README.md").read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    path.write_text(text[: start + len(MARKERS[0])] + "\n" + text[end:])
    return text


@pytest.mark.slow  # seconds to a few minutes each; `make test-slow`
@pytest.mark.parametrize("module", sorted(SMOKE))
def test_each_benchmark_command_runs_its_smoke(module, places, tmp_path):
    if module in NEEDS and importlib.util.find_spec(NEEDS[module]) is None:
        pytest.skip(f"{module} needs {NEEDS[module]} (its extra is not installed)")
    out = tmp_path / "out"
    out.mkdir()
    readme = _blanked_readme(out / "README.md") if module == "bench.learner.speed_table" else None
    filled = {**places, "out": out}
    argv = [argument.format(**filled) for argument in shlex.split(SMOKE[module])]
    before = _repo_state()
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, f"{module} {' '.join(argv)}:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    assert _repo_state() == before, f"{module} wrote into the repository"
    if readme is not None:  # the table written back, as the repository's results give it
        assert (out / "README.md").read_text() == readme
    elif module in PRINTS:
        assert PRINTS[module] in done.stdout, done.stdout[-1500:]
    else:
        assert any(path.is_file() for path in out.rglob("*")), f"{module} wrote nothing under {out}"
