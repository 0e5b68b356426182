"""Every benchmark command the README and docs name runs, from the repository's root, as a reader would
start it: `python -m bench.ROOM.NAME` with the short arguments of bench/__init__.py's SMOKE (a tiny model,
a few steps), its results in a fresh directory. A command a page names without a smoke entry fails here;
so does one that writes into the repository."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bench import SMOKE

from tests.test_bench_commands import named_modules

ROOT = Path(__file__).resolve().parents[1]
# what a smoke run needs that the core install lacks: it skips, saying so, without the extra
NEEDS = {
    "bench.distributed.ray_checkpoint": "ray",
    "bench.quality.gym_agreement": "reasoning_gym",
    "bench.learner.rl_growth": "trl",  # each point against TRL's GRPOTrainer
}
# Named commands with no smoke run yet, each with why (none now): this set may only shrink
NOT_YET: dict[str, str] = {}


def test_every_named_benchmark_command_has_a_smoke_run():
    assert sorted(set(named_modules()) - set(SMOKE) - set(NOT_YET)) == []
    assert set(NOT_YET) <= set(named_modules()) and not set(NOT_YET) & set(SMOKE)


def _repo_state() -> str:
    done = subprocess.run(
        ["git", "status", "--porcelain", "--", "bench", "README.md", "docs", "configs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return done.stdout if done.returncode == 0 else "(not a git checkout)"


def _fill(argument: str, places: dict[str, Path]) -> str:
    for name, place in places.items():
        argument = argument.replace("{" + name + "}", str(place))
    return argument


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    from tests.test_bench import _saved_tiny_model

    base = tmp_path_factory.mktemp("bench_runs")
    recipe = base / "tiny.yaml"
    recipe.write_text(
        "model:\n  dtype: fp32\nrollout:\n  max_new_tokens: 8\ndata:\n  num_train: 16\n"
        "rl:\n  prompts_per_step: 2\n  group_size: 2\n  micro_batch_size: 2\n  mini_batches: 1\n"
    )
    completions = base / "completions.jsonl"
    completions.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": f"What is {n} + 1?",
                    "completion": f"It is \\boxed{{{n + 1}}}.",
                    "answer": str(n + 1),
                    "reward": 1.0,
                }
            )
            + "\n"
            for n in range(4)
        )
    )
    from everyprompt.models.tokenizer import CHAT_TEMPLATE
    from tests.conftest import make_tiny_model

    model, tokenizer = make_tiny_model()  # the same tiny model with a chat template
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(base / "chat")
    tokenizer.save_pretrained(base / "chat")
    return {
        "model": _saved_tiny_model(base / "tiny"),
        "chat_model": base / "chat",
        "recipe": recipe,
        "completions": completions,
        "results": ROOT / "bench" / "results",
    }


@pytest.mark.slow  # seconds to a minute each; `make test-slow`
@pytest.mark.parametrize("module", sorted(SMOKE))
def test_each_benchmark_command_runs_its_smoke(module, places, tmp_path):
    if module in NEEDS and importlib.util.find_spec(NEEDS[module]) is None:
        pytest.skip(f"{module} needs {NEEDS[module]} (its extra is not installed)")
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(ROOT / "README.md", out / "README.md")  # the speed table's page, rewritten there
    argv = [_fill(argument, {**places, "out": out}) for argument in SMOKE[module]]
    before = _repo_state()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, f"{module} {' '.join(argv)}:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    assert _repo_state() == before, f"{module} wrote into the repository"
    if module != "bench.evidence" and module != "bench.gpu.gpu_tables":  # these two print, reading results
        written = [path for path in out.rglob("*") if path.is_file() and path.name != "README.md"]
        assert written or module == "bench.learner.speed_table", f"{module} wrote no results under {out}"
