"""bench/gpu/suite.sh --smoke: the GPU suite's every step on tiny models on the CPU, so that the one call a
lent GPU gets runs a script that is known to work (its GPU figures are the GPU's to give)."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.test_bench import _load

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
def test_the_gpu_suite_runs_every_step_on_tiny_models(tmp_path):
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "bench/gpu/suite.sh", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=460,  # the smoke's budget, 360 s, and its set-up
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = (out / "steps.txt").read_text().splitlines()
    ran = [line.split()[0] for line in steps if " exit " in line]
    assert ran == ["models", "rl_step", "dense", "learner", "rl_fused", "test-gpu", "moe"], steps
    assert all(" exit 0 " in line for line in steps if " exit " in line), steps
    for name in ("tiny-dense", "tiny-moe8"):
        payload = json.loads((out / f"throughput_{name}.json").read_text())
        assert payload["graphs"] is True and [row["batch"] for row in payload["decode"]] == [1, 4]
        for row in payload["decode"]:  # the static step measured beside the plain one, equal work
            assert (
                row["graphs_mode"] == "static" and row["graphs_tokens_per_s"] > 0 and row["graph_failed"] == 0
            )
            assert row["captured_floor_ms"] == row["floor_ms"] > 0  # no CUDA: the eager floor
        # what a static step launches: counted by differencing two profiled calls, so its matmuls are the
        # step's projections exactly: per layer the fused query-key-value, the output, the fused
        # gate-up and the down projection, and the head (2 layers; the upcycle's experts run batched)
        projections = 2 * 4 + 1 if name == "tiny-dense" else None
        for row in payload["step_kernels"]:
            assert row["kind"] == "cpu operators" and row["per_step"] > row["matmuls"] > 0
            assert projections is None or row["matmuls"] == projections, row
        assert [row["batch"] for row in payload["step_kernels"]] == [1, 4]
        agree = payload["graphs_agree"]
        assert agree["agrees"] and agree["tokens_equal_eager"] == agree["prompts"] == 6
    rl = json.loads((out / "rl_step_tiny-dense.json").read_text())
    assert rl["everyprompt"]["step_s"] > 0
    profiled = rl["everyprompt"]["rollout_profile"]  # one more rollout under the profiler: no kernels here
    assert profiled["completions"] > 0 and profiled["wall_s"] > 0 and "no CUDA device" in profiled["why"]
    assert {"prefill", "sample", "forward"} <= set(profiled["host_by_phase"])  # the engine's marked phases
    fused = json.loads((out / "rl_step_tiny-dense_fused.json").read_text())["everyprompt"]
    assert fused["step_s"] > 0 and "trl" not in json.loads(
        (out / "rl_step_tiny-dense_fused.json").read_text()
    )
    assert fused["medians"]["time/step_s"] > 0
    assert fused["compile_failed"] == 0 and fused["compiled_layers"] == 2  # both fused paths ran (2 layers)
    learner = json.loads((out / "learner_profile_tiny-dense.json").read_text())
    assert learner["update_s"] > 0 and learner["top_ops"] and learner["device"] == "cpu"
    assert learner["attention"] == "default" and learner["variants"]["compiled"]["update_s"] > 0
    assert learner["timeline"]["wall_s"] > 0 and "no CUDA device" in learner["timeline"]["why"]
    assert "CUDA" in learner["variants"]["liger"]["skipped"]  # Liger's kernels are CUDA's: said, not run
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
    args = "--comparison c1 --setup tiny --tiny --seeds 0 --workers 3 --seed-by-seed"  # as a GPU call runs it
    shutil.rmtree(ROOT / "bench" / "results" / "gpu-evidence", ignore_errors=True)  # kept by a warm machine
    done = subprocess.run(
        ["bash", "bench/gpu/suite.sh", "--smoke", "--evidence", args, "--out", str(out)],
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
    # its records name their runs relative to the checkout (the suite's $OUT lies outside it)
    assert all(
        r["run_dir"].startswith("bench/results/gpu-evidence/")
        for a in body["arms"].values()
        for r in a["runs"]
    )
    shutil.rmtree(ROOT / "bench" / "results" / "gpu-evidence")  # the runs' scratch folder in the checkout
    # the committed file came along, whole: the device's copy adds records to it
    assert json.loads((out / "evidence.json").read_text()) == json.loads(
        (ROOT / "bench" / "results" / "evidence.json").read_text()
    )


def _dry_run(*args: str) -> dict[str, list[str]]:
    done = subprocess.run(
        ["bash", "bench/gpu/suite.sh", "--dry-run", *args],
        cwd=ROOT,
        env={**os.environ, "OUT": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = {}
    for line in done.stdout.splitlines():
        name, sep, command = line.partition(": ")
        if sep and " " not in name and name != "gpu_suite":
            steps[name] = shlex.split(command)
    return steps


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _sets(command: list[str]) -> list[str]:
    return [command[i + 1] for i, word in enumerate(command) if word == "--set"]


def test_the_gpu_suites_recipes_load_as_the_gpu_runs_them(tmp_path):
    """The real suite's RL step and learner profile on configs/smollm2.yaml: the overrides they pass (and
    the ones rl_step adds to match TRL's arithmetic) make a valid config. On the first lent GPU both steps
    stopped at the config (a bf16 engine with the recipe's engine log-probs)."""
    from everyprompt.config import load_config

    steps = _dry_run("--out", str(tmp_path))
    assert list(steps) == ["setup", "models", "rl_step", "dense", "learner", "rl_fused", "test-gpu", "moe"]
    rl_step = _load("learner.rl_step")
    command = steps["rl_step"]
    config = ROOT / _option(command, "--config")
    overrides = rl_step.bench_overrides(Path(_option(command, "--model")), _sets(command))
    matched = rl_step.matched_precision(config, overrides)
    assert matched == ["rollout.precision=bf16", "rl.old_logprobs=recompute"]
    loaded = load_config(config, [*overrides, *matched])
    assert loaded.rollout.precision == "bf16" and loaded.rl.old_logprobs == "recompute"
    command = steps["learner"]
    loaded = load_config(ROOT / _option(command, "--config"), _sets(command))
    assert loaded.rollout.precision == "bf16" and loaded.model.dtype == "bf16"
    command = steps["rl_fused"]  # the same step with every fused path on
    overrides = rl_step.bench_overrides(Path(_option(command, "--model")), _sets(command))
    loaded = load_config(config, [*overrides, *rl_step.matched_precision(config, overrides)])
    assert (loaded.rollout.compile, loaded.rollout.cuda_graphs, loaded.model.kernels) == (
        "on",
        "on",
        "compiled",
    )
    assert "--trainers" in command and _option(command, "--trainers") == "everyprompt"


def test_the_gpu_suite_runs_only_the_steps_named(tmp_path):
    steps = _dry_run("--only", "rl_step,learner", "--out", str(tmp_path))
    assert list(steps) == ["setup", "models", "rl_step", "learner"]
    assert steps["models"][-1] == "--dense-only"  # no MoE bench, no upcycle to write
    assert "--dense-only" not in _dry_run("--only", "moe", "--out", str(tmp_path))["models"]
    assert "--dense-only" not in _dry_run("--out", str(tmp_path))["models"]


def test_the_learner_profile_switches_the_attention_it_is_asked_to():
    from everyprompt.models.attention import CUDA_SDPA, register
    from tests.conftest import tiny_config
    from tests.trainer.test_sides import _model

    profile_bench = _load("learner.learner_profile")
    model, _ = _model(tiny_config())
    register()
    model.set_attn_implementation(CUDA_SDPA)  # as the learner's policy has it on CUDA
    with profile_bench.attention_of(model, "with-cudnn"):
        assert model.config._attn_implementation == "sdpa"  # torch then chooses among all its backends
    assert model.config._attn_implementation == CUDA_SDPA  # restored on the way out
    with profile_bench.attention_of(model, "default"):
        assert model.config._attn_implementation == CUDA_SDPA
    with pytest.raises(SystemExit):
        profile_bench.main(["--model", str(ROOT), "--attention", "default,no-flash"])


def test_the_learner_profile_ranks_a_gpu_by_a_time_its_profiler_reports():
    """torch's profiler averages name the device's time `self_device_time_total` (the older
    `self_cuda_time_total` is gone: the profile failed on the first lent GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    profile_bench = _load("learner.learner_profile")
    key = profile_bench.time_key(torch.device("cuda:0"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4) @ torch.ones(4)
    event = prof.key_averages()[0]
    assert isinstance(getattr(event, key), int | float)
    assert isinstance(getattr(event, profile_bench.time_key(torch.device("cpu"))), int | float)


def test_trl_runs_on_the_device_the_recipe_trains_on(monkeypatch):
    """TRL's GRPOTrainer goes where everyprompt's learner goes (model.device): on the first lent GPU a
    fixed use_cpu=True ran it on the CPU beside everyprompt on the GPU."""
    import torch

    import everyprompt.devices.placement as placement
    from everyprompt.config import load_config

    rl = importlib.import_module("bench.learner.trl_grpo")
    config = load_config(ROOT / "configs" / "smollm2.yaml", [])
    assert rl.trl_on_cpu(config) is (not torch.cuda.is_available())  # model.device=auto
    assert rl.trl_on_cpu(load_config(ROOT / "configs" / "smollm2.yaml", ["model.device=cpu"])) is True
    # a machine whose `auto` is a GPU
    monkeypatch.setattr(placement, "resolve_device", lambda setting, key="": torch.device("cuda", 0))
    assert rl.trl_on_cpu(config) is False


def test_a_failed_models_step_skips_the_steps_that_need_a_model_at_once(tmp_path):
    """A machine replaced between the two calls lacks the GGUF's first half: the model steps say why and
    take no time, instead of each failing on its own."""
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\ncase "$2" in bench.gpu.gpu_models) echo "no GGUF here" >&2; exit 1;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    done = subprocess.run(
        ["bash", "bench/gpu/suite.sh", "--smoke", "--only", "dense,rl_step", "--out", str(tmp_path / "gpu")],
        cwd=ROOT,
        env={**os.environ, "PYTHON": str(python)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stdout + done.stderr  # models, dense, rl_step
    steps = (tmp_path / "gpu" / "steps.txt").read_text().splitlines()
    assert [line for line in steps if "skipped" in line] == [
        f"{name} skipped (the models step failed: no GGUF here)" for name in ("rl_step", "dense")
    ]


def test_the_full_suite_refuses_a_machine_whose_python_sees_no_gpu(tmp_path):
    """Its setup installs into the image's own Python: never into this host's."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        ["bash", "bench/gpu/suite.sh", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "sees no CUDA device" in done.stderr
    assert not (tmp_path / "steps.txt").read_text().strip()


def test_the_c7_mode_tells_its_runner_the_calls_time(tmp_path):
    """`--c7 ARGS` runs C7's own runner (not the evidence bench's sweeps) with the time the call has left,
    so that it starts no cell the call cannot finish; a dry run writes nothing into the checkout."""
    work = ROOT / "bench" / "results" / "gpu-evidence"
    existed = work.exists()
    done = subprocess.run(
        ["bash", "bench/gpu/suite.sh", "--smoke", "--dry-run", "--c7", "--smoke --seeds 0", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("evidence:")]
    words = line.split()
    assert words[words.index("-m") + 1 : words.index("-m") + 3] == ["bench.time_to_accuracy", "--time-left"]
    assert 200 < int(words[words.index("--time-left") + 1]) < 300  # the smoke's 300 s, less what went
    assert "--smoke --seeds 0" in line
    assert work.exists() == existed


def test_the_docs_decode_table_is_made_from_a_result_and_says_a_failed_compile():
    tables = _load("gpu.gpu_tables")
    row = {
        "batch": 1,
        "graphs_step_ms": 1.678,
        "fused_graphs_step_ms": 1.671,
        "fused_compile_failed": 1.0,
        "step_ms": 19.42,
        "floor_ms": 2.55,
        "captured_floor_ms": 0.46,
        "graphs_speedup": 13.6,
    }
    result = {"decode": [row, {**row, "batch": 64, "fused_compile_failed": 0.0}], "step_kernels": [
        {"batch": 1, "per_step": 668.0, "per_layer": 22.27}]}  # fmt: skip
    text = tables.table(result, "SmolLM2")
    lines = text.splitlines()
    assert lines[0] == "| SmolLM2 | batch 1 | batch 64 |"
    assert "| decode step with graphs, ms | 1.68 | 1.68 |" in lines
    assert "| decode step with graphs and compiled bodies, ms | compile failed | 1.67 |" in lines
    assert "| its matmuls, eager / captured, ms | 2.5 / 0.46 | 2.5 / 0.46 |" in lines
    assert "| kernels a layer (the step's over its layers) | 22.3 | - |" in lines
    assert not [line for line in lines if "tokens/s" in line]  # rows the result lacks are left out
