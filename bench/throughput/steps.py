"""The decode steps measured beside the plain one on a real model (model.py): the compiled step
(`rollout.compile=on`) and the static step (CUDA graphs on a CUDA device, eager elsewhere), and the static
step's greedy completions against the eager ones."""

from __future__ import annotations

from dataclasses import replace

from bench.throughput.work import engine, equal_work, requests, static_mode


def compiled_at(model, tokenizer, work, new_tokens, repeats, dtype, device, eager: dict) -> dict:
    """The compiled decode step (`rollout.compile=on`) on `work`, against `eager`'s `generate` time;
    the first call (tracing and compiling included) timed apart."""
    native = engine(model, tokenizer, len(work), dtype, device, compile="on")
    equal_work(native, work, new_tokens, 1, device)  # the first call: compiles
    seconds, tokens, stats = equal_work(native, work, new_tokens, repeats, device)
    step_ms = stats["decode_step_ms"] + stats.get("sample_ms", 0.0)
    return {
        "compiled_s": seconds,
        "compiled_tokens_per_s": tokens / seconds,
        "compiled_speedup": eager["generate_s"] / seconds,
        "compiled_step_ms": step_ms,
        "compiled_step_vs_floor": step_ms / eager["floor_ms"],
        # the engine's own count of its compiled graphs' first calls (tracing, code generation); a later
        # batch size reuses the graph. The first generate call less the fastest one was used before: it
        # read 0 where both were noise around a compile the process had cached
        "compile_s": native.compiler.compile_s,
    }


def graphs_at(
    model, tokenizer, work, new_tokens, repeats, dtype, device, plain: dict, compile: str = "off"
) -> dict:
    """The static step (`static_mode`) on `work`, against the plain step's row `plain`: its first call
    (captures included) timed apart. `compile="on"`: its bodies through torch.compile first (the figures
    then named `fused_...`: Inductor's fused kernels, captured on a CUDA device)."""
    native = engine(
        model, tokenizer, len(work), dtype, device, compile=compile, cuda_graphs=static_mode(device)
    )
    first_s, _, first = equal_work(native, work, new_tokens, 1, device)
    seconds, tokens, stats = equal_work(native, work, new_tokens, repeats, device)
    step_ms = stats["decode_step_ms"] + stats.get("sample_ms", 0.0)
    row = {
        "graphs_mode": native.decoding.name,
        "graphs_s": seconds,
        "graphs_tokens_per_s": tokens / seconds,
        "graphs_speedup": plain["generate_s"] / seconds,
        "graphs_step_ms": step_ms,
        "graphs_vs_plain_step": plain["step_ms"] / step_ms,
        "graphs_step_vs_floor": step_ms / plain["floor_ms"],
        "graphs_step_vs_captured_floor": step_ms / plain["captured_floor_ms"],
        "graph_first_call_s": first_s,
        "graph_capture_s": first["graph_capture_s"],
        "graph_pool_mib": first["graph_pool_mib"],
        "graph_replays": stats["graph_replays"],
        "graph_eager_steps": stats["graph_eager_steps"],
        "graph_replay_eps": stats["graph_replay_eps"],
        "graph_failed": stats["graph_failed"],
        # compiled bodies that failed to compile run eagerly (with a warning): their figures are the eager
        # bodies' then (the H200's of 2026-11-28 were); a failure stays for the engine's later calls
        "compile_failed": stats.get("compile_failed", 0.0),
        "graphs_overlapped": stats.get("overlapped", 0.0),
    }
    if native.decoding.overlap and compile == "off":
        # the same engine and graphs with the host reading each step's tokens before it sends the forward
        # (the loop before 2026-11-28): what sending it first is worth (rollout/native/decode_loop.py)
        native.decoding = replace(native.decoding, overlap=False)
        seconds, _, stats = equal_work(native, work, new_tokens, repeats, device)
        row["graphs_step_ms_read_first"] = stats["decode_step_ms"] + stats.get("sample_ms", 0.0)
        row["overlap_speedup"] = seconds / row["graphs_s"]  # above 1: sending the forward first pays
    return row if compile == "off" else {f"fused_{key}": value for key, value in row.items()}


def graphs_agree(model, tokenizer, prompts, dtype, device, count: int = 64, new_tokens: int = 64) -> dict:
    """Greedy completions of `count` prompts through the static step (graphs on a CUDA device) against the
    same step run eagerly (the same kernels: tokens equal, log-probs within 1e-3 is the bar) and against
    the plain step (attending over fewer positions, so its low-precision rounding differs)."""
    from everyprompt.rollout import SamplingParams

    params = SamplingParams(new_tokens, greedy=True)
    work = requests(prompts, count)
    runs = {
        mode: {
            c.request_id: c
            for c in engine(model, tokenizer, count, dtype, device, cuda_graphs=mode).generate(work, params)
        }
        for mode in (static_mode(device), "static", "off")
    }
    graphs = runs[static_mode(device)]
    out = {"prompts": count, "new_tokens": new_tokens, "graphs_mode": static_mode(device)}
    for name, other in (("eager", runs["static"]), ("plain", runs["off"])):
        same = [graphs[i].token_ids == other[i].token_ids for i in graphs]
        diffs = [
            float((graphs[i].logprobs - other[i].logprobs).abs().max())
            for i in graphs
            if graphs[i].token_ids == other[i].token_ids
        ]
        out[f"tokens_equal_{name}"] = sum(same)
        out[f"max_logprob_diff_{name}"] = max(diffs, default=float("nan"))
    out["agrees"] = out["tokens_equal_eager"] == count and out["max_logprob_diff_eager"] <= 1e-3
    return out
