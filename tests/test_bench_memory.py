"""The memory benches: bench/learner/memory.py's probe and bench/learner/heap_trace.py (where a step's host memory goes,
under which malloc)."""

import ctypes.util
import json

import pytest

from tests.test_bench import ROOT, _load, _saved_tiny_model


def test_memory_bench_probe_measures_a_pass(tmp_path):
    bench = _load("learner.memory")
    model = str(_saved_tiny_model(tmp_path / "tiny"))
    for grad in (False, True):
        for chunk in (0, 8):
            row = bench.probe(model, 4, 32, 16, chunk, grad, "fp32")
            assert row["peak_bytes"] >= 0 and row["seconds"] > 0 and row["grad"] is grad
    with pytest.raises(SystemExit):
        bench.main(["--model", str(tmp_path / "nowhere")])


@pytest.mark.slow  # ~40 s: two settings, each a process of two RL steps
def test_heap_trace_bench_smoke(tmp_path, capsys, monkeypatch):
    bench = _load("learner.heap_trace")
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
    bench = _load("learner.heap_trace")
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

    bench = _load("learner.heap_trace")
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
    bench = _load("learner.heap_trace")
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
    bench = _load("learner.heap_trace")
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
