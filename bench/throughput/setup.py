"""The throughput benchmark's set-up (bench/throughput): the model and prompts of a config, the engines
under test, (a)'s fixed batch and the long-tailed rollout workload of (a) and (c), and (b)'s slow reward."""

from __future__ import annotations

import random
import time

from everyprompt.rewards import register_reward

SLOW_REWARD_S = 0.02


@register_reward("bench_slow_judge")
def slow_judge(completions, **_):
    """Stands for a reward that waits on something (a judge model, a sandbox): 20 ms per completion."""
    time.sleep(SLOW_REWARD_S * len(completions))
    return [float(len(c) % 2) for c in completions]


def load_demo_model(overrides: list[str]):
    from everyprompt.config import load_config
    from everyprompt.data.rows import ConfigRows
    from everyprompt.models.io import load_model_and_tokenizer

    config = load_config(None, overrides)
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    return model.eval(), tokenizer, [row["prompt"] for row in ConfigRows(config).rl()]


def native_engine(
    model,
    tokenizer,
    slots: int,
    eos: bool = True,
    compile: str = "off",
    precision: str = "fp32",
    device="cpu",
    cuda_graphs: str = "off",
):
    """The native engine over `model` (`eos` False: it never stops early, for equal work). `cuda_graphs`
    off by default: the plain step, which the figures before CUDA graphs were taken with."""
    from everyprompt.rollout.native import NativeEngine

    return NativeEngine(
        model.config,
        model.state_dict(),
        eos_token_id=tokenizer.eos_token_id if eos else -1,  # -1: never stop early
        pad_token_id=tokenizer.pad_token_id,
        batch_size=slots,
        precision=precision,
        compile=compile,
        device=device,
        cuda_graphs=cuda_graphs,
    )


def hf_sample(model, tokenizer, inputs, new_tokens: int):
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


def draw_lengths(rng: random.Random, count: int, short: tuple, long: tuple, long_share: float) -> list[int]:
    """`count` completion lengths: a `long_share` of them drawn from `long`, the rest from `short`."""
    return [rng.randint(*long) if rng.random() < long_share else rng.randint(*short) for _ in range(count)]


def hf_engine(model, tokenizer, slots: int):
    """The hf engine over a copy of `model`, never stopping early (no end-of-sequence ids)."""
    import copy

    from everyprompt.rollout.hf import HFEngine

    return HFEngine(copy.deepcopy(model), [], tokenizer.pad_token_id, slots)


def fixed_batch(tokenizer, prompts: list[str], batch: int) -> tuple[list[str], list]:
    """(a)'s workload: `batch` prompts (cycled) and their requests, one seed each."""
    from everyprompt.rollout import GenerationRequest

    prompts = (prompts * batch)[:batch]
    return prompts, [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(prompts)]


def long_tailed(tokenizer, prompts: list[str], count: int, short: tuple, long: tuple, long_share: float):
    """`count` distinct prompts, their completion lengths (a `long_share` of them drawn from `long`, the
    rest from `short`), the lengths the scheduler predicts for them from a previous visit's history in
    the pass-rate store (each within +-25% of its length now), and their generation requests (each cut
    at its length)."""
    from everyprompt.data.passrate import PassRateStore
    from everyprompt.rollout import GenerationRequest
    from everyprompt.rollout.scheduler import LengthPredictor

    rng = random.Random(1)
    texts = [f"{prompts[i % len(prompts)]} #{i}" for i in range(count)]
    lengths = draw_lengths(rng, count, short, long, long_share)
    store = PassRateStore()
    store.record([(t, 1, 0, n * rng.uniform(0.75, 1.25)) for t, n in zip(texts, lengths)], step=0)
    predicted = [LengthPredictor(store, default=long[1]).predict(t) for t in texts]
    requests = [
        GenerationRequest(i, tokenizer(t).input_ids, seed=i, max_new_tokens=n)
        for i, (t, n) in enumerate(zip(texts, lengths))
    ]
    return texts, lengths, predicted, requests
