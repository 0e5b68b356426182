"""Held-out evaluation: greedy pass@1 and sampled pass@k, overall and per difficulty level; with an
environment (config `env`), of its episodes.

A completion passes when its reward is at least 1.0 (full marks of a verifiable reward).
"""

from __future__ import annotations

from collections import defaultdict
from math import comb

from everyprompt.config import Config
from everyprompt.data.formatting import PlainFormat, prompt_format_of
from everyprompt.envs.episode import Episodes
from everyprompt.generation import sample_and_score
from everyprompt.logs import progress_bar
from everyprompt.rewards import build_reward
from everyprompt.rewards.gym import read_answer
from everyprompt.rewards.math import extract_answer
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout import GenerationRequest, SamplingParams, derive_seed


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _passes(
    engine,
    tokenizer,
    rows,
    reward_fn,
    params: SamplingParams,
    samples: int,
    seed: int,
    prompt_format,
    pool,
    kept: list | None = None,
    progress: bool = False,
    episodes: Episodes | None = None,
) -> list[list[bool]]:
    """Per row, whether each of its `samples` completions passes; with `kept`, each completion's record
    (prompt as the model saw it, completion, extracted answer, reward) is appended to it. `progress`: a
    bar over the prompts (greedy) or the samples, with their rate. `episodes`: each completion is an
    episode of that environment, judged by it."""
    expanded = [rows[i] for i in range(len(rows)) for _ in range(samples)]
    if episodes is None:
        started = [None] * len(expanded)
        formatted = [prompt_format.prompt_ids(row) for row in rows]
        prompts = [formatted[n // samples] for n in range(len(expanded))]
    else:  # one episode (a fresh environment) per completion; its prompt is the environment's
        started = [episodes.start(row) for row in expanded]
        prompts = [episode.prompt_ids for episode in started]
    requests = [
        GenerationRequest(n, prompts[n], derive_seed(seed, n // samples, n % samples), episode=started[n])
        for n in range(len(expanded))
    ]
    unit, label = (
        ("prompts", "eval (greedy)") if samples == 1 else ("samples", f"eval ({samples} samples each)")
    )
    with (
        RewardPool(reward_fn, **pool) as rewards,
        progress_bar(len(requests), label, enabled=progress, unit=unit) as advance,
    ):
        scored = sample_and_score(engine, tokenizer, requests, params, expanded, rewards, progress=advance)
    flags = [r is not None and r >= 1.0 for r in scored.rewards]
    if kept is not None:
        for index, (text, reward) in enumerate(zip(scored.texts, scored.rewards)):
            row = expanded[index]
            kept.append(
                {
                    "prompt": prompt_format.text(row)
                    if episodes is None
                    else tokenizer.decode(prompts[index]),
                    "completion": text,
                    "extracted_answer": extract_answer(text)
                    if row.get("gym") is None
                    else read_answer(text, row["gym"].get("read", "auto")),
                    "answer": row.get("answer"),
                    "reward": reward,
                }
            )
    return [flags[i * samples : (i + 1) * samples] for i in range(len(rows))]


def _summarise(rows, values: list[float], name: str) -> dict[str, float]:
    out = {name: sum(values) / len(values)}
    by_level: dict[object, list[float]] = defaultdict(list)
    for row, value in zip(rows, values):
        if row.get("level") is not None:
            by_level[row["level"]].append(value)
    for level in sorted(by_level):
        out[f"{name}/level_{level}"] = sum(by_level[level]) / len(by_level[level])
    by_task: dict[str, list[float]] = defaultdict(list)  # reasoning-gym rows: per task
    for row, value in zip(rows, values):
        if row.get("task") is not None:
            by_task[row["task"]].append(value)
    for task in sorted(by_task):
        out[f"{name}/task_{task}"] = sum(by_task[task]) / len(by_task[task])
    return out


def evaluate(
    engine,
    tokenizer,
    rows: list[dict],
    reward_fn,
    *,
    max_new_tokens: int,
    num_samples: int = 0,
    pass_k: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    stop: tuple[str, ...] = (),
    prompt_format=None,
    workers: int = 0,
    timeout_s: float = 30.0,
    completions: list | None = None,
    progress: bool = False,
    episodes: Episodes | None = None,
) -> dict[str, float]:
    """Greedy accuracy (and pass@k when `num_samples` > 0) of `engine` on `rows`, prompts rendered by
    `prompt_format` (data.formatting; default: plain text). Rewards are scored as in training: in
    `workers` processes with a `timeout_s` per call (a reward that hangs or fails scores the completion
    as not passing), or inline with `workers` 0 (the whole call in one reward call, no timeout). With
    `completions` (a list), the greedy completions' records are appended to it, in row order; `progress`
    shows a bar with prompts/s. `episodes`: every completion is an episode of that environment (config
    `env`; envs/episode.py), judged by it rather than by `reward_fn`, with its stop strings added."""
    prompt_format = prompt_format or PlainFormat(tokenizer)
    if episodes is not None:
        stop = (*stop, *episodes.stop)
    pool = {"workers": workers, "timeout_s": timeout_s}
    greedy = SamplingParams(max_new_tokens, greedy=True, stop=stop)
    results = _summarise(
        rows,
        [
            float(p[0])
            for p in _passes(
                engine,
                tokenizer,
                rows,
                reward_fn,
                greedy,
                1,
                seed,
                prompt_format,
                pool,
                completions,
                progress,
                episodes,
            )
        ],
        "greedy_accuracy",
    )
    if num_samples:
        sampled = SamplingParams(max_new_tokens, temperature=temperature, stop=stop)
        flags = _passes(
            engine,
            tokenizer,
            rows,
            reward_fn,
            sampled,
            num_samples,
            seed,
            prompt_format,
            pool,
            None,
            progress,
            episodes,
        )
        results.update(
            _summarise(rows, [pass_at_k(num_samples, sum(f), pass_k) for f in flags], f"pass@{pass_k}")
        )
    results["num_prompts"] = float(len(rows))
    return results


def evaluate_config(
    config: Config,
    engine,
    tokenizer,
    rows: list[dict],
    completions: list | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """`evaluate` with a config's settings: its reward (in its worker pool), its prompt format and stops,
    and `eval.*`'s samples, k, temperature and seed (`completions`: as `evaluate`'s; `progress`: a bar,
    when `logging.progress` allows one and no other is live, as during training)."""
    return evaluate(
        engine,
        tokenizer,
        rows,
        # no run directory: judge samples are logged for training only
        build_reward(held_out_rewards(config)),
        max_new_tokens=config.rollout.max_new_tokens,
        num_samples=config.eval.num_samples,
        pass_k=config.eval.pass_k,
        temperature=config.eval.temperature,
        seed=config.seed,
        stop=tuple(config.rollout.stop),
        prompt_format=prompt_format_of(config, tokenizer),
        workers=config.rewards.workers,
        timeout_s=config.rewards.timeout_s,
        completions=completions,
        progress=progress and config.logging.progress,
        episodes=Episodes.from_config(config, tokenizer, engine),
    )


def held_out_rewards(config: Config):
    """The rewards section that judges held-out answers: `eval.reward` in place of the training reward."""
    if config.eval.reward is None:
        return config.rewards
    return config.rewards.model_copy(update={"function": config.eval.reward, "components": []})
