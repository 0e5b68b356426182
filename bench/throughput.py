"""Rollout throughput: engine speed, reward overlap, length-aware scheduling, and an RL step against TRL.

Each comparison runs in one process on the same model, prompts and sampling settings:
  (a) the native and hf engines' tokens/s against transformers' `generate`: the same batch decoding the
      same number of tokens per sequence (the kernels' speed), and a rollout workload (the long-tailed
      length mix of (c), each request cut at its own length; `generate` in batches of the engine's slot
      count, each batch running until its longest request is done, as static batching does);
  (b) rollout + a deliberately slow reward (a 20 ms call per completion, as a remote judge would take),
      scored after generation vs streamed into the RewardPool during it, against rollout alone;
  (c) a long-tailed length mix through a few slots, `fifo` vs `longest_first` admission: wall time and
      idle slot fraction (lengths predicted from a previous visit's history in the pass-rate store);
  (d) one RL step (rollout, rewards, update, weight sync) of everyprompt vs TRL's GRPOTrainer on the
      demo model after SFT, with the same group size, prompts per step, lr and completion cap.

    python bench/throughput.py           # ~10 minutes on 2 CPU cores (trains the SFT checkpoint if missing)
    python bench/throughput.py --tiny    # seconds: a smoke run on a 2-layer model (skips TRL unless --trl)

Writes bench/results/throughput.json; prints the summary table last.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from algorithms import TINY, prepare_sft  # noqa: E402
from everyprompt.rewards import register_reward  # noqa: E402

SLOW_REWARD_S = 0.02

# sizes per comparison: (--tiny smoke run, real run)
SCALES = {
    "batch": (8, 64),  # (a) sequences decoded together (also the slots of the rollout workload)
    "new_tokens": (8, 64),  # (a) tokens per sequence
    "repeats": (1, 2),  # (a), (c) timed calls, fastest kept
    "count": (16, 128),  # (b) completions
    "overlap_repeats": (1, 9),  # (b) interleaved alone / overlapped pairs
    "cap": (8, 64),  # (b) longest completion
    "slots": (4, 32),  # (c) engine slots
    "sched": (32, 256),  # (c) requests
    "short": ((2, 4), (8, 24)),  # (c) lengths of the short 90%
    "long": ((12, 16), (96, 160)),  # (c) lengths of the long 10%
}


@register_reward("bench_slow_judge")
def slow_judge(completions, **_):
    """Stands for a reward that waits on something (a judge model, a sandbox): 20 ms per completion."""
    time.sleep(SLOW_REWARD_S * len(completions))
    return [float(len(c) % 2) for c in completions]


def _model(overrides: list[str]):
    from everyprompt.config import load_config
    from everyprompt.models.io import load_model_and_tokenizer
    from everyprompt.pipeline import Run

    config = load_config(None, overrides)
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    run = Run(config, None)
    return model.eval(), tokenizer, [row["prompt"] for row in run.rows.rl()]


def _engine(model, tokenizer, slots: int, eos: bool = True, compile: str = "off"):
    from everyprompt.rollout.native import NativeEngine

    return NativeEngine(
        model.config,
        model.state_dict(),
        eos_token_id=tokenizer.eos_token_id if eos else -1,  # -1: never stop early
        pad_token_id=tokenizer.pad_token_id,
        batch_size=slots,
        compile=compile,
    )


def _hf_engine(model, tokenizer, slots: int):
    """The hf engine over a copy of `model`, never stopping early (no end-of-sequence ids)."""
    import copy

    from everyprompt.rollout.hf import HFEngine

    return HFEngine(copy.deepcopy(model), [], tokenizer.pad_token_id, slots)


def _fixed_batch(tokenizer, prompts: list[str], batch: int) -> tuple[list[str], list]:
    """(a)'s workload: `batch` prompts (cycled) and their requests, one seed each."""
    from everyprompt.rollout import GenerationRequest

    prompts = (prompts * batch)[:batch]
    return prompts, [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(prompts)]


