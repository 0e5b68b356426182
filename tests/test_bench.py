"""Smoke tests of the benchmark scripts on a 2-layer model (the real runs are minutes long)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    """A benchmark's module, imported as `python -m bench.NAME` runs it (a package's `__main__`, where the
    benchmark is a package with no door of its own: bench/throughput)."""
    if (ROOT / "bench" / name / "__main__.py").exists() and name != "evidence":
        return importlib.import_module(f"bench.{name}.__main__")
    return importlib.import_module(f"bench.{name.replace('evidence_', 'evidence.')}")


def _saved_tiny_model(directory: Path, chat_template: str | None = None) -> Path:
    from tests.conftest import make_tiny_model

    model, tokenizer = make_tiny_model()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# ~22 s; the losses it runs are tested in tests/algorithms/, the sweep behind it in tests/sweep/
@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
def test_algorithms_bench_smoke(tmp_path, capsys):
    bench = _load("quality.algorithms")
    args = "--tiny --steps 2 --evals 1 --workers 1 --seeds 0".split() + ["--out", str(tmp_path)]
    signal = ["--set", "rewards.function=tests.trainer.flaky_reward:scattered"]  # every step updates
    assert bench.main([*args, "--methods", "DAPO", "ESPO", *signal]) == 0
    payload = json.loads((tmp_path / "algorithms.json").read_text())
    assert [(r["method"], r["seed"]) for r in payload["runs"]] == [("DAPO", 0), ("ESPO", 0)]
    for run in payload["runs"]:
        # initial eval, one during the run (step 1), final (step 2)
        assert [e["step"] for e in run["evals"]] == [0, 1, 2]
        assert len(run["per_step"]["actor/clip_fraction"]) == 2
    assert "espo/clip_fraction_high" in payload["runs"][1]["espo"]
    assert (tmp_path / "algorithms.png").stat().st_size > 0
    assert "Policy-loss ablation" in capsys.readouterr().out


# ~40 s; ZVE's stages and runs are tested in tests/zve/. In the long set, which CI runs: in the slow set
# alone it went stale unnoticed (its bandit's samples lacked the reward components collect_groups reads)
@pytest.mark.long
def test_zve_bench_smoke(tmp_path, capsys):
    bench = _load("quality.zve")
    args = "--tiny --budget 8 --evals 1 --workers 1 --seeds 0 --methods GRPO ZVE".split()
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "zve.json").read_text())
    assert [(r["method"], r["seed"]) for r in payload["runs"]] == [("GRPO", 0), ("ZVE", 0)]
    grpo, zve = payload["runs"]
    assert grpo["rollouts"] == 8 and zve["rollouts"] >= 8  # the budget stops both (ZVE may overshoot a step)
    for row in payload["bandit"]:  # the binomial law, within sampling error of 200 groups
        assert abs(row["measured"] - row["predicted"]) < 0.15
    assert (tmp_path / "zve.png").stat().st_size > 0
    assert "equal rollout budget" in capsys.readouterr().out


def test_sampling_bench_smoke(tmp_path, capsys):
    bench = _load("engine.sampling")
    assert bench.main(["--vocab", "100", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sampling.json").read_text())["rows"]
    assert [(r["vocab"], r["top_p"]) for r in rows] == [(100, 1.0), (100, 0.9)]
    assert all(r["same_tokens"] and r["logprob_max_abs_diff"] < 1e-5 and r["compiled_ms"] > 0 for r in rows)
    assert "eager vs compiled" in capsys.readouterr().out


def test_inversion_bench_smoke(tmp_path, capsys):
    bench = _load("quality.inversion")
    assert bench.main(["--groups", "400", "--out", str(tmp_path)]) == 0
    rows = {r["reward"]: r for r in json.loads((tmp_path / "inversion.json").read_text())["rows"]}
    exact = rows["ternary judge, error rate 0.0"]
    assert exact["inversion_rate"] == 0 and exact["equal_quality_mean_abs_advantage"] == 0
    # group normalisation blows any scalar noise up to |A| ~ 0.8 on equal-quality groups
    assert rows["scalar RM, noise sd 0.05"]["equal_quality_mean_abs_advantage"] > 0.5
    assert "Advantage sign vs true quality" in capsys.readouterr().out


def test_chaos_parameter_difference_by_hand(tmp_path):
    import subprocess

    import torch

    bench = _load("distributed.chaos")
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    assert bench.max_difference(a, {"w": torch.tensor([1.0, 2.25]), "b": torch.tensor([0.0])}) == 0.5
    assert bench.max_difference(a, {"w": torch.tensor([1.0, 2.0])}) == float("inf")  # a tensor missing
    # a process that ends before its phase begins is not killed
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    assert bench.kill_at(quick, tmp_path, "rl", 0.0) == {"killed": False, "phase": "rl", "leftover": 0}


@pytest.mark.slow
def test_chaos_bench_kills_and_resumes(tmp_path):
    """Two runs killed with SIGKILL (during SFT and during RL), resumed: equal to the uninterrupted run."""
    bench = _load("distributed.chaos")
    assert bench.main(["--runs", "2", "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    summary = json.loads((tmp_path / "chaos.json").read_text())["summary"]
    assert summary["finished"] == 2 and summary["max_parameter_difference"] <= 1e-6
    assert summary["leftover_processes"] == 0


def test_genrm_bench_smoke(tmp_path, capsys):
    bench = _load("engine.genrm")
    assert bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "genrm.json").read_text())
    assert payload["batch_1"]["completions"] == payload["batch_16"]["completions"] == 16
    assert payload["same_verdicts"] and payload["speedup"] > 0
    assert "GenRM judge" in capsys.readouterr().out


@pytest.mark.slow  # ~30 s: it measures peak memory in a process per set-up
def test_training_bench_smoke(tmp_path, capsys):
    bench = _load("learner.training")
    chosen = ["fp32", "LoRA", "LoRA + bf16, base in bf16"]
    assert bench.main(["--tiny", "--setups", *chosen, "--out", str(tmp_path)]) == 0
    setups = json.loads((tmp_path / "training.json").read_text())["setups"]
    assert list(setups) == chosen
    assert setups["LoRA"]["trainable_parameters"] < setups["fp32"]["trainable_parameters"]
    # the frozen base in bf16: its bytes halve, the fp32 adapters' stay
    frozen = setups["fp32"]["weights_mib"]
    adapters = setups["LoRA"]["weights_mib"] - frozen
    assert setups["LoRA + bf16, base in bf16"]["weights_mib"] == pytest.approx(frozen / 2 + adapters)
    assert all(s["step_memory_mib"] > 0 and s["step_s"] > 0 for s in setups.values())
    assert setups["fp32"]["step_time_vs_fp32"] == 1.0
    assert "LoRA" in capsys.readouterr().out


def test_scale_projection_by_hand():
    bench = _load("distributed.scale")
    base = {"step_s": 1.45, "rollout_s": 0.6, "train_s": 0.8}
    ray_one = {"step_s": 1.70, "weight_sync_s": 0.03}
    # overhead 1.70 - 1.45 = 0.25; 2 workers, 2 ranks: 0.6/2 + 0.8/2 + 0.03 + 0.25 = 0.98
    assert bench.project(base, ray_one, 2, 2) == pytest.approx(0.98)
    # 4 workers, 1 rank: 0.15 + 0.8 + 0.03 + 0.25 = 1.23
    assert bench.project(base, ray_one, 4, 1) == pytest.approx(1.23)


def test_smollm2_summary_hand_computed(tmp_path, monkeypatch):
    bench = _load("quality.smollm2")
    before = {"greedy_accuracy": 0.40, "greedy_accuracy/level_1": 0.5, "num_prompts": 150.0}
    runs = {
        seed: {
            "results": {"greedy_accuracy": after, "step": 30},
            "wall_seconds": 1500.0,
            "rl_step_seconds": 1650.0,
            "run_dir": f"r{seed}",
        }
        for seed, after in [(0, 0.46), (1, 0.47), (2, 0.48)]
    }
    summary = bench.summarise(before, runs)
    # gains 6, 7, 8 points: mean 7, sd 1, t(2) = 4.303 -> 7 +- 4.303 / sqrt(3) = 7 +- 2.484
    assert summary["mean_gain"] == pytest.approx(0.07)
    low, high = summary["gain_interval_95"]
    assert low == pytest.approx(0.07 - 0.02484, abs=1e-4) and high == pytest.approx(0.07 + 0.02484, abs=1e-4)
    assert summary["meets_target"] and summary["by_level_before"] == {"level_1": 0.5}
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.MARKERS[0]}\nold table\n{bench.MARKERS[1]}\nrest\n")
    monkeypatch.setattr(bench, "README", readme)
    bench.write_readme(summary)
    text = readme.read_text()
    assert "old table" not in text and "| 2 | 40.0% | 48.0% | +8.0 points | 27.5 min |" in text
    assert "Mean gain +7.0 points (95% t-interval +4.5 to +9.5) over 3 seeds" in text and text.endswith(
        "rest\n"
    )
    # one seed, or a gain whose interval reaches 0: not met
    assert not bench.summarise(before, {0: runs[0]})["meets_target"]
    runs[2]["results"]["greedy_accuracy"] = 0.30
    assert not bench.summarise(before, runs)["meets_target"]


def test_smollm2_run_time_is_the_sum_of_its_steps(tmp_path):
    """A resumed run keeps each step once in metrics.jsonl; their times add up to the run's RL time."""
    bench = _load("quality.smollm2")
    rows = [{"step": 1, "time/step_s": 50.5}, {"step": 2, "time/step_s": 49.5}, {"step": 3}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert bench.step_seconds(tmp_path) == pytest.approx(100.0)


def test_rl_growth_grid_table_and_plot(tmp_path):
    bench = _load("learner.rl_growth")
    grid = bench.points(ROOT / "configs" / "smollm2.yaml", [4, 8], [48, 96])
    held = [(p["axis"], p["group_size"], p["max_new_tokens"]) for p in grid]
    # each axis moves while the other stays at the recipe's (group size 8, cap 96)
    assert held == [
        ("group_size", 4, 96),
        ("group_size", 8, 96),
        ("max_new_tokens", 8, 48),
        ("max_new_tokens", 8, 96),
    ]
    gib = 2**30
    results = [
        {
            **p,
            "everyprompt": {"step_s": 10.0 * i, "peak_rss_bytes": 4 * gib, "mean_length": 50.0},
            "trl": {"step_s": 40.0 * i, "peak_rss_bytes": 16 * gib, "mean_length": 52.0},
        }
        for i, p in enumerate(grid, start=1)
    ]
    results[-1]["trl"] = {"failed": "killed by signal 9"}  # e.g. out of memory at the largest point
    rows = bench.table(results).splitlines()
    assert rows[2] == "| 4 | 96 | 50 / 52 | 10.0 / 40.0 | 0.25x | 4.00 / 16.00 | 0.25x |"
    assert rows[-1] == "| 8 | 96 | 50 / failed | 40.0 / failed |  | 4.00 / failed |  |"
    assert len(rows) == 2 + len(grid)
    bench.plot(results, tmp_path / "growth.png")
    assert (tmp_path / "growth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tools_arm_summary_hand_computed_and_its_runs_read_back():
    bench = _load("environments.tools")
    before = {"greedy_accuracy": 0.2, "num_prompts": 150.0}
    runs = {
        1: {"results": {"greedy_accuracy": 0.5}, "rl_step_seconds": 60.0, "run_dir": "r1"},
        0: {"results": {"greedy_accuracy": 0.3}, "rl_step_seconds": 50.0, "run_dir": "r0"},
    }
    arm = bench.arm_summary(before, runs)
    assert [s["seed"] for s in arm["seeds"]] == [0, 1] and arm["held_out_prompts"] == 150
    assert arm["mean_gain"] == pytest.approx((0.1 + 0.3) / 2)
    assert arm["mean_accuracy_after"] == pytest.approx(0.4)
    assert bench.arm_summary(before, bench._runs_of(arm)) == arm  # a summary's runs give it back
    assert bench.arm_summary(before, {})["mean_gain"] is None
    assert bench.ARMS["no_tool"] == ["env.name=null"]  # the same config, the environment off


def test_tools_call_fraction_counts_completions_that_call(tmp_path):
    bench = _load("environments.tools")
    rows = [
        {"completion": "<calc>6*7</calc>\ntool\n42"},
        {"completion": "42."},
        {"completion": "x <calc>1</calc>"},
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert bench.call_fraction(tmp_path / "c.jsonl") == pytest.approx(2 / 3)


@pytest.mark.slow  # two server processes (about 20 s); tests/serve/ runs the server in the default run
def test_serve_bench_smoke(tmp_path, capsys):
    pytest.importorskip("openai", reason="the openai client is in the dev extra")
    serve = _load("engine.serve")

    assert (
        serve.main(["--concurrency", "4", "--sequential", "2", "--max-tokens", "6", "--out", str(tmp_path)])
        == 0
    )
    result = json.loads((tmp_path / "serve_tiny-chat.json").read_text())
    assert result["concurrent"]["requests"] == 4 and result["sequential"]["requests"] == 2
    assert 0 < result["concurrent"]["completion_tokens"] <= 4 * 6
    assert result["throughput_ratio"] > 0 and "machine" in result
    assert "tokens/s" in capsys.readouterr().out


def _machine_paths(value) -> list[str]:
    """The strings of a results payload that hold an absolute path (alone or as an override's value)."""
    if isinstance(value, dict):
        return [found for item in value.values() for found in _machine_paths(item)]
    if isinstance(value, list):
        return [found for item in value for found in _machine_paths(item)]
    if isinstance(value, str) and any(
        part.startswith("/") and len(Path(part).parts) > 2 for part in value.split("=")
    ):
        return [value]
    return []


def test_no_committed_result_names_a_machine_path():
    files = sorted(p for p in (ROOT / "bench" / "results").rglob("*.json") if "_runs" not in str(p))
    assert len(files) > 30
    found = {str(p.relative_to(ROOT)): _machine_paths(json.loads(p.read_text())) for p in files}
    assert {name: paths for name, paths in found.items() if paths} == {}


def test_paths_are_written_relative_to_the_checkout_they_lie_in(tmp_path):
    """A bench run from another copy of the tree (a frozen worktree) writing into this checkout's results
    (`--out`) records paths relative to the checkout, as one run from within it does."""
    common = _load("common")
    other = tmp_path / "checkout"
    (other / ".git").mkdir(parents=True)
    run = other / "bench" / "results" / "evidence_runs" / "cell"
    run.mkdir(parents=True)
    assert common.repo_path(run) == "bench/results/evidence_runs/cell"
    assert common.repo_path(ROOT / "bench" / "results") == "bench/results"
    assert common.repo_path(tmp_path / "loose") == str(tmp_path / "loose")  # in no checkout: as it is
    assert common.repo_override(f"model.path={run}") == "model.path=bench/results/evidence_runs/cell"
    assert common.repo_override("rl.steps=30") == "rl.steps=30"
    assert _machine_paths({"fixed": [f"model.path={run}"], "n": 3}) == [f"model.path={run}"]


def test_a_probe_returns_its_json_and_shows_what_it_warned_of(tmp_path, capsys):
    common = _load("common")
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, sys\n"
        "print('a capture failed', file=sys.stderr)\n"
        "print(json.dumps({'flag': sys.argv[1], 'arguments': json.loads(sys.argv[2])}))\n"
    )
    assert common.run_probe(script, "--probe", [1, "a"]) == {"flag": "--probe", "arguments": [1, "a"]}
    assert "a capture failed" in capsys.readouterr().err
    script.write_text("import sys\nprint('it broke', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(common.ProbeFailed, match="exit 3") as failed:
        common.run_probe(script, "--probe", [])
    assert "it broke" in str(failed.value)


@pytest.mark.long  # three tiny runs, one beside a spinning process (~50 s)
def test_contention_bench_smoke(tmp_path, capsys):
    from bench.learner import contention

    out = tmp_path / "contention.json"
    assert contention.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["loaded"]["threads"] == [1.0]  # a core taken: one thread
    assert result["loaded_ratio"] > 0 and result["loaded_fixed_ratio"] > 0
    assert "its quiet time" in capsys.readouterr().out
