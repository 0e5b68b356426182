"""`bench/throughput --model PATH`: the native engine on a real model (a checkpoint directory or a
`.gguf` file) against transformers' `generate` on the same device, dtype and prompts, in one process.

  decode      tokens/s at several batch sizes, both sides decoding exactly `new_tokens` a sequence;
  floor       the decode step against its own matrix products replayed alone (bench/engine/floor.py), and at
              batch 1 against the memory-bandwidth bound (every weight read once a step);
  long_tail   a rollout's long-tailed lengths: the engine's continuous batching against `generate` in
              static batches of the same size, each run until its longest request is done;
  prefill     tokens/s of the engine's prefill for prompts of several lengths, against one forward of
              the model over the same prompts.

Prompts are the chat-formatted questions of configs/smollm2.yaml (the prefill lengths are reached by
repeating a prompt's tokens). `--quick` shrinks every size for a smoke run on a tiny model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.common import ROOT
from bench.throughput.floor import middle_step_gemms
from bench.throughput.kernels import describe_kernels, step_kernels
from bench.throughput.setup import draw_lengths, hf_sample
from bench.throughput.steps import compiled_at, graphs_agree, graphs_at
from bench.throughput.work import engine, equal_work, left_padded, requests, timed

SIZES = {  # (--quick, full)
    "batches": ((1, 4), (1, 8, 32, 64)),
    "new_tokens": (8, 64),
    "prefill_lengths": ((16, 32), (64, 256, 1024)),
    "prefill_batch": (2, 8),
    "long_tail_requests": (12, 128),
    "long_tail_slots": (4, 32),
    "short": ((2, 4), (8, 24)),
    "long": ((8, 12), (96, 160)),
    "repeats": (1, 2),
    "agree": ((6, 8), (64, 64)),  # (prompts, new tokens) of the static step's greedy agreement check
}


def sizes(quick: bool) -> dict:
    return {key: value[0 if quick else 1] for key, value in SIZES.items()}


def load(path: Path, device: torch.device, dtype: str):
    """The model (eval mode, on `device`, in `dtype`), its tokenizer and the recipe's chat prompts' ids."""
    from everyprompt.config import load_config
    from everyprompt.data.formatting import prompt_format_of
    from everyprompt.data.rows import ConfigRows
    from everyprompt.models.io import load_model_and_tokenizer

    config = load_config(ROOT / "configs" / "smollm2.yaml", [f"model.path={path}", "data.num_train=64"])
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    model = model.to(device, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
    model.generation_config.eos_token_id = None  # both sides decode exactly the tokens asked for
    form = prompt_format_of(config, tokenizer)
    prompts = [form.prompt_ids(row) for row in ConfigRows(config).rl()]
    return model, tokenizer, prompts


def decode(
    model,
    tokenizer,
    prompts,
    batches,
    new_tokens,
    repeats,
    dtype,
    device,
    compile=False,
    graphs=False,
    fused=False,
):
    """Tokens/s at each batch size, the engine against `generate`, equal work; the engine's step
    against its GEMMs alone; with `compile`, the compiled decode step's too; with `graphs`, the static
    step's (CUDA graphs on a CUDA device); with `fused` too, the static step's with compiled bodies."""
    rows = []
    for batch in batches:
        work = requests(prompts, batch)
        row = decode_at(model, tokenizer, work, new_tokens, repeats, dtype, device)
        print(
            f"  batch {batch}: {row['native_tokens_per_s']:.1f} tokens/s vs generate "
            f"{row['generate_tokens_per_s']:.1f} ({row['speedup']:.2f}x); step {row['step_ms']:.1f} ms, "
            f"floor {row['floor_ms']:.1f} ms"
        )
        if graphs:
            row.update(graphs_at(model, tokenizer, work, new_tokens, repeats, dtype, device, row))
            print(
                f"    static step ({row['graphs_mode']}): {row['graphs_tokens_per_s']:.1f} tokens/s "
                f"({row['graphs_speedup']:.2f}x generate); step {row['graphs_step_ms']:.2f} ms, "
                f"{row['graphs_step_vs_captured_floor']:.2f}x its matmuls captured; capture "
                f"{row['graph_capture_s']:.2f} s"
                + (
                    f"; reading each step's tokens before sending its forward: step "
                    f"{row['graphs_step_ms_read_first']:.2f} ms ({row['overlap_speedup']:.2f}x the time)"
                    if "overlap_speedup" in row
                    else ""
                )
            )
        if graphs and fused:
            row.update(graphs_at(model, tokenizer, work, new_tokens, repeats, dtype, device, row, "on"))
            print(
                f"    static step, compiled bodies ({row['fused_graphs_mode']}"
                f"{'; the compile FAILED: eager bodies' if row['fused_compile_failed'] else ''}): "
                f"{row['fused_graphs_tokens_per_s']:.1f} tokens/s; step {row['fused_graphs_step_ms']:.2f} ms, "
                f"{row['fused_graphs_step_vs_captured_floor']:.2f}x its matmuls captured; first call "
                f"{row['fused_graph_first_call_s']:.1f} s (compiling included)"
            )
        if compile:
            row.update(compiled_at(model, tokenizer, work, new_tokens, repeats, dtype, device, row))
            print(
                f"    compiled: {row['compiled_tokens_per_s']:.1f} tokens/s ({row['compiled_speedup']:.2f}x "
                f"generate); step {row['compiled_step_ms']:.1f} ms; first call {row['compile_s']:.0f} s"
            )
        rows.append(row)
    return rows


def decode_at(model, tokenizer, work, new_tokens, repeats, dtype, device) -> dict:
    batch = len(work)
    native = engine(model, tokenizer, batch, dtype, device)
    native_s, tokens, stats = equal_work(native, work, new_tokens, repeats, device)
    inputs = left_padded(tokenizer, [r.prompt_ids for r in work], device)
    hf_s, out = timed(device, repeats, lambda: hf_sample(model, tokenizer, inputs, new_tokens))
    assert out.shape[1] - inputs["input_ids"].shape[1] == new_tokens
    step_ms = stats["decode_step_ms"] + stats.get("sample_ms", 0.0)
    floor = step_floor(native, work, new_tokens, device)
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "native_s": native_s,
        "native_tokens_per_s": tokens / native_s,
        "generate_s": hf_s,
        "generate_tokens_per_s": tokens / hf_s,
        "speedup": hf_s / native_s,
        "step_ms": step_ms,
        "prefill_s": stats["prefill_s"],
        **floor,
        "step_vs_floor": step_ms / floor["floor_ms"],
    }


def step_floor(native, work, new_tokens: int, device: torch.device) -> dict:
    """The GEMMs of the engine's middle decode step, replayed alone on `device`."""
    from bench.engine.floor import replay_seconds

    calls = middle_step_gemms(native, work, new_tokens)
    flops = sum(call.flops() for call in calls)
    eager = 1000 * replay_seconds(calls, device=device)
    return {
        "gemms": len(calls),
        "gemm_gflop": flops / 1e9,
        "floor_ms": eager,
        # the same products captured as one CUDA graph (launches left out); eager where there is no CUDA
        "captured_floor_ms": 1000 * replay_seconds(calls, device=device, captured=True)
        if device.type == "cuda"
        else eager,
    }