def _best_of(repeats: int, fn) -> tuple[float, object]:
    """The fastest of `repeats` timed calls (the first also warms caches up), with its result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - started
        if elapsed < best:
            best, result = elapsed, out
    return best, result


# ---------------------------------------------------------------- (a) engine vs transformers
def _hf_sample(model, tokenizer, inputs, new_tokens: int):
    """transformers' `generate` sampling exactly `new_tokens` per row (temperature 1, no top-k), as the
    engine does."""
    import torch

    with torch.inference_mode():
        return model.generate(
            **inputs,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )


def engine_vs_hf(model, tokenizer, prompts: list[str], batch: int, new_tokens: int, repeats: int) -> dict:

    from everyprompt.rollout import SamplingParams

    prompts, requests = _fixed_batch(tokenizer, prompts, batch)
    engine = _engine(model, tokenizer, batch, eos=False)
    params = SamplingParams(new_tokens)
    native_s, completions = _best_of(repeats, lambda: list(engine.generate(requests, params)))
    native_tokens = sum(len(c.token_ids) for c in completions)
    compiled = _engine(model, tokenizer, batch, eos=False, compile="on")
    list(compiled.generate(requests, params))  # compiles (its cost: compile_cost())
    compiled_s, completions = _best_of(repeats, lambda: list(compiled.generate(requests, params)))
    assert sum(len(c.token_ids) for c in completions) == native_tokens
    hf_engine = _hf_engine(model, tokenizer, batch)
    hf_engine_s, completions = _best_of(repeats, lambda: list(hf_engine.generate(requests, params)))
    hf_engine_tokens = sum(len(c.token_ids) for c in completions)

    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    model.generation_config.eos_token_id = None  # both sides decode exactly `new_tokens` per sequence

    def hf():
        return _hf_sample(model, tokenizer, encoded, new_tokens)

    hf_s, output = _best_of(repeats, hf)
    hf_tokens = (output.shape[1] - encoded["input_ids"].shape[1]) * batch
    profiles = {
        "native": _profile(lambda: list(engine.generate(requests, params))),
        "native_compiled": _profile(lambda: list(compiled.generate(requests, params))),
        "hf": _profile(hf),
    }
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "native_tokens": native_tokens,
        "native_s": native_s,
        "native_tokens_per_s": native_tokens / native_s,
        "hf_tokens": hf_tokens,
        "hf_s": hf_s,
        "hf_tokens_per_s": hf_tokens / hf_s,
        "speedup": (native_tokens / native_s) / (hf_tokens / hf_s),
        "compiled_s": compiled_s,
        "compiled_tokens_per_s": native_tokens / compiled_s,
        "compiled_speedup": (native_tokens / compiled_s) / (hf_tokens / hf_s),
        "compiled_stats": compiled.stats,
        "hf_engine_tokens": hf_engine_tokens,
        "hf_engine_s": hf_engine_s,
        "hf_engine_tokens_per_s": hf_engine_tokens / hf_engine_s,
        "hf_engine_vs_generate": (hf_engine_tokens / hf_engine_s) / (hf_tokens / hf_s),
        "engine_stats": engine.stats,
        "profile": profiles,
    }


def engine_vs_hf_rollout(
    model, tokenizer, prompts: list[str], slots: int, count: int, short: tuple, long: tuple, repeats: int
) -> dict:
    """Useful tokens/s on a rollout's long-tailed lengths: the engine (continuous batching, `slots` rows,
    longest-predicted first, its default) against `generate` in batches of `slots` requests in arrival
    order, each batch decoding until its longest request has its tokens (rows that are done keep being
    computed, as they are when an EOS ends them early). Only each request's own tokens count."""

    from everyprompt.rollout import SamplingParams
    from everyprompt.rollout.scheduler import admission_order

    texts, lengths, predicted, requests = _long_tailed(tokenizer, prompts, count, short, long, 0.1)
    engine = _engine(model, tokenizer, slots, eos=False)
    params = SamplingParams(long[1])
    order = admission_order(predicted, "longest_first")
    native_s, completions = _best_of(
        repeats, lambda: list(engine.generate([requests[i] for i in order], params))
    )
    assert sorted(len(c.token_ids) for c in completions) == sorted(lengths)
    hf_engine = _hf_engine(model, tokenizer, slots)
    hf_engine_s, completions = _best_of(
        repeats, lambda: list(hf_engine.generate([requests[i] for i in order], params))
    )
    assert sorted(len(c.token_ids) for c in completions) == sorted(lengths)

    tokenizer.padding_side = "left"
    model.generation_config.eos_token_id = None
    batches = [range(start, min(start + slots, count)) for start in range(0, count, slots)]
    encoded = [tokenizer([texts[i] for i in batch], return_tensors="pt", padding=True) for batch in batches]

    def hf():
        for batch, inputs in zip(batches, encoded):
            _hf_sample(model, tokenizer, inputs, max(lengths[i] for i in batch))

    hf_s, _ = _best_of(repeats, hf)
    tokens = sum(lengths)
    hf_computed = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)
    return {
        "requests": count,
        "slots": slots,
        "tokens": tokens,
        "native_s": native_s,
        "native_tokens_per_s": tokens / native_s,
        "native_slot_occupancy": engine.stats["slot_occupancy"],
        "hf_s": hf_s,
        "hf_tokens_per_s": tokens / hf_s,
        "hf_useful_share": tokens / hf_computed,
        "speedup": hf_s / native_s,
        "hf_engine_s": hf_engine_s,
        "hf_engine_tokens_per_s": tokens / hf_engine_s,
        "hf_engine_slot_occupancy": hf_engine.stats["slot_occupancy"],
        "hf_engine_vs_generate": hf_s / hf_engine_s,
    }


