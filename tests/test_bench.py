"""Smoke tests of the benchmark scripts on a 2-layer model (the real runs are minutes long)."""

import ctypes.util
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    if str(ROOT / "bench") not in sys.path:  # the scripts import their shared helpers (bench/setups.py)
        sys.path.insert(0, str(ROOT / "bench"))
    path = ROOT / "bench" / f"{name}.py"
    if not path.exists():  # a benchmark that is a package of its own (bench/throughput/)
        path = ROOT / "bench" / name / "__main__.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (a dataclass looks its module up while it is being made)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~22 s; the losses it runs are tested in tests/algorithms/, the sweep behind it in tests/sweep/
def test_algorithms_bench_smoke(tmp_path, capsys):
    bench = _load("algorithms")
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


@pytest.mark.slow  # ~22 s; ZVE's stages and runs are tested in tests/zve/
def test_zve_bench_smoke(tmp_path, capsys):
    bench = _load("zve")
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


def test_mismatch_bench_smoke(tmp_path, capsys):
    import torch

    bench = _load("mismatch")
    assert bench.main(["--tiny", "--batches", "1", "--rl-steps", "1", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "mismatch.json").read_text())
    cells = {(c["precision"], c["replay"]): c for c in payload["cells"]}
    assert len(cells) == 6
    for precision in ("fp32", "bf16", "fp8"):
        assert cells[(precision, "r3")]["mismatch/routing_agreement"] == 1.0  # replay: by construction
    assert cells[("fp8", "off")]["mismatch/logp_abs_diff"] > cells[("fp32", "off")]["mismatch/logp_abs_diff"]
    assert cells[("fp8", "r3")]["rl"]["all_finite"]
    # below fp32 both cells keep their per-token data for further analysis
    for precision in ("bf16", "fp8"):
        for replay in ("off", "r3"):
            tokens = torch.load(tmp_path / "mismatch_runs" / f"{precision}_{replay}" / "tokens.pt")
            assert tokens["perturbation_layers"].shape == tokens["flipped_layers"].shape
            assert len(tokens["diff"]) == len(tokens["logprob"]) == len(tokens["entropy"])
    assert "mismatch per precision and replay mode" in capsys.readouterr().out


def test_flipped_token_analysis_matches_on_entropy():
    import torch

    bench = _load("mismatch")
    # unflipped tokens: |dlogp| = entropy / 10; flipped: twice that. The raw means mix entropies (the
    # flipped sit at high entropy), the entropy-matched ratio recovers the factor 2 exactly.
    entropy = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.9, 1.0])
    mask = torch.zeros(12, dtype=torch.bool)
    mask[10:] = True
    diff = entropy / 10 * torch.where(mask, 2.0, 1.0)
    out = bench.flipped_token_analysis(diff, mask, entropy, neighbours=2, resamples=50)
    assert out["flipped_tokens"] == 2 and out["tokens"] == 12
    assert out["logp_abs_diff_on_off_flipped_tokens"] == pytest.approx(0.19)
    assert out["logp_abs_diff_on_off_unflipped_tokens"] == pytest.approx(0.055)
    # the 2 nearest unflipped entropies of 0.9 are 0.8, 0.9 (mean diff 0.085); of 1.0: 0.9, 1.0 (0.095)
    assert out["logp_abs_diff_entropy_matched_unflipped"] == pytest.approx(0.09)
    assert out["flipped_over_matched_ratio"] == pytest.approx(0.19 / 0.09)
    # torch's median of an even count is the lower middle value
    assert out["median_logp_abs_diff_on_off_flipped_tokens"] == pytest.approx(0.18)
    assert out["median_logp_abs_diff_on_off_unflipped_tokens"] == pytest.approx(0.05)
    low, high = out["flipped_over_matched_ratio_ci95"]
    assert low <= 0.19 / 0.09 <= high


