"""What one static decode step launches (model.py, with `--graphs`): the step's bodies run eagerly under
torch's profiler, so that what a CUDA graph replays is counted kernel by kernel.

On a CUDA device: the device's kernels (how many a step, their summed device time, the commonest by
name); where the profiler sees none (no CUPTI on the machine), the row says so instead of a count.
Elsewhere: torch's leaf operators that are not views, each of which would be a kernel on a GPU, timed on
the host. Two calls of `SHORT` and `SHORT + new_tokens` tokens are profiled and differenced, so prefill and
each call's own set-up cancel and what is left is `new_tokens` decode steps.

A graph replay removes launch gaps, not kernels: a step whose replay costs about its kernels' summed time
is kernel-bound (fewer, fused kernels are the way down), one that costs much more waits on something else.
"""

from __future__ import annotations

from collections import Counter

import torch

from bench.throughput.work import engine, equal_work, requests

SHORT = 2  # tokens of the shorter profiled call

# operators that launch no kernel of their own: views, metadata, allocation without a fill, host reads, and
# the casts and copies whose work is the `copy_` beneath them (counted there)
VIEWS = frozenset(
    "aten::" + name
    for name in (
        "view alias as_strided detach expand expand_as narrow permute reshape _reshape_alias select slice "
        "split split_with_sizes squeeze t transpose unbind unsqueeze _unsafe_view view_as chunk contiguous "
        "empty empty_like empty_strided lift_fresh resolve_conj resolve_neg result_type is_nonzero item "
        "_local_scalar_dense to _to_copy"
    ).split()
)


def step_kernels(
    model, tokenizer, prompts, dtype, device, batch: int, new_tokens: int = 8, compile: str = "off"
) -> dict:
    """One static decode step of `batch` rows, counted (see the module docstring); `compile="on"`: its
    bodies through torch.compile (Inductor's kernels: what a graph of the fused step replays). The count
    per decoder layer is the step's count over the model's layers (the head and sampler included)."""
    from torch.profiler import ProfilerActivity, profile

    native = engine(model, tokenizer, batch, dtype, device, compile=compile, cuda_graphs="static")
    work = requests(prompts, batch)
    equal_work(native, work, SHORT, 1, device)  # warm-up: library handles, lazily built tables
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    counted = []
    for tokens in (SHORT, SHORT + new_tokens):
        with profile(activities=activities) as prof:
            equal_work(native, work, tokens, 1, device)
        counted.append(launches(prof.events(), device))
    (short, short_us), (long, long_us) = counted
    kind = "cuda kernels" if device.type == "cuda" else "cpu operators"
    row = {"batch": batch, "kind": kind, "steps_counted": new_tokens, "compile": compile}
    if device.type == "cuda" and not sum(long.values()):
        return {**row, "per_step": None, "why": "the profiler saw no CUDA kernels (no CUPTI activity here)"}
    per_step = {name: (long[name] - short[name]) / new_tokens for name in long}
    row["per_step"] = sum(per_step.values())
    row["per_layer"] = row["per_step"] / model.config.num_hidden_layers
    row["ms_per_step"] = (long_us - short_us) / new_tokens / 1000
    row["matmuls"] = sum(count for name, count in per_step.items() if is_matmul(name, device))
    row["top"] = {name: count for name, count in sorted(per_step.items(), key=lambda kv: -kv[1])[:15]}
    return row


def is_matmul(name: str, device: torch.device) -> bool:
    """Whether a kernel (by the names cuBLAS and CUTLASS give them: cuBLAS's Hopper kernels are `nvjet_*`,
    which the H200's suite of 2026-11-28 counted as 0 matmuls before; on a GPU attention's batched
    products over the cache count too, their names being alike) or an operator is a matrix product of the
    step's weights (on the CPU: not attention's batched products over the cache)."""
    if device.type == "cuda":
        return any(word in name.lower() for word in ("gemm", "gemv", "nvjet"))
    return name in ("aten::mm", "aten::addmm")


def describe_kernels(row: dict) -> str:
    """A `step_kernels` row in a line."""
    if row["per_step"] is None:
        return row["why"]
    top = ", ".join(f"{name} {count:g}" for name, count in list(row["top"].items())[:6])
    return (
        f"{row['per_step']:.0f} {row['kind']} a step, {row['per_layer']:.1f} a layer ({row['matmuls']:g} of them "
        "matmuls), "
        f"{row['ms_per_step']:.3f} ms in all ({top}, ...)"
    )


def launches(events, device: torch.device) -> tuple[Counter, float]:
    """(how many of each kernel or operator, their summed time in microseconds) among profiled `events`."""
    names: Counter = Counter()
    total = 0.0
    for event in events:
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            took = event.time_range.elapsed_us()
        else:
            if not event.name.startswith("aten::") or event.name in VIEWS:
                continue
            if any(
                child.name.startswith("aten::") and child.name not in VIEWS for child in event.cpu_children
            ):
                continue  # a composite: its children are what run
            took = event.self_cpu_time_total
        names[event.name] += 1
        total += took
    return names, total