COMPUTE_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu")


def _short(op: str) -> str:
    return op.removeprefix("aten::").replace("_scaled_dot_product_flash_attention_for_cpu", "sdpa")


def _profile(fn) -> dict:
    """Where one call's CPU time goes: the share in matmul / attention kernels, the operator calls, and
    the top operators by self time (both engines decode the same tokens, so this explains the ratio)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    compute = sum(e.self_cpu_time_total for e in events if e.key in COMPUTE_OPS)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
    return {
        "self_cpu_s": total / 1e6,
        "compute_kernel_share": compute / total if total else 0.0,
        "operator_calls": sum(e.count for e in events),
        "top": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in top],
    }


# ---------------------------------------------------------------- (e) the compute floor
def _step_ms(stats: dict) -> float:
    """An engine's decode step as its call measured it: the forward with its bookkeeping, plus sampling."""
    return stats["decode_step_ms"] + stats["sample_ms"]


def decode_floor(model, tokenizer, prompts: list[str], batch: int, new_tokens: int, engine_vs: dict) -> dict:
    """The decode step's GEMMs alone (recorded at the middle decode step of an eager call of (a)'s
    workload, each with operands of its own), against the eager and the compiled engine's step in (a)."""
    from floor import GemmRecorder, replay_seconds

    from everyprompt.rollout import SamplingParams

    _, requests = _fixed_batch(tokenizer, prompts, batch)
    engine = _engine(model, tokenizer, batch, eos=False)
    recorder, middle, seen = GemmRecorder(), new_tokens // 2, [0]
    decode = engine._decode

    def recorded(*args, **kwargs):
        seen[0] += 1
        if seen[0] != middle:
            return decode(*args, **kwargs)
        with recorder:
            return decode(*args, **kwargs)

    engine._decode = recorded
    list(engine.generate(requests, SamplingParams(new_tokens)))
    floor_ms = 1000 * replay_seconds(recorder.calls)
    eager_ms = _step_ms(engine_vs["engine_stats"])
    compiled_ms = _step_ms(engine_vs["compiled_stats"])
    flops = sum(call.flops() for call in recorder.calls)
    return {
        "gemms_per_step": len(recorder.calls),
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

    model, tokenizer, prompts = _model(base)
    _, requests = _fixed_batch(tokenizer, prompts, batch)
    engine = _engine(model, tokenizer, batch, eos=False, compile="on")
    params = SamplingParams(new_tokens)
    first, _ = _best_of(1, lambda: list(engine.generate(requests, params)))
    second, _ = _best_of(1, lambda: list(engine.generate(requests, params)))
    return {"first_call_s": first, "second_call_s": second, "compile_s": engine.compiler.compile_s}


def compile_cost(base: list[str], batch: int, new_tokens: int, floor: dict, cold: bool = True) -> dict:
    """Compile time from a cold and a warm inductor cache (each its own process), and the run length
    at which compiling pays: compile_s over the saving per decode step. Without `cold` (the --tiny
    smoke run) only the warm probe runs, on this process's own cache (filled by (a))."""
    import os
    import subprocess
    import tempfile

    out = {}
    command = [sys.executable, __file__, "--compile-probe", json.dumps([base, batch, new_tokens])]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache} if cold else dict(os.environ)
        for name in ("cold", "warm") if cold else ("warm",):
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            out[name] = json.loads(done.stdout.strip().splitlines()[-1])
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
    from floor import GemmRecorder, replay_seconds

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


