"""Property tests of every input boundary: whatever comes in, a clear error (naming the file and line,
or the key) or a value, never a traceback of another kind and never a hang.

`make test` runs 100 examples per property; HYPOTHESIS_PROFILE=thorough runs 1000.
"""

from __future__ import annotations

import json
import signal
import string
from contextlib import contextmanager

import pytest
from hypothesis import given
from hypothesis import strategies as st

from everyprompt.config import ConfigError, load_config
from everyprompt.data import DataError, load_prompt_file
from everyprompt.rewards import extract_answer, math_reward, parse_verdict, score_completions

VERDICTS = {"correct", "partial", "incorrect", "better", "tie", "worse"}


@contextmanager
def no_hang(seconds: int = 10):
    """Fail (instead of waiting forever) when the body runs longer than `seconds`."""

    def alarm(_signum, _frame):
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


KEYS = [
    "rl.lr",
    "rl.loss",
    "rl.steps",
    "rollout.precision",
    "zve.enabled",
    "rl.espo.alpha",
    "model.path",
    "curriculum.stages",
    "rl.nope",
    "nope",
    "rl",
    "rl.ppo",
    "rl.loss_options",
    "rewards.components",
    "eval.pass_k",
    "zve.reshape.length_coef",
    "rollout.engine",
    "data.levels",
]
YAML_VALUES = st.one_of(
    st.text(max_size=30),
    st.integers(-(10**12), 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        ["[1, 2]", "{a: 1}", "null", "true", "[{mixture: {4: 1}}]", "{", "- a", "!!python/none", ":"]
    ),
)


@given(key=st.one_of(st.sampled_from(KEYS), st.text(max_size=20)), value=YAML_VALUES)
def test_any_config_override_loads_or_names_the_key(key, value):
    with no_hang():
        try:
            load_config(None, [f"{key}={value}"])
        except ConfigError as err:
            assert str(err)  # a one-line message for the user


@given(
    lines=st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.text(max_size=40).map(str.encode),
            st.builds(
                lambda p, a: json.dumps({"prompt": p, "answer": a}).encode(),
                st.text(max_size=10),
                st.one_of(st.text(max_size=5), st.integers()),
            ),
        ),
        max_size=6,
    )
)
def test_any_jsonl_file_loads_or_names_file_and_line(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_bytes(b"\n".join(lines))
    with no_hang():
        try:
            rows = load_prompt_file(path)
        except DataError as err:
            assert str(path) in str(err)
        else:
            assert rows and all(isinstance(r["prompt"], str) and isinstance(r["answer"], str) for r in rows)


@given(data=st.binary(max_size=200))
def test_any_parquet_file_loads_or_names_the_file(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("data") / "rows.parquet"
    path.write_bytes(b"PAR1" + data + b"PAR1" if data[:1] == b"\x00" else data)
    with no_hang(), pytest.raises(DataError, match="rows.parquet"):
        load_prompt_file(path)


MATHY = st.text(alphabet=string.printable + "\\{}^√π∞", max_size=60)


@given(text=st.one_of(st.text(max_size=80), MATHY), answer=st.one_of(MATHY, st.integers().map(str)))
def test_answer_extraction_and_the_math_reward_take_any_text(text, answer):
    """A reward of 0 or 1, or (for a reference answer that cannot be parsed) a failure that says so."""
    with no_hang():
        extracted = extract_answer(text)
        assert extracted is None or isinstance(extracted, str)
        rewards, failures = score_completions(math_reward, [text, text], {"answer": [answer, answer]})
        if failures:
            assert rewards == [None, None] and all("reference answer" in f.summary for f in failures)
        else:
            assert rewards[0] == rewards[1] and rewards[0] in (0.0, 1.0)


@given(
    text=st.one_of(
        st.text(max_size=120),
        st.builds(
            lambda a, v, b: f"{a}Verdict: {v}{b}",
            st.text(max_size=20),
            st.sampled_from(sorted(VERDICTS) + ["maybe"]),
            st.text(max_size=20),
        ),
    )
)
def test_the_verdict_parser_takes_any_text(text):
    with no_hang():
        assert parse_verdict(text) in VERDICTS | {None}


@given(
    values=st.lists(
        st.one_of(
            st.none(),
            st.floats(allow_nan=True, allow_infinity=True),
            st.text(max_size=3),
            st.booleans(),
            st.lists(st.floats(), max_size=2),
        ),
        max_size=5,
    ),
    count=st.integers(1, 4),
)
def test_any_reward_return_scores_a_float_or_none_per_row(values, count):
    rewards, failures = score_completions(lambda completions, **_: values, ["x"] * count, {})
    assert len(rewards) == count
    assert all(r is None or isinstance(r, float) and r == r and abs(r) != float("inf") for r in rewards)
    assert len(failures) <= count
