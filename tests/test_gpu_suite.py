"""bench/gpu_suite.sh --smoke: the GPU suite's every step on tiny models on the CPU, so that the one call a
lent GPU gets runs a script that is known to work (its GPU figures are the GPU's to give)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_suite_runs_every_step_on_tiny_models(tmp_path):
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "bench/gpu_suite.sh", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = (out / "steps.txt").read_text().splitlines()
    ran = [line.split()[0] for line in steps if " exit " in line]
    assert ran == ["models", "dense", "rl_step", "moe", "learner", "test-gpu"], steps
    assert all(" exit 0 " in line for line in steps if " exit " in line), steps
    for name in ("tiny-dense", "tiny-moe8"):
        payload = json.loads((out / f"throughput_{name}.json").read_text())
        assert payload["graphs"] is True and [row["batch"] for row in payload["decode"]] == [1, 4]
        for row in payload["decode"]:  # the static step measured beside the plain one, equal work
            assert (
                row["graphs_mode"] == "eager" and row["graphs_tokens_per_s"] > 0 and row["graph_failed"] == 0
            )
            assert row["captured_floor_ms"] == row["floor_ms"] > 0  # no CUDA: the eager floor
        agree = payload["graphs_agree"]
        assert agree["agrees"] and agree["tokens_equal_eager"] == agree["prompts"] == 6
    rl = json.loads((out / "rl_step_tiny-dense.json").read_text())
    assert rl["everyprompt"]["step_s"] > 0
    learner = json.loads((out / "learner_profile_tiny-dense.json").read_text())
    assert learner["update_s"] > 0 and learner["top_ops"] and learner["device"] == "cpu"
    assert (out / "learner_profile_tiny-dense.txt").stat().st_size > 0
    assert "gpu_suite: 0 step(s) failed" in done.stdout
    # what a device call brings back: at most 8 files, the logs packed as one
    files = sorted(path.name for path in out.iterdir() if path.is_file())
    assert len(files) <= 8 and not [name for name in files if name.endswith(".log")], files
    with tarfile.open(out / "logs.tar.gz") as logs:
        assert sorted(logs.getnames()) == sorted(f"{step}.log" for step in ran)


@pytest.mark.slow  # an SFT checkpoint and three short runs (~1 min)
def test_the_gpu_suites_evidence_mode_runs_the_bench_it_is_given(tmp_path):
    out = tmp_path / "gpu"
    args = "--comparison c1 --setup tiny --tiny --seeds 0"
    done = subprocess.run(
        ["bash", "bench/gpu_suite.sh", "--smoke", "--evidence", args, "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = (out / "steps.txt").read_text().splitlines()
    assert [line.split()[0] for line in steps if " exit " in line] == ["models", "evidence"], steps
    body = json.loads((out / "evidence_smoke.json").read_text())["comparisons"]["c1"]["setups"]["tiny"]
    assert {arm: [r["seed"] for r in a["runs"]] for arm, a in body["arms"].items()} == {
        "ppo-clip": [0],
        "espo": [0],
        "gspo": [0],
    }
    # the committed file came along, whole: the device's copy adds records to it
    assert json.loads((out / "evidence.json").read_text()) == json.loads(
        (ROOT / "bench" / "results" / "evidence.json").read_text()
    )