# ---------------------------------------------------------------- (b) reward overlap
def reward_overlap(
    model, tokenizer, prompts: list[str], count: int, cap: int, workers: list[int], repeats: int
) -> dict:
    from everyprompt.rewards.pool import RewardPool
    from everyprompt.rollout import GenerationRequest, SamplingParams

    rng = random.Random(0)
    requests = [
        GenerationRequest(
            i, tokenizer(prompts[i % len(prompts)]).input_ids, seed=i, max_new_tokens=rng.randint(4, cap)
        )
        for i in range(count)
    ]
    engine = _engine(model, tokenizer, count, eos=False)
    params = SamplingParams(cap)
    list(engine.generate(requests, params))  # warm-up

    def alone():
        return [tokenizer.decode(c.token_ids) for c in engine.generate(requests, params)]

    def after(pool):
        texts = [tokenizer.decode(c.token_ids) for c in engine.generate(requests, params)]
        for key, text in enumerate(texts):
            pool.submit(key, text, {})
        return pool.wait(list(range(len(texts))))

    def streamed(pool):
        for completion in engine.generate(requests, params):
            pool.submit(completion.request_id, tokenizer.decode(completion.token_ids), {})
        generated = time.perf_counter()
        rewards = pool.wait(list(range(len(requests))))
        return rewards, time.perf_counter() - generated

    with RewardPool("bench_slow_judge", workers=0) as inline:
        serial_s, _ = _best_of(1, lambda: after(inline))
    by_workers, alone_runs = {}, []
    for count_workers in workers:
        # rollout alone and overlapped, back to back, `repeats` times (see overlap_ratio below)
        with RewardPool("bench_slow_judge", workers=count_workers, timeout_s=30) as pool:
            pairs = [
                (_best_of(1, alone)[0], _best_of(1, lambda pool=pool: streamed(pool))) for _ in range(repeats)
            ]
        assert all(r is not None for _, (_, (rewards, _)) in pairs for r in rewards)
        alone_runs += [a for a, _ in pairs]
        by_workers[count_workers] = {
            "rollout_alone_s": statistics.median(a for a, _ in pairs),
            "rollout_with_overlapped_reward_s": statistics.median(o for _, (o, _) in pairs),
            # where the overlapped run's extra time goes: waiting on the last rewards after the engine
            # is done, and the engine itself running slower beside the pool (its dispatcher thread, IPC)
            "reward_wait_after_generation_s": statistics.median(w for _, (_, (_, w)) in pairs),
            "generation_slowdown_s": statistics.median(o - w - a for a, (o, (_, w)) in pairs),
            # the median of each pair's ratio: a pair runs back to back, so the machine's drift (as large
            # as the effect) cancels within it
            "overlap_ratio": statistics.median(o / a for a, (o, _) in pairs),
        }
    alone_s = statistics.median(alone_runs)
    # the headline: the fewest workers with half their scoring rate (workers / 20 ms) to spare over the
    # engine's rate of finishing completions. `needed` is the count that just keeps up on average; a
    # pool at full load queues (bursts of completions wait), so it is provisioned twice over, as a user
    # would. Every worker count's figures are in `by_workers`.
    needed = math.ceil(count / alone_s * SLOW_REWARD_S)
    best = min([w for w in workers if w >= 2 * needed] or [max(workers)])
    return {
        "workers_needed": needed,
        "completions": count,
        "reward_s_per_completion": SLOW_REWARD_S,
        "repeats": repeats,
        "rollout_then_reward_s": serial_s,
        "serial_ratio": serial_s / alone_s,
        "by_workers": by_workers,
        "reward_workers": best,
        **by_workers[best],
    }


