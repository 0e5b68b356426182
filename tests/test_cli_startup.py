"""The commands a new user types first answer at once: `--help`, `recipes` and a config error import no
heavy library (torch, transformers, numpy...: 3-10 s on a small machine), which load only when a command
needs a model."""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "scipy", "matplotlib", "pyarrow", "peft", "ray", "safetensors")

PROBE = """
import json, sys
from everyprompt.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
heavy = sorted(name for name in {heavy!r} if name in sys.modules)
print("\\nPROBE " + json.dumps({{"code": code, "heavy": heavy}}))
"""


def _probe(*argv: str, cwd) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )
    line = [row for row in done.stdout.splitlines() if row.startswith("PROBE ")]
    assert line, done.stdout + done.stderr
    return {**json.loads(line[-1][len("PROBE ") :]), "stderr": done.stderr}


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["train", "--help"], 0),
        (["recipes"], 0),
        (["train", "smollm2", "rl.stepz=3"], 2),  # an unknown key
        (["train", "smollm2", "rl.loss=nope"], 2),  # a registry's name
        (["train", "demo", "rl.steps=abc"], 2),  # a value of the wrong type
        (["eval", "ckpt", "rl.lr=-1"], 2),
    ],
)
def test_first_commands_import_no_heavy_library(argv, code, tmp_path):
    seen = _probe(*argv, cwd=tmp_path)
    assert seen["code"] == code, seen["stderr"]
    assert seen["heavy"] == [], f"`everyprompt {' '.join(argv)}` imported {seen['heavy']}"
    if code == 2:
        assert "config error" in seen["stderr"] and "Traceback" not in seen["stderr"]
    assert not (tmp_path / "runs").exists()


def test_the_math_loads_on_first_use_and_the_names_need_none_of_it(tmp_path):
    """The built-in losses and estimators are named without torch; using one loads its module."""
    script = (
        "import sys\n"
        "from everyprompt.algorithms import registered_policy_losses, registered_advantages, policy_loss_spec\n"
        "names = registered_policy_losses(), registered_advantages()\n"
        "assert 'torch' not in sys.modules, 'naming imported torch'\n"
        "assert policy_loss_spec('espo').needs_entropy\n"
        "assert callable(policy_loss_spec('espo').fn) and 'torch' in sys.modules\n"
        "print(*names)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "espo" in done.stdout and "grpo" in done.stdout and "dppo_kl" in done.stdout
