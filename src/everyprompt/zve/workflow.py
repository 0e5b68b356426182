"""ZVE stage 0 as a config runs it: the config's engine, sampling settings and reward pool estimate the pass
rates (`offline.py`), the filter keeps low < p < high, and the rates are recorded in the pass-rate store.
`run_offline_filter` is what the training pipeline calls before RL (`zve.filter.enabled`);
`filter_prompt_file` is `everyprompt filter`: it also writes the kept rows, a report and a histogram.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from everyprompt.config import Config, OfflineFilterConfig
from everyprompt.data.formatting import prompt_format_of
from everyprompt.data.passrate import PassRateStore
from everyprompt.logs import progress_bar
from everyprompt.rewards import build_reward
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout import SamplingParams, build_engine
from everyprompt.run.files import write_json_atomic, write_jsonl_atomic
from everyprompt.run.layout import FilterLayout
from everyprompt.zve.offline import (
    BAND,
    FilterResult,
    PassRateEstimate,
    estimate_pass_rates,
    filter_by_pass_rate,
)


def run_offline_filter(
    model, tokenizer, rows: list[dict], config: Config, store: PassRateStore | None = None
) -> tuple[PassRateEstimate, FilterResult]:
    """Estimate, filter, record: samples with the config's rollout settings and reward; records every
    scored prompt in `store` (when given) at step -1."""
    rules, rollout = config.zve.filter, config.rollout
    engine = build_engine(rollout, model, tokenizer)
    params = SamplingParams(
        rollout.max_new_tokens, rollout.temperature, rollout.top_p, stop=tuple(rollout.stop)
    )
    with (
        progress_bar(len(rows), "pass rates", enabled=config.logging.progress) as advance,
        RewardPool(
            build_reward(config.rewards),
            config.rewards.workers,
            config.rewards.timeout_s,
            load_timeout_s=config.rewards.load_timeout_s,
        ) as pool,
    ):
        estimate = estimate_pass_rates(
            engine,
            tokenizer,
            rows,
            pool,
            rules.samples,
            params,
            config.seed,
            config.zve.correct_reward,
            progress=advance,
            prompt_format=prompt_format_of(config, tokenizer),
        )
    if store is not None:
        store.record(estimate.records(rows), step=-1)
    return estimate, filter_by_pass_rate(estimate, rules.low, rules.high)


def filter_counts(estimate: PassRateEstimate, result: FilterResult, rules: OfflineFilterConfig) -> dict:
    """What a filter report says of every run of it: the rules, what was kept and dropped, the histogram."""
    return {
        "samples": rules.samples,
        "low": rules.low,
        "high": rules.high,
        "kept": len(result.kept),
        "too_easy": result.too_easy,
        "too_hard": result.too_hard,
        "unscored": result.unscored,
        "reward_errors": estimate.errors,
        "histogram": result.histogram,
        "band": list(BAND),
    }


@dataclass
class FilteredFile:
    """What `filter_prompt_file` wrote (`out`) and its report."""

    out: FilterLayout
    report: dict


def filter_prompt_file(
    model, tokenizer, rows: list[dict], config: Config, out: str | Path, source: str, checkpoint: str
) -> FilteredFile:
    """`everyprompt filter`: the pass rates of `rows` (from `source`) under the model of `checkpoint`; writes
    the kept rows with their rates, a JSON report, a pass-rate histogram and the store into `out`."""
    layout = FilterLayout(out)
    layout.root.mkdir(parents=True, exist_ok=True)
    rules = config.zve.filter
    store = PassRateStore(layout.pass_rates)
    try:
        estimate, result = run_offline_filter(model, tokenizer, rows, config, store)
    finally:
        store.close()
    kept = [{**rows[i], "pass_rate": estimate.rate(i), "attempts": estimate.attempts[i]} for i in result.kept]
    write_jsonl_atomic(layout.kept, kept)
    report = {
        "data": source,
        "model": checkpoint,
        "prompts": len(rows),
        **filter_counts(estimate, result, rules),
        "by_level": estimate.by_level(rows),
    }
    write_json_atomic(layout.report, report)
    plot_pass_rates(estimate, rules, layout.histogram)
    return FilteredFile(layout, report)


def plot_pass_rates(estimate: PassRateEstimate, rules: OfflineFilterConfig, path: Path) -> None:
    """A histogram of the estimated pass rates with the filter's bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for i in range(len(estimate.attempts)) if (r := estimate.rate(i)) is not None]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.hist(rates, bins=rules.samples + 1, range=(0, 1), color="#4c72b0", edgecolor="white")
    axis.axvline(rules.low, color="#c44e52", linestyle="--")
    axis.axvline(rules.high, color="#c44e52", linestyle="--")
    axis.set_xlabel(f"pass rate ({rules.samples} samples)")
    axis.set_ylabel("prompts")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