# ---------------------------------------------------------------- (c) length-aware scheduling
def _long_tailed(tokenizer, prompts: list[str], count: int, short: tuple, long: tuple, long_share: float):
    """`count` distinct prompts, their completion lengths (a `long_share` of them drawn from `long`, the
    rest from `short`), the lengths the scheduler predicts for them from a previous visit's history in
    the pass-rate store (each within +-25% of its length now), and their generation requests (each cut
    at its length)."""
    from everyprompt.data.passrate import PassRateStore
    from everyprompt.rollout import GenerationRequest
    from everyprompt.rollout.scheduler import LengthPredictor

    rng = random.Random(1)
    texts = [f"{prompts[i % len(prompts)]} #{i}" for i in range(count)]
    lengths = [rng.randint(*long) if rng.random() < long_share else rng.randint(*short) for _ in texts]
    store = PassRateStore()
    store.record([(t, 1, 0, n * rng.uniform(0.75, 1.25)) for t, n in zip(texts, lengths)], step=0)
    predicted = [LengthPredictor(store, default=long[1]).predict(t) for t in texts]
    requests = [
        GenerationRequest(i, tokenizer(t).input_ids, seed=i, max_new_tokens=n)
        for i, (t, n) in enumerate(zip(texts, lengths))
    ]
    return texts, lengths, predicted, requests


def scheduling(
    model,
    tokenizer,
    prompts: list[str],
    count: int,
    slots: int,
    short: tuple,
    long: tuple,
    long_share: float,
    repeats: int,
) -> dict:
    from everyprompt.rollout import SamplingParams
    from everyprompt.rollout.scheduler import admission_order

    _, lengths, predicted, requests = _long_tailed(tokenizer, prompts, count, short, long, long_share)
    engine = _engine(model, tokenizer, slots, eos=False)
    params = SamplingParams(long[1])
    out = {
        "requests": count,
        "slots": slots,
        "tokens": sum(lengths),
        "lengths": {"short": short, "long": long, "long_share": long_share},
    }
    for policy in ("fifo", "longest_first"):
        order = admission_order(predicted, policy)

        def run(order=order):
            list(engine.generate([requests[i] for i in order], params))
            return dict(engine.stats)

        wall, stats = _best_of(repeats, run)
        out[policy] = {"wall_s": wall, "idle_slot_fraction": 1 - stats["slot_occupancy"], **stats}
    fifo, lpt = out["fifo"], out["longest_first"]
    out["wall_ratio"] = lpt["wall_s"] / fifo["wall_s"]
    out["idle_reduction"] = 1 - lpt["idle_slot_fraction"] / fifo["idle_slot_fraction"]
    return out


# ---------------------------------------------------------------- (d) RL step vs TRL
def everyprompt_steps(base: list[str], steps: int, run_dir: Path) -> dict:
    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    config = load_config(None, [*base, f"rl.steps={steps}", "checkpoint.every=0"])
    run = Run(config, run_dir)
    trainer = run.trainer()
    history = trainer.train()
    trainer.close()
    times = [m["time/step_s"] for m in history[1:]]  # the first step warms up
    return {
        "step_s": statistics.median(times),
        "step_s_all": [m["time/step_s"] for m in history],
        "rollout_s": statistics.median(m["time/rollout_s"] for m in history[1:]),
        "generate_s": statistics.median(m["time/generate_s"] for m in history[1:]),
        "train_s": statistics.median(m["time/train_s"] for m in history[1:]),
        "mean_length": statistics.mean(m["rollout/mean_length"] for m in history),
        "prompts_per_step": config.rl.prompts_per_step,
        "group_size": config.rl.group_size,
        "max_new_tokens": config.rollout.max_new_tokens,
        "mini_batches": config.rl.mini_batches,
    }


