"""Equal work on a real model (model.py, steps.py): the native engine over it, plain or static, its requests,
and timings that include the device's work."""

from __future__ import annotations

import time

import torch

from bench.throughput.setup import native_engine


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, repeats: int, fn) -> tuple[float, object]:
    """The fastest of `repeats` calls of `fn` (the first warms up), device work included."""
    best, out = float("inf"), None
    for _ in range(repeats):
        synchronize(device)
        began = time.perf_counter()
        result = fn()
        synchronize(device)
        elapsed = time.perf_counter() - began
        if elapsed < best:
            best, out = elapsed, result
    return best, out


def engine(
    model, tokenizer, slots: int, dtype: str, device: torch.device, compile: str = "off", cuda_graphs="off"
):
    """The native engine over `model`, never stopping early (equal work): the plain step unless
    `cuda_graphs` says otherwise."""
    return native_engine(
        model,
        tokenizer,
        slots,
        eos=False,
        compile=compile,
        precision=dtype,
        device=device,
        cuda_graphs=cuda_graphs,
    )


def static_mode(device: torch.device) -> str:
    """How the static step runs here: captured as CUDA graphs on a CUDA device, eagerly elsewhere."""
    return "on" if device.type == "cuda" else "static"


def requests(prompts: list[list[int]], count: int, lengths: list[int] | None = None):
    from everyprompt.rollout import GenerationRequest

    return [
        GenerationRequest(
            i, prompts[i % len(prompts)], seed=i, max_new_tokens=None if lengths is None else lengths[i]
        )
        for i in range(count)
    ]


def left_padded(tokenizer, prompts: list[list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Token-id prompts padded on the left, as `generate` wants them, on `device`."""
    tokenizer.padding_side = "left"
    padded = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    return {key: value.to(device) for key, value in padded.items()}


def equal_work(native, work, new_tokens: int, repeats: int, device) -> tuple[float, int, dict]:
    """The fastest of `repeats` generate calls of `work`, each sequence exactly `new_tokens` long (checked):
    (seconds, tokens, the engine's stats of that call)."""
    from everyprompt.rollout import SamplingParams

    params = SamplingParams(new_tokens)
    seconds, completions = timed(device, repeats, lambda: list(native.generate(work, params)))
    tokens = sum(len(c.token_ids) for c in completions)
    assert tokens == len(work) * new_tokens, tokens
    return seconds, tokens, dict(native.stats)
