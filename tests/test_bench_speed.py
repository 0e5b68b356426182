"""The speed benches: bench/throughput (the engine against generate, a real model, the compiled step) and
bench/learner/rl_step.py (an RL step against TRL), and the README speed table they give."""

import importlib.util
import json
import math

import pytest
import torch

from tests.test_bench import ROOT, _load, _saved_tiny_model


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


def test_throughput_bench_takes_the_decode_batches_asked_for(tmp_path, capsys):
    bench = _load("throughput")
    model = _saved_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    argv = ["--model", str(model), "--quick", "--decode-only", "--batches", "3,2", "--out", str(out)]
    assert bench.main(argv) == 0
    payload = json.loads((out / "throughput_tiny.json").read_text())
    assert [row["batch"] for row in payload["decode"]] == [2, 3]
    for bad in ("0,4", "a,b", ""):
        with pytest.raises(SystemExit) as stop:
            bench.main(["--model", str(model), "--batches", bad])
        assert stop.value.code == 2
    with pytest.raises(SystemExit):  # a model's option: without --model it is refused
        bench.main(["--batches", "1,2"])
    assert "--batches" in capsys.readouterr().err


@pytest.mark.slow  # a compile of the decode step (~1 min)
def test_throughput_bench_measures_the_compiled_step(tmp_path):
    import torch._dynamo

    # the first call compiles only if nothing in this process compiled the same step before (a fresh
    # clone's `make test-slow` ran tests/rollout/test_compiled.py first and read a first call of 0 s)
    torch._dynamo.reset()
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


def test_the_readme_speed_table_is_the_one_the_results_give():
    """The README's speed table is generated (bench/learner/speed_table.py); it must match the committed results."""
    bench = _load("learner.speed_table")
    results = bench.model_results()
    assert results, "no model benchmark results in bench/results"
    readme = (ROOT / "README.md").read_text()
    expected = bench.readme_section(results, bench.rl_step_results())
    assert bench.section(readme) == expected, "run `python -m bench.learner.speed_table`"
    # the README's table is one machine's: the CPU's; the GPU's results are kept apart (docs/gpu.md)
    assert {r["device"] for r in results} == {"cpu"}
    gpu = bench.model_results(device="cuda")  # the H100's eager run, the H200's with graphs (dense, MoE)
    assert [r["device"] for r in gpu] == ["cuda:0"] * 3
    assert sorted(bool(r.get("graphs")) for r in gpu) == [False, True, True]
    assert {r["everyprompt"].get("device", "cpu") for r in bench.rl_step_results()} == {"cpu"}
    assert [r["everyprompt"]["device"] for r in bench.rl_step_results(device="cuda")] == ["cuda:0"]  # H200


def test_rl_step_decodes_in_trls_arithmetic_and_the_table_keeps_that_comparison(tmp_path):
    from everyprompt.config import load_config

    bench = _load("learner.rl_step")
    recipe = ROOT / "configs" / "smollm2.yaml"  # trained in bf16: TRL's generate runs under its autocast
    matched = bench.matched_precision(recipe, [])
    assert matched == ["rollout.precision=bf16", "rl.old_logprobs=recompute"]
    config = load_config(recipe, matched)  # a set-up the config accepts
    assert config.rollout.precision == "bf16" and config.rl.mini_batches == 1  # no extra old-policy pass
    assert bench.matched_precision(recipe, ["model.dtype=fp32"]) == []
    table = _load("learner.speed_table")
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
    bench = _load("learner.rl_step")
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
    assert len(ours["train_s_all"]) == len(ours["rollout_s_all"]) == len(ours["step_s_all"]) == 2
    if "trl" in payload:
        assert payload["trl"]["generate_under_autocast"] is True
        assert payload["step_ratio"] == pytest.approx(ours["step_s"] / payload["trl"]["step_s"])
    assert "wrote" in capsys.readouterr().out


