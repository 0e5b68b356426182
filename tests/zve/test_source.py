"""The prompt source: mixture split, retired prompts skipped, exhaustion is an error, resumable."""

from __future__ import annotations

import pytest

from everyprompt.config import CurriculumConfig, CurriculumStage
from everyprompt.data import DataError
from everyprompt.data.curriculum import Curriculum
from everyprompt.data.source import PromptSource, buckets_by_pass_rate, split_counts


def test_split_counts_largest_remainder():
    # 10 by 1:1:1 -> 3.33 each: remainders tie, the first key gets the extra one
    assert split_counts(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    # 10 by 0.25 / 0.75 -> 2.5 / 7.5: remainders tie again, first key first
    assert split_counts(10, {"easy": 0.25, "hard": 0.75}) == {"easy": 3, "hard": 7}
    assert split_counts(7, {"x": 0.1, "y": 0.9}) == {"x": 1, "y": 6}  # 0.7 / 6.3


def test_take_follows_the_mixture_and_skips_unavailable_prompts():
    source = PromptSource({"4": list(range(0, 10)), "5": list(range(10, 20))}, seed=0)
    drawn = source.take(8, {"4": 3, "5": 1})
    assert sum(i < 10 for i in drawn) == 6 and sum(i >= 10 for i in drawn) == 2
    odd_only = source.take(20, None, available=lambda i: i % 2 == 1)
    assert all(i % 2 == 1 for i in odd_only)


def test_an_exhausted_bucket_passes_its_share_on_and_total_exhaustion_is_an_error():
    source = PromptSource({"a": [0, 1], "b": [2, 3, 4]}, seed=1)
    drawn = source.take(4, {"a": 1, "b": 1}, available=lambda i: i >= 2)
    assert sorted(set(drawn)) <= [2, 3, 4] and len(drawn) == 4
    with pytest.raises(
        DataError, match="every RL prompt of the mixture's buckets is retired, deferred or in flight"
    ):
        source.take(2, None, available=lambda i: False)


def test_source_state_round_trip():
    source = PromptSource({"all": list(range(50))}, seed=3)
    source.take(7)
    state = source.state_dict()
    expected = source.take(10)
    other = PromptSource({"all": list(range(50))}, seed=3)
    other.load_state_dict(state)
    assert other.take(10) == expected


def test_pass_rate_buckets():
    rates = {"a": 0.0, "b": 0.5, "c": 0.9}
    rows = [{"prompt": p} for p in ("a", "b", "c", "d")]
    buckets = buckets_by_pass_rate(rows, rates.get, (0.3, 0.8))
    assert buckets == {"hard": [0], "medium": [1], "easy": [2], "unknown": [3]}


def test_curriculum_state_must_fit_the_config():
    two = Curriculum(CurriculumConfig(stages=[CurriculumStage(mixture={"4": 1}, steps=1)] * 2))
    two.observe(1, 0.0)
    assert two.index == 1
    one = Curriculum(CurriculumConfig(stages=[CurriculumStage(mixture={"4": 1})]))
    with pytest.raises(ValueError, match="curriculum stage 2; the config has 1 stage"):
        one.load_state_dict(two.state_dict())
