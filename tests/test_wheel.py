"""The package as a pip user gets it (slow: ~1-2 minutes): the wheel built from this tree, installed into
a fresh virtual environment, run from an empty directory with no clone in sight: the recipes list, and
the demo recipe by name for a few steps. The environment borrows this one's installed dependencies (a
path line, so nothing is downloaded) and holds the wheel itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(command: list[str], cwd: Path, env: dict | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_the_wheel_installs_and_runs_recipes_by_name_from_an_empty_directory(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(REPO), "-w", str(dist)], tmp_path)  # fmt: skip
    (wheel,) = dist.glob("everyprompt-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path
        ).strip()
    )
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, transformers, ...
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    where = _run([str(python), "-c", "import everyprompt; print(everyprompt.__file__)"], empty, env)
    assert str(site) in where  # the wheel's copy, not this checkout's
    listed = _run(["everyprompt", "recipes"], empty, env)
    for name in ("demo", "smollm2", "gsm8k-qwen3-moe-cpu", "gsm8k-qwen3-moe"):
        assert f" {name} " in listed
    tiny = ["model.hidden_size=32", "model.num_layers=2", "data.num_train=64", "data.num_eval=8",
            "sft.steps=4", "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "eval.num_samples=0",
            "rollout.max_new_tokens=8", "logging.progress=false"]  # fmt: skip
    _run(["everyprompt", "train", "demo", *tiny, "--run-dir", "run"], empty, env)
    assert json.loads((empty / "run" / "eval.json").read_text())["num_prompts"] == 8
    steps = (empty / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in steps] == [1, 2]
    _run(["everyprompt", "sft", "gsm8k-qwen3-moe-cpu", "sft.steps=2", "--run-dir", "warm"], empty, env)
    assert sorted(p.name for p in empty.iterdir()) == ["run", "warm"]  # nothing else written here
