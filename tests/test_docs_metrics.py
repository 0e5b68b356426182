"""docs/metrics.md names every figure a run writes to metrics.jsonl: tiny runs' keys, each matched against
the page's tables (their first column's keys; `<name>` and `*` stand for any name, `{a,b}` for either)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from everyprompt.pipeline import train
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent


def documented() -> list[re.Pattern]:
    """One pattern per key the table's first column names."""
    patterns = []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
            parts = re.split(r"(\{[^}]+\}|<[^>]+>|\*)", key)
            choices = [_choices(part) for part in parts]
            patterns += [re.compile("".join(c) + "$") for c in itertools.product(*choices)]
    return patterns


def _choices(part: str) -> list[str]:
    """What a piece of a documented key matches: `{a,b}` either, `<name>` or `*` any name, else itself."""
    if part.startswith("{"):
        return part[1:-1].split(",")
    if part.startswith("<") or part == "*":
        return [".+"]
    return [re.escape(part)]


def test_the_patterns_read_the_table_as_written():
    patterns = documented()

    def named(key):
        return any(p.match(key) for p in patterns)

    assert named("mismatch/logp_abs_diff_unflipped") and named("reward/my_component") and named("eval/pass@4")
    assert not named("entropy_sum") and not named("mismatch/logp_abs_diff_sideways")


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
@pytest.mark.parametrize(
    "overrides",
    [
        ["zve.enabled=true", "eval.every=1"],
        ["rl.router_replay=r3", "rl.kl.estimator=k3", "rl.kl.coef=0.01"],
        ["rl.rollout_correction.mode=icepop", "rl.old_logprobs=recompute", "rl.loss=gspo"],
        ["rollout.engine=hf", "model.lora.enabled=true", "model.lora.r=4"],
    ],
    ids=["zve", "replay-kl", "icepop-gspo", "hf-lora"],
)
def test_every_figure_a_run_logs_is_on_the_metrics_page(tmp_path, overrides):
    train(tiny_config("rl.steps=2", *overrides), run_dir=tmp_path / "run")  # `everyprompt train`'s path
    records = [tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "sft" / "metrics.jsonl"]
    lines = [line for path in records for line in path.read_text().splitlines()]
    keys = set().union(*(json.loads(line) for line in lines)) - {"step"}
    assert "sft/loss" in keys  # the tiny recipe warms up with SFT: its records are checked too
    assert ("eval/greedy_accuracy" in keys) == ("eval.every=1" in overrides)  # step 1's evaluation
    patterns = documented()
    assert len(keys) > 40
    assert sorted(k for k in keys if not any(p.match(k) for p in patterns)) == []
