"""(e) of bench/throughput: the decode step and the RL update against their GEMMs alone (bench/engine/floor.py), and
what compiling the decode step costs and when it pays."""

from __future__ import annotations

import math
import time
from pathlib import Path

from bench.common import best_of, run_probe
from bench.throughput.setup import fixed_batch, load_demo_model, native_engine


# ---------------------------------------------------------------- (e) the compute floor
def _step_ms(stats: dict) -> float:
    """An engine's decode step as its call measured it: the forward with its bookkeeping, plus sampling."""
    return stats["decode_step_ms"] + stats["sample_ms"]


def middle_step_gemms(engine, requests, new_tokens: int) -> list:
    """The GEMMs of an eager engine's middle decode step (bench/engine/floor.py), recorded during one generate
    call of `requests` decoding `new_tokens` each."""
    from bench.engine.floor import GemmRecorder
    from everyprompt.rollout import SamplingParams

    recorder, middle, seen = GemmRecorder(), max(new_tokens // 2, 1), [0]
    decode = engine.decode

    def recorded(*args, **kwargs):
        seen[0] += 1
        if seen[0] != middle:
            return decode(*args, **kwargs)
        with recorder:
            return decode(*args, **kwargs)

    engine.decode = recorded
    try:
        list(engine.generate(requests, SamplingParams(new_tokens)))
    finally:
        del engine.decode
    return recorder.calls


def decode_floor(model, tokenizer, prompts: list[str], batch: int, new_tokens: int, engine_vs: dict) -> dict:
    """The decode step's GEMMs alone (recorded at the middle decode step of an eager call of (a)'s
    workload, each with operands of its own), against the eager and the compiled engine's step in (a)."""
    from bench.engine.floor import replay_seconds

    _, requests = fixed_batch(tokenizer, prompts, batch)
    calls = middle_step_gemms(native_engine(model, tokenizer, batch, eos=False), requests, new_tokens)
    floor_ms = 1000 * replay_seconds(calls)
    eager_ms = _step_ms(engine_vs["engine_stats"])
    compiled_ms = _step_ms(engine_vs["compiled_stats"])
    flops = sum(call.flops() for call in calls)
    return {
        "gemms_per_step": len(calls),
        "gemm_gflop_per_step": flops / 1e9,
        "floor_ms": floor_ms,
        "floor_gflops_per_s": flops / 1e9 / (floor_ms / 1000),
        "eager_step_ms": eager_ms,
        "compiled_step_ms": compiled_ms,
        "eager_vs_floor": eager_ms / floor_ms,
        "compiled_vs_floor": compiled_ms / floor_ms,
        "compiled_forward_ms": engine_vs["compiled_stats"]["decode_step_ms"],
        "compiled_sample_ms": engine_vs["compiled_stats"]["sample_ms"],
        "eager_forward_ms": engine_vs["engine_stats"]["decode_step_ms"],
        "eager_sample_ms": engine_vs["engine_stats"]["sample_ms"],
    }


def compile_probe(base: list[str], batch: int, new_tokens: int) -> dict:
    """One compiled engine's first and second generate calls on (a)'s workload, in this process (run
    with a fresh TORCHINDUCTOR_CACHE_DIR for a cold compile, again with the same one for a warm one)."""
    from everyprompt.rollout import SamplingParams

    model, tokenizer, prompts = load_demo_model(base)
    _, requests = fixed_batch(tokenizer, prompts, batch)
    engine = native_engine(model, tokenizer, batch, eos=False, compile="on")
    params = SamplingParams(new_tokens)
    first, _ = best_of(1, lambda: list(engine.generate(requests, params)))
    second, _ = best_of(1, lambda: list(engine.generate(requests, params)))
    return {"first_call_s": first, "second_call_s": second, "compile_s": engine.compiler.compile_s}


def compile_cost(base: list[str], batch: int, new_tokens: int, floor: dict, cold: bool = True) -> dict:
    """Compile time from a cold and a warm inductor cache (each its own process), and the run length
    at which compiling pays: compile_s over the saving per decode step. Without `cold` (the --tiny
    smoke run) only the warm probe runs, on this process's own cache (filled by (a))."""
    import os
    import tempfile

    out = {}
    script = Path(__file__).with_name("__main__.py")  # its hidden --compile-probe runs compile_probe
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache} if cold else dict(os.environ)
        for name in ("cold", "warm") if cold else ("warm",):
            out[name] = run_probe(script, "--compile-probe", [base, batch, new_tokens], env)
    saving_ms = floor["eager_step_ms"] - floor["compiled_step_ms"]
    for name in ("cold", "warm"):
        probe = out.setdefault(name, {"compile_s": math.nan})
        steps = probe["compile_s"] * 1000 / saving_ms if saving_ms > 0 else float("inf")
        probe["payoff_decode_steps"] = steps
        probe["payoff_eager_decode_s"] = steps * floor["eager_step_ms"] / 1000
    out["saving_ms_per_step"] = saving_ms
    return out


def training_floor(rl_base: list[str], run_dir: Path, updates: int = 3) -> dict:
    """One RL update of (d)'s set-up (synchronous, so a batch can be taken and trained by hand) against
    the GEMMs it dispatches (forwards and backward), replayed alone with operands shared by shape."""
    from bench.engine.floor import GemmRecorder, replay_seconds
    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    config = load_config(None, [*rl_base, "rl.steps=1", "checkpoint.every=0", "rl.max_staleness=0"])
    trainer = Run(config, run_dir).trainer()
    try:
        batches = [trainer.rollout.next_batch(step) for step in range(updates + 1)]
        times = []
        for batch in batches[:-1]:
            began = time.perf_counter()
            trainer.learner.update(batch)
            times.append(time.perf_counter() - began)
        recorder = GemmRecorder()
        with recorder:
            trainer.learner.update(batches[-1])
    finally:
        trainer.close()
    update_s = min(times[1:]) if len(times) > 1 else times[0]  # the first warms up
    floor_s = replay_seconds(recorder.calls, distinct=False, repeats=3, loops=2)
    flops = sum(call.flops() for call in recorder.calls)
    last = batches[-1]
    return {
        "update_s": update_s,
        "update_s_all": times,
        "gemms": len(recorder.calls),
        "gemm_gflop": flops / 1e9,
        "floor_s": floor_s,
        "floor_gflops_per_s": flops / 1e9 / floor_s,
        "update_vs_floor": update_s / floor_s,
        "sequences": len(last),
        "tokens": sum(len(p) + len(c) for p, c in zip(last.prompt_ids, last.completion_ids)),
    }