def test_a_device_timeline_merges_overlapping_kernels_and_counts_the_gaps_by_size():
    from bench.throughput.timeline import busy_and_gaps

    # 0-20 (two overlapping kernels), 30-40 (a 10 us gap), 1040-1050 (a 1000 us gap), one inside the last
    busy, gaps, idle = busy_and_gaps([(0, 10), (5, 20), (30, 40), (1040, 1050), (1041, 1045)])
    assert busy == 20 + 10 + 10 and idle == 10 + 1000
    assert gaps == {"<100us": 1, "longer": 1}
    assert busy_and_gaps([]) == (0.0, {}, 0.0)


def test_the_devices_idle_time_goes_to_the_hosts_phase_at_the_time():
    from bench.throughput.timeline import idle_by_phase, idle_intervals

    gaps = idle_intervals([(0, 10), (5, 20), (30, 40), (100, 110)])
    assert gaps == [(20, 30), (40, 100)]
    # the host sampled 15-35 (reading the tokens back), then fed the next step 50-60; 40-50 and 60-100 unmarked
    phases = [("sample", 15, 35), ("forward", 50, 60)]
    assert idle_by_phase(gaps, phases) == {"sample": 10, "forward": 10, "unmarked": 50}


def test_a_timeline_without_cuda_says_why_it_has_no_device_figures():
    import torch
    from bench.throughput.timeline import describe_timeline, timeline
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    row = timeline(prof, 0.5, torch.device("cpu"))
    assert row["device_busy_s"] is None and "no CUDA device" in row["why"] and row["host_syncs"] == 0
    assert "no CUDA device" in describe_timeline(row) and row["host_by_phase"] == {}


def test_a_profiled_rollout_names_the_engines_phases_and_an_unprofiled_one_marks_nothing(tiny_model):
    """The native engine marks its prefill, sample and forward for the profiler (devices/phases.py), and
    outside a profile its phases are no-ops (no range recorded, no operator)."""
    import contextlib

    import torch
    from bench.throughput.timeline import timeline
    from torch.profiler import ProfilerActivity, profile

    from everyprompt.devices.phases import phase
    from everyprompt.rollout import GenerationRequest, SamplingParams
    from everyprompt.rollout.native import NativeEngine

    assert isinstance(phase("sample"), contextlib.nullcontext)
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer, batch_size=4)
    work = [GenerationRequest(i, tokenizer("1+2=").input_ids, seed=i) for i in range(3)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        list(engine.generate(work, SamplingParams(6)))
    row = timeline(prof, 1.0, torch.device("cpu"))
    assert set(row["host_by_phase"]) == {"prefill", "sample", "forward", "read"}, row
    assert all(seconds > 0 for seconds in row["host_by_phase"].values())


def test_the_graphs_row_times_the_static_step_reading_first_where_it_overlaps(monkeypatch):
    """On a CUDA device (here the fake one) the static step sends each forward before reading the step's
    tokens; its row also times the same engine reading first, the loop before, and says which was faster."""
    from bench.throughput import steps, work
    from bench.throughput.work import requests

    from everyprompt.devices.fake_cuda import fake_cuda
    from tests.conftest import make_tiny_model

    model, tokenizer = make_tiny_model()
    monkeypatch.setattr(work, "synchronize", lambda device: None)  # no CUDA to wait for
    plain = {"generate_s": 1.0, "step_ms": 1.0, "floor_ms": 1.0, "captured_floor_ms": 1.0}
    work_items = requests([tokenizer("1+2=").input_ids, tokenizer("30+4=").input_ids], 2)
    with fake_cuda():
        row = steps.graphs_at(model, tokenizer, work_items, 6, 2, "fp32", torch.device("cuda:0"), plain)
    assert row["graphs_overlapped"] == 1.0
    assert row["graphs_step_ms_read_first"] > 0 and row["overlap_speedup"] > 0
    cpu = steps.graphs_at(model, tokenizer, work_items, 6, 2, "fp32", torch.device("cpu"), plain)
    assert cpu["graphs_overlapped"] == 0.0 and "overlap_speedup" not in cpu  # nothing to compare with