def test_flipped_token_analysis_matches_on_router_perturbation():
    import torch

    bench = _load("mismatch")
    # |dlogp| = perturbation / 10 for every token, flipped or not; the two flipped tokens sit at the two
    # largest perturbations. Raw means say flipped tokens are worse (0.095 vs 0.055); matched on the
    # perturbation (nearest neighbour: the unflipped token with the same one) they are not: ratio 1.
    perturbation = torch.cat([torch.arange(1, 11) / 10, torch.tensor([0.9, 1.0])])
    mask = torch.zeros(12, dtype=torch.bool)
    mask[10:] = True
    entropy = torch.ones(12)
    out = bench.flipped_token_analysis(
        perturbation / 10, mask, entropy, perturbation, neighbours=1, resamples=50
    )
    assert out["logp_abs_diff_on_off_flipped_tokens"] == pytest.approx(0.095)
    assert out["logp_abs_diff_on_off_unflipped_tokens"] == pytest.approx(0.055)
    assert out["router_perturbation_flipped"] == pytest.approx(0.95)
    assert out["router_perturbation_unflipped"] == pytest.approx(0.55)
    assert out["logp_abs_diff_perturbation_matched_unflipped"] == pytest.approx(0.095)
    assert out["flipped_over_perturbation_matched_ratio"] == pytest.approx(1.0)
    assert out["flipped_over_perturbation_matched_ratio_ci95"] == pytest.approx([1.0, 1.0])


def test_flipped_token_analysis_matches_on_the_sampled_log_prob_and_caps_outliers():
    import torch

    bench = _load("mismatch")
    # |dlogp| = -logprob / 100 for every token (a rarer sample moves more under the same logit error);
    # the two flipped tokens are the two rarest samples. Entropy and perturbation are equal everywhere,
    # so only the log-prob separates them: matched on all three, the ratio is exactly 1.
    logprob = -torch.cat([torch.arange(1, 11).float(), torch.tensor([9.0, 10.0])])
    mask = torch.zeros(12, dtype=torch.bool)
    mask[10:] = True
    same = torch.ones(12)
    out = bench.flipped_token_analysis(-logprob / 100, mask, same, same, logprob, neighbours=1, resamples=50)
    assert out["logp_abs_diff_on_off_flipped_tokens"] == pytest.approx(0.095)
    assert out["logp_abs_diff_perturbation_matched_unflipped"] != pytest.approx(0.095)  # blind to log-prob
    assert out["logp_abs_diff_fully_matched_unflipped"] == pytest.approx(0.095)
    assert out["flipped_over_fully_matched_ratio"] == pytest.approx(1.0)
    assert out["flipped_over_fully_matched_ratio_ci95"] == pytest.approx([1.0, 1.0])
    # the rarest flipped sample made an outlier (|dlogp| 5 instead of 0.10): the mean ratio jumps to
    # (0.09 + 5) / (0.09 + 0.10); capped at the 10/11 quantile of the 12 values (0.10, the largest
    # ordinary one) it is 1 again
    diff = -logprob / 100
    diff[11] = 5.0
    out = bench.flipped_token_analysis(
        diff, mask, same, same, logprob, neighbours=1, resamples=50, cap_quantile=10 / 11
    )
    assert out["flipped_over_fully_matched_ratio"] == pytest.approx((0.09 + 5.0) / (0.09 + 0.10))
    assert out["logp_abs_diff_cap"] == pytest.approx(0.10)
    assert out["flipped_over_fully_matched_ratio_capped"] == pytest.approx(1.0)


