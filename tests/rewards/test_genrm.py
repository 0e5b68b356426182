"""GenRM verdict parsing on real-looking judge outputs, malformed ones included."""

import pytest

from everyprompt.rewards.genrm import parse_verdict, verdict_value

OUTPUTS = [
    ("The response computes 12*7 = 84, matching the reference.\nVerdict: correct", "correct"),
    ("The final answer 85 differs from the reference 84.\n\nVerdict: Incorrect", "incorrect"),
    ("Steps are right but the answer is left unsimplified (2/4).\nVerdict: partially correct", "partial"),
    ("**Verdict:** [[Partial]]", "partial"),
    ("Comparing A with the reference, A is clearer.\nFinal verdict = better", "better"),
    ("Both reach 84 by the same route.\nVERDICT: TIE", "tie"),
    ("The response is worse than the reference.\nVerdict: worse.", "worse"),
    ("Answer matches. \\boxed{correct}", "correct"),
    # the judge first writes a draft verdict, then revises it: the last one counts
    ("Verdict: correct\nWait, 12*7 is 84, not 74 as the response says.\nVerdict: incorrect", "incorrect"),
    # "incorrect" must not be read as "correct", nor "partially correct" as "correct"
    ("Judgement: incorrect", "incorrect"),
    ("The reasoning holds up.\n\nCorrect.", "correct"),
    ("Grade: wrong", "incorrect"),
    # malformed: no verdict, a verdict outside the vocabulary, a truncated output
    ("The response seems plausible but I am not sure.", None),
    ("Verdict: maybe", None),
    ("Let me check the arithmetic: 12*7 = 8", None),
    ("", None),
    ("Is the answer correct? Let me see", None),
]


@pytest.mark.parametrize(("text", "expected"), OUTPUTS)
def test_verdicts_are_parsed_or_none(text, expected):
    assert parse_verdict(text) == expected


def test_verdict_values_default_and_configured():
    assert verdict_value("Verdict: correct") == 1.0
    assert verdict_value("Verdict: partial") == 0.0
    assert verdict_value("Verdict: incorrect") == -1.0
    assert verdict_value("Verdict: tie") == 0.0
    assert verdict_value("Verdict: partial", {"partial": 0.5, "incorrect": 0.0}) == 0.5
    assert verdict_value("no verdict here") is None


def test_an_all_tie_group_has_zero_advantage_and_is_zero_variance():
    import torch

    from everyprompt.algorithms import compute_advantages
    from everyprompt.zve import group_zero_variance

    judged = ["A and B agree.\nVerdict: tie"] * 4 + ["Verdict: better", "Verdict: worse", "Verdict: tie", "x"]
    rewards = torch.tensor([float("nan") if (v := verdict_value(t)) is None else v for t in judged])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    advantages = compute_advantages("grpo", rewards, groups)
    assert torch.equal(advantages[:4], torch.zeros(4))  # no random-sign push on equal-quality answers
    assert group_zero_variance(rewards, groups).tolist() == [True, False]  # ZVE sees the tie group
    assert advantages[4] > 0 > advantages[5] and advantages[7] == 0  # the unparseable row is left out


@pytest.fixture
def judge_dir(tmp_path, tiny_model):
    model, tokenizer = tiny_model
    path = tmp_path / "judge"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_judge_scores_through_the_native_engine(judge_dir, tmp_path):
    """A tiny random judge: mechanics, not quality. Each completion gets a value or None (its verdict is
    unreadable), and every row is logged with its raw output."""
    from everyprompt.rewards import GenRMJudge

    log = tmp_path / "samples.jsonl"
    judge = GenRMJudge(
        str(judge_dir),
        "Q {question} R {reference} A {response} ",
        max_new_tokens=6,
        log_path=str(log),
        log_every=1,
    )
    rewards = judge(["42", "41", "40"], prompt=["6*7="] * 3, answer=["42"] * 3)
    assert len(rewards) == 3 and all(r in (None, 1.0, 0.0, -1.0) for r in rewards)
    assert judge.judged == 3
    import json

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["judge_prompt"] for r in records] == [f"Q 6*7= R 42 A {c} " for c in ("42", "41", "40")]
    assert all(isinstance(r["judge_output"], str) for r in records)