def trl_steps(base: list[str], steps: int, run_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from everyprompt.config import load_config
    from everyprompt.models.io import load_model_and_tokenizer
    from everyprompt.pipeline import Run
    from everyprompt.rewards import math_reward

    config = load_config(None, base)
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    rows = Run(config, None).rows.rl()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_):
        return [0.0 if r is None else r for r in math_reward(completions, answer=answer)]

    rl = config.rl
    completions_per_step = rl.prompts_per_step * rl.group_size
    args = GRPOConfig(
        output_dir=str(run_dir),
        per_device_train_batch_size=completions_per_step // rl.mini_batches,
        steps_per_generation=rl.mini_batches,  # one generation, `mini_batches` optimizer steps: as ours
        gradient_accumulation_steps=1,
        num_generations=rl.group_size,
        max_completion_length=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature,
        learning_rate=rl.lr,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        max_steps=steps * rl.mini_batches,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=config.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,  # TRL's default recomputes activations; everyprompt's trainer does not
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_end(self, *_args, **_kwargs):
            self.marks.append(time.perf_counter())

    clock = Clock()
    generate_s: list[float] = []
    generate = model.generate

    def timed_generate(*a, **k):  # TRL samples through the model's own generate: time it
        started = time.perf_counter()
        out = generate(*a, **k)
        generate_s.append(time.perf_counter() - started)
        return out

    model.generate = timed_generate
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the table
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    trainer.train()
    marks = [started, *clock.marks]
    # one everyprompt step = one generation + `mini_batches` optimizer steps = that many TRL steps
    per = rl.mini_batches
    cycles = [marks[i + per] - marks[i] for i in range(0, len(marks) - per, per)]
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    return {
        "step_s": statistics.median(cycles[1:] if len(cycles) > 1 else cycles),
        "step_s_all": cycles,
        "mean_length": statistics.mean(lengths) if lengths else float("nan"),
        "optimizer_steps_per_step": per,
        "generate_s": statistics.median(generate_s[1:] if len(generate_s) > 1 else generate_s)
        if generate_s
        else float("nan"),
        "generate_calls": len(generate_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--trl", action="store_true", help="with --tiny: run the TRL comparison too")
    parser.add_argument("--rl-steps", type=int, default=6, help="RL steps timed per trainer (first dropped)")
    parser.add_argument("--sft-seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--compile-probe", help=argparse.SUPPRESS)  # compile_cost()'s child process
    args = parser.parse_args(argv)
    if args.compile_probe:
        print(json.dumps(compile_probe(*json.loads(args.compile_probe))))
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    started = time.perf_counter()
    base = ["logging.progress=false", "logging.tensorboard=false", "eval.num_samples=1", "eval.pass_k=1"]
    base += TINY if args.tiny else []
    scale = {key: sizes[0 if args.tiny else 1] for key, sizes in SCALES.items()}
    model, tokenizer, prompts = _model(base)
    results: dict = {"benchmark": "throughput", "tiny": args.tiny}
    console.print("(a) engine vs transformers generate ...")
    results["engine_vs_hf"] = engine_vs_hf(
        model, tokenizer, prompts, scale["batch"], scale["new_tokens"], scale["repeats"]
    )
    results["engine_vs_hf_rollout"] = engine_vs_hf_rollout(
        model,
        tokenizer,
        prompts,
        scale["batch"],
        scale["sched"],
        scale["short"],
        scale["long"],
        scale["repeats"],
    )
    console.print("(e) the decode step's matmul floor; compile time (cold and warm cache) ...")
    results["decode_floor"] = decode_floor(
        model, tokenizer, prompts, scale["batch"], scale["new_tokens"], results["engine_vs_hf"]
    )
    results["compile"] = compile_cost(
        base, scale["batch"], scale["new_tokens"], results["decode_floor"], cold=not args.tiny
    )
    console.print("(b) rollout + slow reward, overlapped or not ...")
    results["reward_overlap"] = reward_overlap(
        model,
        tokenizer,
        prompts,
        scale["count"],
        scale["cap"],
        workers=[1, 2, 4, 8],
        repeats=scale["overlap_repeats"],
    )
    console.print("(c) long-tailed lengths: fifo vs longest_first ...")
    results["scheduling"] = scheduling(
        model,
        tokenizer,
        prompts,
        scale["sched"],
        scale["slots"],
        scale["short"],
        scale["long"],
        0.1,
        scale["repeats"],
    )
    if not args.tiny or args.trl:
        console.print("(d) RL step: everyprompt vs TRL GRPOTrainer ...")
        work = args.out / "throughput_runs"
        sft_dir = prepare_sft(
            [*base, f"seed={args.sft_seed}"], args.out / "zve_runs" / f"sft_seed{args.sft_seed}"
        )
        rl_base = [*base, f"model.path={sft_dir}", "sft.steps=0", f"seed={args.sft_seed}"]
        ours = everyprompt_steps(rl_base, args.rl_steps, work / "everyprompt")
        theirs = trl_steps(rl_base, args.rl_steps, work / "trl")
        console.print("(e) the RL update's matmul floor ...")
        results["training_floor"] = training_floor(rl_base, work / "floor")
        results["rl_step_vs_trl"] = {
            "everyprompt": ours,
            "trl": theirs,
            "ratio": ours["step_s"] / theirs["step_s"],
            # the floor of that ratio with the update as it is: everyprompt's train phase alone (the same
            # transformers forward / backward TRL runs) against TRL's whole step
            "train_only_ratio": ours["train_s"] / theirs["step_s"],
        }
    results["wall_seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(results, indent=1, default=str))

    a, b, c = results["engine_vs_hf"], results["reward_overlap"], results["scheduling"]
    table = Table(title="Rollout throughput (each row: one run, same model, prompts and sampling)")
    for column in ("comparison", "everyprompt", "reference", "ratio", "target"):
        table.add_column(column, justify="right")
    table.add_row(
        f"(a) tokens/s, batch {a['batch']} x {a['new_tokens']} tokens",
        f"{a['native_tokens_per_s']:.0f}",
        f"{a['hf_tokens_per_s']:.0f} (HF generate)",
        f"{a['speedup']:.1f}x",
        ">= 10x",
    )
    table.add_row(
        f"(a) hf engine tokens/s, batch {a['batch']} x {a['new_tokens']} tokens",
        f"{a['hf_engine_tokens_per_s']:.0f}",
        f"{a['hf_tokens_per_s']:.0f} (HF generate)",
        f"{a['hf_engine_vs_generate']:.2f}x",
        ">= 1x",
    )
    r = results["engine_vs_hf_rollout"]
    table.add_row(
        f"(a) hf engine tokens/s, rollout: {r['requests']} requests, {r['slots']} slots",
        f"{r['hf_engine_tokens_per_s']:.0f} ({r['hf_engine_slot_occupancy']:.0%} of slots busy)",
        f"{r['hf_tokens_per_s']:.0f} (HF generate)",
        f"{r['hf_engine_vs_generate']:.2f}x",
        ">= 1x",
    )
    table.add_row(
        f"(a) tokens/s, rollout: {r['requests']} requests, long-tailed lengths, {r['slots']} slots",
        f"{r['native_tokens_per_s']:.0f} ({r['native_slot_occupancy']:.0%} of slots busy)",
        f"{r['hf_tokens_per_s']:.0f} (HF generate, {r['hf_useful_share']:.0%} of rows useful)",
        f"{r['speedup']:.1f}x",
        ">= 10x",
    )
    table.add_row(
        f"(b) rollout + 20 ms reward, s ({b['reward_workers']} workers, {b['workers_needed']} needed)",
        f"{b['rollout_with_overlapped_reward_s']:.2f} overlapped",
        f"{b['rollout_alone_s']:.2f} alone; {b['rollout_then_reward_s']:.2f} serial; extra: "
        f"{b['reward_wait_after_generation_s']:.2f} waiting after generation, "
        f"{b['generation_slowdown_s']:.2f} generation slowed",
        f"{b['overlap_ratio']:.2f}x (serial {b['serial_ratio']:.2f}x; by workers "
        + ", ".join(f"{w}: {v['overlap_ratio']:.2f}x" for w, v in b["by_workers"].items())
        + ")",
        "<= 1.10x",
    )
    table.add_row(
        f"(c) idle slot fraction, {c['requests']} requests / {c['slots']} slots",
        f"{c['longest_first']['idle_slot_fraction']:.1%} longest_first",
        f"{c['fifo']['idle_slot_fraction']:.1%} fifo",
        f"-{c['idle_reduction']:.0%} idle; wall {c['wall_ratio']:.2f}x",
        ">= 25% less idle",
    )
    if "rl_step_vs_trl" in results:
        d = results["rl_step_vs_trl"]
        table.add_row(
            f"(d) RL step, s ({d['everyprompt']['prompts_per_step']} x {d['everyprompt']['group_size']}, "
            f"cap {d['everyprompt']['max_new_tokens']})",
            f"{d['everyprompt']['step_s']:.2f} (rollout {d['everyprompt']['rollout_s']:.2f} of which "
            f"generate {d['everyprompt']['generate_s']:.2f}; train {d['everyprompt']['train_s']:.2f})",
            f"{d['trl']['step_s']:.2f} (TRL GRPOTrainer; generate {d['trl']['generate_s']:.2f})",
            f"{d['ratio']:.2f}x (train phase alone: {d['train_only_ratio']:.2f}x)",
            "<= 0.33x",
        )
    e, k = results["decode_floor"], results["compile"]
    table.add_row(
        f"(e) decode step, ms ({a['batch']} rows; {e['gemms_per_step']} GEMMs, {e['gemm_gflop_per_step']:.3f} GFLOP)",
        f"{e['compiled_step_ms']:.2f} compiled; {e['eager_step_ms']:.2f} eager",
        f"{e['floor_ms']:.2f} (its GEMMs alone, {e['floor_gflops_per_s']:.0f} GFLOP/s)",
        f"{e['compiled_vs_floor']:.2f}x compiled; {e['eager_vs_floor']:.2f}x eager",
        "<= 2x",
    )
    table.add_row(
        "(a) compiled engine tokens/s, same workload",
        f"{a['compiled_tokens_per_s']:.0f}",
        f"{a['hf_tokens_per_s']:.0f} (HF generate)",
        f"{a['compiled_speedup']:.1f}x",
        ">= 5x",
    )
    table.add_row(
        "(e) compile, s (cold cache / warm cache)",
        f"{k['cold']['compile_s']:.1f} / {k['warm']['compile_s']:.1f}",
        f"saves {k['saving_ms_per_step']:.2f} ms per decode step",
        f"pays after {k['cold']['payoff_decode_steps']:.0f} / {k['warm']['payoff_decode_steps']:.0f} steps "
        f"({k['cold']['payoff_eager_decode_s']:.0f} / {k['warm']['payoff_eager_decode_s']:.0f} s eager)",
        "stated",
    )
    if "training_floor" in results:
        f = results["training_floor"]
        table.add_row(
            f"(e) RL update, s ({f['sequences']} sequences, {f['tokens']} tokens; {f['gemms']} GEMMs)",
            f"{f['update_s']:.3f}",
            f"{f['floor_s']:.3f} (its GEMMs alone, {f['floor_gflops_per_s']:.0f} GFLOP/s)",
            f"{f['update_vs_floor']:.2f}x",
            "measured",
        )
    profile = Table(title="(a) where the time goes: one generate call of each engine (torch profiler)")
    for column in (
        "engine",
        "self CPU s",
        "in matmul / attention kernels",
        "operator calls",
        "top operators",
    ):
        profile.add_column(column, justify="right")
    for name, prof in (
        ("everyprompt", a["profile"]["native"]),
        ("everyprompt compiled", a["profile"]["native_compiled"]),
        ("HF generate", a["profile"]["hf"]),
    ):
        profile.add_row(
            name,
            f"{prof['self_cpu_s']:.2f}",
            f"{prof['compute_kernel_share']:.0%}",
            str(prof["operator_calls"]),
            ", ".join(f"{_short(t['op'])} {t['self_s']:.2f}s" for t in prof["top"][:4]),
        )
    console.print(f"wrote {args.out / 'throughput.json'}")
    console.print(profile)
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