def test_downstream_ratio_by_hand():
    import torch

    bench = _load("mismatch")
    perturbation = torch.tensor(
        [
            [1.0, 1.0, 1.0],  # unflipped
            [1.0, 3.0, 1.0],  # unflipped: per-layer control means [1, 2, 1]
            [5.0, 4.0, 2.0],  # first flip at layer 0: layers 1, 2 count, 4 + 2 against 2 + 1
            [0.0, 0.0, 3.0],  # first flip at layer 1: layer 2 counts, 3 against 1
            [9.0, 9.0, 9.0],  # flips only at the last layer: nothing after it, left out
        ]
    )
    flipped = torch.tensor([[0, 0, 0], [0, 0, 0], [1, 0, 1], [0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert bench.downstream_ratio(perturbation, flipped) == pytest.approx((6 + 3) / (3 + 1))
    only_last = torch.zeros(5, 3, dtype=torch.bool)
    only_last[4, 2] = True
    assert bench.downstream_ratio(perturbation, only_last) != bench.downstream_ratio(perturbation, only_last)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_router_perturbation_is_the_engines_precision_error(tmp_path, precision):
    """The engine's router logits (recorded by the decode steps that sampled) against the trainer's under
    r3: equal for an fp32 engine (same network, same arithmetic up to kernel order), apart for fp8 weights."""
    import torch

    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    bench = _load("mismatch")
    overrides = [*bench.TINY, "logging.progress=false", "logging.tensorboard=false", "sft.steps=0"]
    overrides += [f"rollout.precision={precision}", "rl.router_replay=r3", "rl.old_logprobs=recompute"]
    trainer = Run(load_config(None, overrides), tmp_path).trainer()
    engine_logits = bench.record_router_logits(trainer.engine)
    batch = trainer.rollout.next_batch(0)
    assert all((tuple(p), tuple(c)) in engine_logits for p, c in zip(batch.prompt_ids, batch.completion_ids))
    perturbation = bench.router_perturbation(trainer, batch, engine_logits)
    layers = trainer.model.config.num_hidden_layers
    assert perturbation.shape == (sum(len(c) for c in batch.completion_ids), layers)
    if precision == "fp32":
        assert float(perturbation.max()) < 1e-5
    else:
        assert float(perturbation.min()) > 1e-4
    assert bool(torch.isfinite(perturbation).all())


@pytest.mark.slow  # ~65 s (the largest of the default run); the engine's paths it times are tested in tests/rollout/
def test_throughput_bench_smoke(tmp_path, capsys):
    bench = _load("throughput")
    assert bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "throughput.json").read_text())
    a, b, c = payload["engine_vs_hf"], payload["reward_overlap"], payload["scheduling"]
    # equal work on every side: native engine, hf engine, transformers generate
    assert a["native_tokens"] == a["hf_engine_tokens"] == a["hf_tokens"] == a["batch"] * a["new_tokens"]
    assert 0 < a["profile"]["native"]["compute_kernel_share"] < 1
    # scored after the rollout, inline: at least every completion's wait (not a timing race against the
    # rollout timed alone later, which a loaded machine can lose)
    waits = b["completions"] * b["reward_s_per_completion"]
    assert b["rollout_then_reward_s"] >= waits and set(b["by_workers"]) == {"1", "2", "4", "8"}
    assert c["fifo"]["tokens"] == c["longest_first"]["tokens"] == c["tokens"]
    # the rollout workload: both sides deliver the same requests' tokens; static batches compute more rows
    r = payload["engine_vs_hf_rollout"]
    assert r["tokens"] == c["tokens"] and r["requests"] == c["requests"] and 0 < r["hf_useful_share"] < 1
    for workers in b["by_workers"].values():
        split = workers["reward_wait_after_generation_s"] >= 0 and workers["overlap_ratio"] > 0
        assert split and "generation_slowdown_s" in workers
    # (e): the decode step against its GEMMs alone, both engines; the compile probe (warm only in --tiny)
    e, k = payload["decode_floor"], payload["compile"]
    # the recorder saw every GEMM of a decode step: per layer q/k/v, scores, values, output, router and
    # the two expert products (7), plus the LM head; their time alone and the steps' are measured (how
    # they compare is the bench's figure: a loaded machine can time the GEMMs alone slower than a step)
    assert e["gemms_per_step"] == 7 * 2 + 1 and e["gemm_gflop_per_step"] > 0
    assert e["floor_ms"] > 0 and e["eager_step_ms"] > 0 and e["compiled_step_ms"] > 0
    assert a["compiled_stats"]["compiled"] == 1.0 and a["compiled_tokens_per_s"] > 0
    assert k["warm"]["compile_s"] >= 0 and math.isnan(k["cold"]["compile_s"])
    assert "Rollout throughput" in capsys.readouterr().out


def _saved_tiny_model(directory: Path) -> Path:
    from tests.conftest import make_tiny_model

    model, tokenizer = make_tiny_model()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_throughput_bench_takes_a_model(tmp_path, capsys):
    bench = _load("throughput")
    model = _saved_tiny_model(tmp_path / "tiny")
    assert bench.main(["--model", str(model), "--quick", "--out", str(tmp_path / "out")]) == 0
    payload = json.loads((tmp_path / "out" / "throughput_tiny.json").read_text())
    assert payload["model_type"] == "qwen3_moe" and payload["device"] == "cpu"
    assert [row["batch"] for row in payload["decode"]] == [1, 4]
    for row in payload["decode"]:
        # equal work was checked inside; both times are measured (how they compare is the bench's figure,
        # not a test's: on a loaded machine the GEMMs alone once timed slower than the whole step)
        assert row["native_tokens_per_s"] > 0 and row["generate_tokens_per_s"] > 0
        assert row["gemms"] == 7 * 2 + 1 and row["floor_ms"] > 0 and row["step_ms"] > 0
        assert row["step_vs_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
    bandwidth = payload["bandwidth"]  # fp32; a token reads its top-2 experts of 4 only
    assert bandwidth["all_weight_bytes"] == 4 * payload["parameters"] > bandwidth["weight_bytes"]
    tail = payload["long_tail"]
    assert tail["requests"] == 12 and 0 < tail["generate_useful_share"] < 1
    assert [row["length"] for row in payload["prefill"]] == [16, 32]
    assert payload["machine"]["dtype"] == "fp32"
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow  # a compile of the decode step (~1 min)
def test_throughput_bench_measures_the_compiled_step(tmp_path):
    bench = _load("throughput")
    model = _saved_tiny_model(tmp_path / "tiny")
    argv = ["--model", str(model), "--quick", "--compile", "--out", str(tmp_path / "out")]
    assert bench.main(argv) == 0
    payload = json.loads((tmp_path / "out" / "throughput_tiny.json").read_text())
    assert payload["compiled"] is True
    for row in payload["decode"]:  # equal work was checked inside, as for the eager engine
        assert row["compiled_tokens_per_s"] > 0 and row["compile_s"] >= 0
        assert row["compiled_speedup"] == pytest.approx(row["generate_s"] / row["compiled_s"])
    assert payload["decode"][0]["compile_s"] > 0  # the first batch size compiles; later ones may reuse it


def test_throughput_bench_refuses_a_missing_model_and_a_device_it_lacks(tmp_path, capsys):
    bench = _load("throughput")
    assert bench.main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        assert bench.main(["--model", str(tmp_path), "--device", "cuda"]) == 2
        assert "torch sees no CUDA device" in capsys.readouterr().err


def test_memory_bench_probe_measures_a_pass(tmp_path):
    bench = _load("memory")
    model = str(_saved_tiny_model(tmp_path / "tiny"))
    for grad in (False, True):
        for chunk in (0, 8):
            row = bench.probe(model, 4, 32, 16, chunk, grad, "fp32")
            assert row["peak_bytes"] >= 0 and row["seconds"] > 0 and row["grad"] is grad
    with pytest.raises(SystemExit):
        bench.main(["--model", str(tmp_path / "nowhere")])


def test_sampling_bench_smoke(tmp_path, capsys):
    bench = _load("sampling")
    assert bench.main(["--vocab", "100", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sampling.json").read_text())["rows"]
    assert [(r["vocab"], r["top_p"]) for r in rows] == [(100, 1.0), (100, 0.9)]
    assert all(r["same_tokens"] and r["logprob_max_abs_diff"] < 1e-5 and r["compiled_ms"] > 0 for r in rows)
    assert "eager vs compiled" in capsys.readouterr().out


def test_inversion_bench_smoke(tmp_path, capsys):
    bench = _load("inversion")
    assert bench.main(["--groups", "400", "--out", str(tmp_path)]) == 0
    rows = {r["reward"]: r for r in json.loads((tmp_path / "inversion.json").read_text())["rows"]}
    exact = rows["ternary judge, error rate 0.0"]
    assert exact["inversion_rate"] == 0 and exact["equal_quality_mean_abs_advantage"] == 0
    # group normalisation blows any scalar noise up to |A| ~ 0.8 on equal-quality groups
    assert rows["scalar RM, noise sd 0.05"]["equal_quality_mean_abs_advantage"] > 0.5
    assert "Advantage sign vs true quality" in capsys.readouterr().out


def test_chaos_parameter_difference_by_hand(tmp_path):
    import subprocess
    import sys

    import torch

    bench = _load("chaos")
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    assert bench.max_difference(a, {"w": torch.tensor([1.0, 2.25]), "b": torch.tensor([0.0])}) == 0.5
    assert bench.max_difference(a, {"w": torch.tensor([1.0, 2.0])}) == float("inf")  # a tensor missing
    # a process that ends before its phase begins is not killed
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    assert bench.kill_at(quick, tmp_path, "rl", 0.0) == {"killed": False, "phase": "rl", "leftover": 0}


@pytest.mark.slow
def test_chaos_bench_kills_and_resumes(tmp_path):
    """Two runs killed with SIGKILL (during SFT and during RL), resumed: equal to the uninterrupted run."""
    bench = _load("chaos")
    assert bench.main(["--runs", "2", "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    summary = json.loads((tmp_path / "chaos.json").read_text())["summary"]
    assert summary["finished"] == 2 and summary["max_parameter_difference"] <= 1e-6
    assert summary["leftover_processes"] == 0


def test_genrm_bench_smoke(tmp_path, capsys):
    bench = _load("genrm")
    assert bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "genrm.json").read_text())
    assert payload["batch_1"]["completions"] == payload["batch_16"]["completions"] == 16
    assert payload["same_verdicts"] and payload["speedup"] > 0
    assert "GenRM judge" in capsys.readouterr().out


@pytest.mark.slow  # ~30 s: it measures peak memory in a process per set-up
def test_training_bench_smoke(tmp_path, capsys):
    bench = _load("training")
    assert bench.main(["--tiny", "--setups", "fp32", "LoRA", "--out", str(tmp_path)]) == 0
    setups = json.loads((tmp_path / "training.json").read_text())["setups"]
    assert list(setups) == ["fp32", "LoRA"]
    assert setups["LoRA"]["trainable_parameters"] < setups["fp32"]["trainable_parameters"]
    assert all(s["step_memory_mib"] > 0 and s["step_s"] > 0 for s in setups.values())
    assert setups["fp32"]["step_time_vs_fp32"] == 1.0
    assert "LoRA" in capsys.readouterr().out


def test_scale_projection_by_hand():
    bench = _load("scale")
    base = {"step_s": 1.45, "rollout_s": 0.6, "train_s": 0.8}
    ray_one = {"step_s": 1.70, "weight_sync_s": 0.03}
    # overhead 1.70 - 1.45 = 0.25; 2 workers, 2 ranks: 0.6/2 + 0.8/2 + 0.03 + 0.25 = 0.98
    assert bench.project(base, ray_one, 2, 2) == pytest.approx(0.98)
    # 4 workers, 1 rank: 0.15 + 0.8 + 0.03 + 0.25 = 1.23
    assert bench.project(base, ray_one, 4, 1) == pytest.approx(1.23)


def test_smollm2_summary_hand_computed(tmp_path, monkeypatch):
    bench = _load("smollm2")
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
    bench = _load("smollm2")
    rows = [{"step": 1, "time/step_s": 50.5}, {"step": 2, "time/step_s": 49.5}, {"step": 3}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert bench.step_seconds(tmp_path) == pytest.approx(100.0)


def test_the_readme_speed_table_is_the_one_the_results_give():
    """The README's speed table is generated (bench/speed_table.py); it must match the committed results."""
    bench = _load("speed_table")
    results = bench.model_results()
    assert results, "no model benchmark results in bench/results"
    readme = (ROOT / "README.md").read_text()
    expected = bench.readme_section(results, bench.rl_step_results())
    assert bench.section(readme) == expected, "run `python bench/speed_table.py`"
    # the README's table is one machine's: the CPU's; the GPU's results are kept apart (docs/gpu.md)
    assert {r["device"] for r in results} == {"cpu"}
    gpu = bench.model_results(device="cuda")  # the H100's eager run, the H200's with graphs (dense, MoE)
    assert [r["device"] for r in gpu] == ["cuda:0"] * 3
    assert sorted(bool(r.get("graphs")) for r in gpu) == [False, True, True]
    assert {r["everyprompt"].get("device", "cpu") for r in bench.rl_step_results()} == {"cpu"}
    assert [r["everyprompt"]["device"] for r in bench.rl_step_results(device="cuda")] == ["cuda:0"]  # H200


def test_rl_step_decodes_in_trls_arithmetic_and_the_table_keeps_that_comparison(tmp_path):
    from everyprompt.config import load_config

    bench = _load("rl_step")
    recipe = ROOT / "configs" / "smollm2.yaml"  # trained in bf16: TRL's generate runs under its autocast
    matched = bench.matched_precision(recipe, [])
    assert matched == ["rollout.precision=bf16", "rl.old_logprobs=recompute"]
    config = load_config(recipe, matched)  # a set-up the config accepts
    assert config.rollout.precision == "bf16" and config.rl.mini_batches == 1  # no extra old-policy pass
    assert bench.matched_precision(recipe, ["model.dtype=fp32"]) == []
    table = _load("speed_table")
    row = {"benchmark": "rl_step", "step_ratio": 0.5, "trl_micro_batch": "matched"}
    for name, precision in (("a", "matched"), ("b", "recipe")):
        (tmp_path / f"rl_step_{name}.json").write_text(json.dumps({**row, "rollout_precision": precision}))
    assert [r["rollout_precision"] for r in table.rl_step_results(tmp_path)] == ["matched"]
    assert table._extra({"everyprompt_overrides": matched}) == (
        " with `rollout.precision=bf16`, `rl.old_logprobs=recompute`"
    )
    assert table._extra(row) == ""
    assert table._malloc({"malloc": "tcmalloc"}) == "; everyprompt on tcmalloc"
    assert table._malloc({}) == table._malloc({"malloc": "glibc"}) == ""  # (results from before the field)
    # the --set overrides (both sides') come first
    assert table._extra({"overrides": ["malloc=tcmalloc"], "everyprompt_overrides": matched[:1]}) == (
        " with `malloc=tcmalloc`, `rollout.precision=bf16`"
    )


@pytest.mark.slow  # each trainer in a process of its own (~40 s)
def test_rl_step_bench_smoke(tmp_path, capsys):
    bench = _load("rl_step")
    model = _saved_tiny_model(tmp_path / "tiny")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        "model:\n  dtype: bf16\nrollout:\n  max_new_tokens: 8\ndata:\n  num_train: 16\n"
        "rl:\n  prompts_per_step: 2\n  group_size: 2\n  micro_batch_size: 2\n  mini_batches: 1\n"
    )
    trainers = "everyprompt,trl" if importlib.util.find_spec("trl") else "everyprompt"
    argv = ["--model", str(model), "--config", str(recipe), "--steps", "2", "--trainers", trainers]
    assert bench.main([*argv, "--out", str(tmp_path / "out"), "--tag", "smoke"]) == 0
    payload = json.loads((tmp_path / "out" / "rl_step_tiny_smoke.json").read_text())
    ours = payload["everyprompt"]
    assert ours["malloc"] == "glibc"  # the config's default, in the probe's own process
    assert payload["everyprompt_overrides"] == ["rollout.precision=bf16", "rl.old_logprobs=recompute"]
    assert ours["step_s"] > 0 and ours["peak_rss_bytes"] > 0 and ours["group_size"] == 2
    if "trl" in payload:
        assert payload["trl"]["generate_under_autocast"] is True
        assert payload["step_ratio"] == pytest.approx(ours["step_s"] / payload["trl"]["step_s"])
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow  # ~40 s: two settings, each a process of two RL steps
def test_heap_trace_bench_smoke(tmp_path, capsys, monkeypatch):
    bench = _load("heap_trace")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the probes import the test reward below
    model = _saved_tiny_model(tmp_path / "tiny")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        "sft:\n  steps: 0\nrollout:\n  max_new_tokens: 8\ndata:\n  num_train: 16\n"
        "rl:\n  prompts_per_step: 2\n  group_size: 2\n  micro_batch_size: 2\n  mini_batches: 1\n"
    )
    signal = "rewards.function=tests.trainer.flaky_reward:scattered"  # every group updates the model
    argv = ["--model", str(model), "--config", str(recipe), "--kept", "1024,4+thp+trim", "--set", signal]
    assert bench.main([*argv, "--out", str(tmp_path / "out")]) == 0
    payload = json.loads((tmp_path / "out" / "heap_trace_tiny.json").read_text())
    for row in payload["settings"].values():
        assert {"rollout", "update", "micro_batch_1", "weight_sync", "load"} <= set(row["phases"])
        assert row["phases"]["micro_batch_1"]["max_in_use_gib"] > 0  # glibc's own count was read
        assert row["peak_rss_bytes"] > 0 and row["step_s"] > 0
        # the phases' seconds cover the steps; loading and running a model maps pages in
        assert sum(p["seconds"] for p in row["phases"].values()) > row["step_s"]
        assert sum(p["page_faults"] for p in row["phases"].values()) > 0
    assert set(payload["settings"]) == {"1024", "4+thp+trim"}
    # the probe process itself saw the variables only where the setting asked for them
    assert [row["huge_pages"] for row in payload["settings"].values()] == [False, True]
    assert [row["allocator"] for row in payload["settings"].values()] == ["glibc", "glibc"]
    # the heap was trimmed before each micro-batch (2 steps of 4 sequences in micro-batches of 2) only where
    # the setting asked for it
    assert [row["trims"] for row in payload["settings"].values()] == [0, 4]
    assert "wrote" in capsys.readouterr().out


def test_heap_trace_settings_are_sizes_with_known_flags(tmp_path, capsys):
    bench = _load("heap_trace")
    assert bench._setting("1024") == ("1024", 1024, [])
    assert bench._setting("4+thp+trim") == ("4+thp+trim", 4, ["thp", "trim"])
    assert bench._setting("1024+jemalloc") == ("1024+jemalloc", 1024, ["jemalloc"])
    for bad in ("4+x", "4+trim+trim", "+thp", "big", "4+jemalloc+tcmalloc"):
        with pytest.raises(ValueError):
            bench._setting(bad)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--model", str(tmp_path), "--kept", "1024,4+x"])
    assert stop.value.code == 2 and "--kept 1024,4+x" in capsys.readouterr().err


def test_heap_trace_refuses_a_run_on_another_malloc_than_named(tmp_path, capsys, monkeypatch):
    """A malloc not installed is refused before any run; one the loader then does not map (it leaves
    glibc's with only a warning) stops the bench with nothing written, rather than glibc's figures reported
    as the other allocator's. Each setting names its malloc to the probe's config too (glibc's by default,
    whatever the recipe's `malloc`)."""
    from everyprompt.devices import malloc

    bench = _load("heap_trace")
    model = _saved_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    monkeypatch.setattr(malloc, "installed", lambda name: name == "glibc")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--model", str(model), "--kept", "1024+tcmalloc", "--out", str(out)])
    assert stop.value.code == 2 and "apt-get install libtcmalloc-minimal4" in capsys.readouterr().err
    seen = []

    def probe_on_glibc(script, flag, arguments, env=None):
        seen.append((env.get("LD_PRELOAD"), env.get("THP_MEM_ALLOC_ENABLE"), arguments[1][-1]))
        return {"allocator": bench.running_malloc(), "phases": {}, "peak_phase": None}

    monkeypatch.setattr(malloc, "installed", lambda name: True)
    monkeypatch.setattr(bench, "run_probe", probe_on_glibc)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert bench.main(["--model", str(model), "--kept", "1024+thp+tcmalloc", "--out", str(out)]) == 1
    assert seen == [("libtcmalloc_minimal.so.4", "1", "malloc=tcmalloc")] and not out.exists()
    assert "ran on glibc's malloc, not tcmalloc's" in capsys.readouterr().out


@pytest.mark.slow  # ~20 s: a process of two RL steps
@pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None, reason="libjemalloc is not installed")
def test_heap_trace_runs_on_the_preloaded_malloc(tmp_path, monkeypatch):
    bench = _load("heap_trace")
    model = _saved_tiny_model(tmp_path / "tiny")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text("sft:\n  steps: 0\nrollout:\n  max_new_tokens: 8\nrl:\n  prompts_per_step: 2\n")
    argv = ["--model", str(model), "--config", str(recipe), "--kept", "1024+jemalloc", "--steps", "2"]
    assert bench.main([*argv, "--out", str(tmp_path / "out")]) == 0
    row = json.loads((tmp_path / "out" / "heap_trace_tiny.json").read_text())["settings"]["1024+jemalloc"]
    assert row["allocator"] == "jemalloc" and row["peak_rss_bytes"] > 0
    # glibc's counts of its own heap are not reported as jemalloc's
    assert all(phase["max_in_use_gib"] is None for phase in row["phases"].values())


def test_heap_trace_reads_each_phase_at_its_peak():
    """By hand: the phase's highest resident sample carries its in-use and free bytes; the in-use
    maximum is over all of the phase's samples; the seconds and page faults between two samples count to
    the first one's phase (samples appended out of time order by the two threads are put back in it)."""
    bench = _load("heap_trace")
    sampler = bench.Sampler()  # not started: the samples are given
    gib = 2**30
    # (phase, resident, in use, free, time in s, page faults so far)
    sampler.samples = [
        ("update", 5 * gib, 2 * gib, 3 * gib, 10.0, 100),
        ("micro_batch_1", 6 * gib, 4 * gib, 1 * gib, 10.5, 140),
        ("micro_batch_1", 7 * gib, 5 * gib, 1 * gib, 12.0, 400),
        ("micro_batch_1", 8 * gib, 2 * gib, 5 * gib, 11.0, 300),  # the sampling thread's, appended late
        ("rollout", 3 * gib, None, None, 12.25, 410),
    ]
    phases = sampler.by_phase()
    assert phases["micro_batch_1"] == {
        "peak_rss_gib": 8.0,
        "in_use_at_peak_gib": 2.0,
        "free_at_peak_gib": 5.0,
        "max_in_use_gib": 5.0,
        "seconds": pytest.approx(1.75),  # 10.5 -> 12.25
        "page_faults": 270,  # 140 -> 410
    }
    assert phases["update"]["seconds"] == pytest.approx(0.5) and phases["update"]["page_faults"] == 40
    assert phases["rollout"] == {  # the last sample: nothing after it to count
        "peak_rss_gib": 3.0,
        "in_use_at_peak_gib": None,
        "free_at_peak_gib": None,
        "max_in_use_gib": None,
        "seconds": 0.0,
        "page_faults": 0,
    }


def test_rl_growth_grid_table_and_plot(tmp_path):
    bench = _load("rl_growth")
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
    bench = _load("tools")
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
    bench = _load("tools")
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
    serve = _load("serve")

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