def bandwidth_bound(model, device: torch.device) -> dict:
    """Batch 1's floor from memory: every weight a token uses read once a step (of a mixture of
    experts, its top-k experts' share of the expert weights) at the copy bandwidth measured here (a
    256 MiB buffer copied, read and written)."""
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel() * p.element_size()
        if ".experts." in name or name.endswith(".experts"):
            expert += p.numel() * p.element_size()
    config = model.config
    share = getattr(config, "num_experts_per_tok", 1) / (
        getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 1
    )
    weight_bytes = int(total - expert * (1 - share)) if expert else total
    source = torch.empty(64 * 2**20, dtype=torch.float32, device=device).normal_()
    target = torch.empty_like(source)
    seconds, _ = timed(device, 5, lambda: target.copy_(source))
    bandwidth = 2 * source.numel() * source.element_size() / seconds
    return {
        "weight_bytes": weight_bytes,
        "all_weight_bytes": total,
        "copy_gb_per_s": bandwidth / 1e9,
        "bound_ms": 1000 * weight_bytes / bandwidth,
    }


def long_tail(model, tokenizer, prompts, count, slots, short, long, repeats, dtype, device) -> dict:
    """Useful tokens/s on a long-tailed length mix (10% long): continuous batching against static."""
    import random

    from everyprompt.rollout import SamplingParams
    from everyprompt.rollout.scheduler import admission_order

    lengths = draw_lengths(random.Random(1), count, short, long, 0.1)
    work = requests(prompts, count, lengths)
    native = engine(model, tokenizer, slots, dtype, device)
    order = admission_order([float(n) for n in lengths], "longest_first")  # lengths as predicted
    params = SamplingParams(long[1])
    native_s, done = timed(device, repeats, lambda: list(native.generate([work[i] for i in order], params)))
    assert sorted(len(c.token_ids) for c in done) == sorted(lengths)
    batches = [list(range(start, min(start + slots, count))) for start in range(0, count, slots)]
    inputs = [left_padded(tokenizer, [work[i].prompt_ids for i in batch], device) for batch in batches]

    def static():
        for batch, encoded in zip(batches, inputs):
            hf_sample(model, tokenizer, encoded, max(lengths[i] for i in batch))

    hf_s, _ = timed(device, repeats, static)
    tokens = sum(lengths)
    computed = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)
    return {
        "requests": count,
        "slots": slots,
        "tokens": tokens,
        "native_s": native_s,
        "native_tokens_per_s": tokens / native_s,
        "native_slot_occupancy": native.stats["slot_occupancy"],
        "generate_s": hf_s,
        "generate_tokens_per_s": tokens / hf_s,
        "generate_useful_share": tokens / computed,
        "speedup": hf_s / native_s,
    }