def test_judge_settings_are_checked(judge_dir):
    from everyprompt.config import ConfigError, load_config
    from everyprompt.rewards import GenRMJudge

    with pytest.raises(ValueError, match=r"no \{reference\} field"):
        GenRMJudge(str(judge_dir), "{question} {response}")
    with pytest.raises(ValueError, match="unknown verdicts \\['great'\\]"):
        GenRMJudge(str(judge_dir), "{question} {reference} {response}", values={"great": 2.0})
    with pytest.raises(ConfigError, match="needs rewards.genrm.model"):
        load_config(None, ["rewards.function=genrm"])


def test_a_genrm_run_end_to_end(judge_dir, tmp_path):
    import json

    from everyprompt.pipeline import train
    from tests.conftest import tiny_config

    config = tiny_config(
        "rl.steps=1",
        "rewards.function=genrm",
        f"rewards.genrm.model={judge_dir}",
        "rewards.genrm.max_new_tokens=6",
        "rewards.genrm.log_every=1",
    )
    run_dir = tmp_path / "run"
    train(config, run_dir=run_dir)
    line = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert line["reward/errors"] == 0  # an unreadable verdict is None, not an error
    assert line["reward/genrm_unparseable"] == line["reward/none_fraction"]  # counted on its own
    samples = (run_dir / "genrm_samples.jsonl").read_text().splitlines()
    assert len(samples) == 4  # 2 prompts x 2 samples, every row logged (written by the reward worker)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def foreign_judge(tmp_path_factory):
    """A GPT-OSS judge (no native path: it runs on the hf engine) whose tokenizer has a chat template."""
    from tests.families import family_model

    model, tokenizer = family_model("gpt_oss", seed=2)
    tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("judge") / "gpt_oss"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_judge_of_any_family_renders_its_chat_template_and_judges_in_batches(foreign_judge):
    from everyprompt.rewards import GenRMJudge
    from everyprompt.rewards.pool import RewardPool

    template = "Q {question} R {reference} A {response}"
    judge = GenRMJudge(str(foreign_judge), template, max_new_tokens=6, batch_size=4)
    judge.prepare()
    assert type(judge._engine).__name__ == "HFEngine"
    expected = judge._tokenizer("<|user|>Q 6*7= R 42 A 41<|assistant|>", add_special_tokens=False).input_ids
    assert judge.prompt_ids("Q 6*7= R 42 A 41") == expected
    completions = [str(40 + i) for i in range(6)]
    rows = {"prompt": ["6*7="] * 6, "answer": ["42"] * 6}
    one_at_a_time = [
        GenRMJudge(str(foreign_judge), template, max_new_tokens=6, batch_size=1)(
            [c], prompt=["6*7="], answer=["42"]
        )[0]
        for c in completions
    ]
    assert judge(completions, **rows) == one_at_a_time  # greedy: the batch changes nothing
    with RewardPool(
        GenRMJudge(str(foreign_judge), template, max_new_tokens=6, batch_size=4), workers=1
    ) as pool:
        for key, completion in enumerate(completions):
            pool.submit(key, completion, {"prompt": "6*7=", "answer": "42"})
        assert pool.wait(list(range(6))) == one_at_a_time and pool.stats.errors == 0


@pytest.mark.long  # 9 s on 2 cores: `make test-long`
def test_a_run_scores_with_a_judge_slower_to_load_than_the_call_timeout(judge_dir, tmp_path, monkeypatch):
    import json
    import time

    from everyprompt.pipeline import train
    from everyprompt.rewards import GenRMJudge
    from tests.conftest import tiny_config

    load = GenRMJudge.prepare

    def slow_prepare(self):  # forked reward workers inherit the patch
        if self._engine is None:
            time.sleep(2.0)
        load(self)

    monkeypatch.setattr(GenRMJudge, "prepare", slow_prepare)
    config = tiny_config(
        "rl.steps=2",
        "rewards.function=genrm",
        f"rewards.genrm.model={judge_dir}",
        "rewards.genrm.max_new_tokens=6",
        "rewards.timeout_s=1.0",
    )
    train(config, run_dir=tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["reward/errors"] == 0 for line in lines)
