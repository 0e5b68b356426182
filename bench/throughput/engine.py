"""(a) of bench/throughput: the native and hf engines against transformers' `generate`, on a fixed batch
and on a rollout's long-tailed lengths, and where each one's time goes (torch profiler)."""

from __future__ import annotations

from bench.common import best_of
from bench.throughput.setup import fixed_batch, hf_sample, long_tailed, native_engine
from bench.throughput.setup import hf_engine as build_hf_engine


# ---------------------------------------------------------------- (a) engine vs transformers
def engine_vs_hf(model, tokenizer, prompts: list[str], batch: int, new_tokens: int, repeats: int) -> dict:

    from everyprompt.rollout import SamplingParams

    prompts, requests = fixed_batch(tokenizer, prompts, batch)
    engine = native_engine(model, tokenizer, batch, eos=False)
    params = SamplingParams(new_tokens)
    native_s, completions = best_of(repeats, lambda: list(engine.generate(requests, params)))
    native_tokens = sum(len(c.token_ids) for c in completions)
    compiled = native_engine(model, tokenizer, batch, eos=False, compile="on")
    list(compiled.generate(requests, params))  # compiles (its cost: compile_cost())
    compiled_s, completions = best_of(repeats, lambda: list(compiled.generate(requests, params)))
    assert sum(len(c.token_ids) for c in completions) == native_tokens
    hf_engine = build_hf_engine(model, tokenizer, batch)
    hf_engine_s, completions = best_of(repeats, lambda: list(hf_engine.generate(requests, params)))
    hf_engine_tokens = sum(len(c.token_ids) for c in completions)

    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    model.generation_config.eos_token_id = None  # both sides decode exactly `new_tokens` per sequence

    def hf():
        return hf_sample(model, tokenizer, encoded, new_tokens)

    hf_s, output = best_of(repeats, hf)
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

    texts, lengths, predicted, requests = long_tailed(tokenizer, prompts, count, short, long, 0.1)
    engine = native_engine(model, tokenizer, slots, eos=False)
    params = SamplingParams(long[1])
    order = admission_order(predicted, "longest_first")
    native_s, completions = best_of(
        repeats, lambda: list(engine.generate([requests[i] for i in order], params))
    )
    assert sorted(len(c.token_ids) for c in completions) == sorted(lengths)
    hf_engine = build_hf_engine(model, tokenizer, slots)
    hf_engine_s, completions = best_of(
        repeats, lambda: list(hf_engine.generate([requests[i] for i in order], params))
    )
    assert sorted(len(c.token_ids) for c in completions) == sorted(lengths)

    tokenizer.padding_side = "left"
    model.generation_config.eos_token_id = None
    batches = [range(start, min(start + slots, count)) for start in range(0, count, slots)]
    encoded = [tokenizer([texts[i] for i in batch], return_tensors="pt", padding=True) for batch in batches]

    def hf():
        for batch, inputs in zip(batches, encoded):
            hf_sample(model, tokenizer, inputs, max(lengths[i] for i in batch))

    hf_s, _ = best_of(repeats, hf)
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


def short_op(op: str) -> str:
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