def prefill(model, tokenizer, prompts, lengths, batch, repeats, dtype, device) -> list[dict]:
    """Prefill tokens/s for prompts of each length: the engine (one new token, its prefill time)
    against one forward of the model over the same batch (the last position's logits, as generate's
    first step computes them)."""
    source = [t for prompt in prompts for t in prompt]
    rows = []
    for length in lengths:
        ids = [(source[i * 7 :] + source)[:length] for i in range(batch)]
        row = prefill_at(model, tokenizer, ids, repeats, dtype, device)
        rows.append(row)
        print(
            f"  prefill {batch} x {length}: {row['native_tokens_per_s']:.0f} tokens/s vs forward "
            f"{row['forward_tokens_per_s']:.0f}"
        )
    return rows


def prefill_at(model, tokenizer, ids: list[list[int]], repeats, dtype, device) -> dict:
    from everyprompt.rollout import GenerationRequest, SamplingParams

    batch, length = len(ids), len(ids[0])
    work = [GenerationRequest(i, ids[i], seed=i) for i in range(batch)]
    native = engine(model, tokenizer, batch, dtype, device)
    list(native.generate(work, SamplingParams(1)))  # warm-up
    best = float("inf")
    for _ in range(repeats):
        list(native.generate(work, SamplingParams(1)))
        best = min(best, native.stats["prefill_s"])
    tensor = torch.tensor(ids, device=device)

    def forward():
        with torch.inference_mode():
            return model(input_ids=tensor, use_cache=True, logits_to_keep=1).logits

    hf_s, _ = timed(device, repeats + 1, forward)
    tokens = batch * length
    return {
        "length": length,
        "batch": batch,
        "native_s": best,
        "native_tokens_per_s": tokens / best,
        "forward_s": hf_s,
        "forward_tokens_per_s": tokens / hf_s,
        "speedup": hf_s / best,
    }


def model_suite(
    path: Path,
    device: torch.device,
    dtype: str,
    quick: bool,
    compile: bool = False,
    graphs: bool = False,
    decode_only: bool = False,
    fused: bool = False,
    batches: tuple[int, ...] | None = None,
) -> dict:
    """The model benchmark; `batches`: the decode batches (default: the size's, 1/8/32/64 in full)."""
    size = sizes(quick)
    if batches:
        size["batches"] = batches
    model, tokenizer, prompts = load(path, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"{path}: {model.config.model_type}, {params / 1e6:.1f}M parameters, {dtype} on {device}")
    out: dict = {"model": str(path), "model_type": model.config.model_type, "parameters": params}
    out["device"], out["quick"], out["compiled"], out["graphs"] = str(device), quick, compile, graphs
    out["fused"] = fused
    print("decode: engine vs generate, equal work ...")
    out["decode"] = decode(
        model,
        tokenizer,
        prompts,
        size["batches"],
        size["new_tokens"],
        size["repeats"],
        dtype,
        device,
        compile,
        graphs,
        fused,
    )
    out["bandwidth"] = bandwidth_bound(model, device)
    if graphs:
        print("greedy completions: the static step against the eager ones ...")
        out["graphs_agree"] = graphs_agree(model, tokenizer, prompts, dtype, device, *size["agree"])
        print(f"  {out['graphs_agree']}")
        print("what a static step launches (its bodies run eagerly under the profiler) ...")
        out["step_kernels"] = [
            step_kernels(model, tokenizer, prompts, dtype, device, batch, compile=compiled)
            for compiled in (("off", "on") if fused else ("off",))
            for batch in (size["batches"][0], size["batches"][-1])
        ]
        for row in out["step_kernels"]:
            print(
                f"  batch {row['batch']}{' (compiled bodies)' if row['compile'] == 'on' else ''}: "
                f"{describe_kernels(row)}"
            )
    if decode_only:
        return out
    print("long-tailed lengths: continuous vs static batching ...")
    out["long_tail"] = long_tail(
        model,
        tokenizer,
        prompts,
        size["long_tail_requests"],
        size["long_tail_slots"],
        size["short"],
        size["long"],
        size["repeats"],
        dtype,
        device,
    )
    print("prefill ...")
    out["prefill"] = prefill(
        model,
        tokenizer,
        prompts,
        size["prefill_lengths"],
        size["prefill_batch"],
        size["repeats"],
        dtype,
        device,
    )
    return out
