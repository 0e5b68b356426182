"""On-policy distillation in a run (`rl.teacher`, trainer/learner_side/distill.py): a teacher equal to the student adds
nothing (exactly: no term, no gradient, the same weights as without it), pure distillation moves the student
towards a different teacher, groups without reward signal still learn from the teacher, several teachers by a
data column, and every bad teacher setting exits 2 naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from everyprompt.cli import main
from everyprompt.config import ConfigError, ModelConfig
from everyprompt.models.io import load_model_and_tokenizer, load_pretrained, save_pretrained
from everyprompt.pipeline import train
from tests.conftest import make_tiny_model, tiny_config

# old log-probs from the trainer's own forward; no held-out evaluation (nothing here reads it)
RECOMPUTE = ("sft.steps=0", "rl.old_logprobs=recompute", "eval.num_samples=0", "data.num_eval=2")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A student, a teacher of the same architecture and tokenizer with other weights, and a teacher with
    another tokenizer (the chat preset's BPE)."""
    root = tmp_path_factory.mktemp("models")
    student, tokenizer = make_tiny_model()
    save_pretrained(student, tokenizer, root / "student")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in student.parameters():
            if param.dim() >= 2:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    save_pretrained(student, tokenizer, root / "teacher")
    chat, chat_tokenizer = load_model_and_tokenizer(
        ModelConfig(preset="tiny-chat-moe", hidden_size=32, num_layers=2, num_experts=4, num_heads=2), 0
    )
    save_pretrained(chat, chat_tokenizer, root / "chat")
    return {"student": root / "student", "teacher": root / "teacher", "chat": root / "chat"}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_pretrained(path)[0].state_dict()


def _run(models, run_dir: Path, *extra: str) -> list[dict]:
    train(tiny_config(*RECOMPUTE, f"model.path={models['student']}", *extra), run_dir=run_dir)
    return _rows(run_dir)


def test_a_teacher_equal_to_the_student_adds_nothing(models, tmp_path):
    same = f"rl.teacher.model={models['student']}"
    alone = _run(models, tmp_path / "alone", same, "rl.teacher.mode=alone")
    assert [row["distill/reverse_kl"] for row in alone] == [0.0, 0.0]
    assert [row["actor/grad_norm"] for row in alone] == [0.0, 0.0]
    assert all(row["distill/token_share"] == 1.0 for row in alone)
    start, after = _weights(models["student"]), _weights(tmp_path / "alone" / "checkpoints" / "latest")
    assert all(torch.equal(start[key], after[key]) for key in start)
    # added to GRPO's advantage, the zero term leaves the first update GRPO's to the bit (after it the
    # student has moved away from its starting weights, the teacher's)
    added = _run(models, tmp_path / "added", same, "rl.steps=1")
    _run(models, tmp_path / "grpo", "rl.steps=1")
    grpo = _weights(tmp_path / "grpo" / "checkpoints" / "latest")
    taught = _weights(tmp_path / "added" / "checkpoints" / "latest")
    assert all(torch.equal(grpo[key], taught[key]) for key in grpo)
    assert not all(torch.equal(start[key], grpo[key]) for key in grpo)  # GRPO did move the weights
    assert [row["distill/advantage_share"] for row in added] == [0.0]


def _exact_reverse_kl(student: Path, teacher: Path, texts: list[str]) -> float:
    """KL(student || teacher) over the whole vocabulary, averaged over every next-token position of `texts`."""
    (pi, tokenizer), (mu, _) = load_pretrained(student), load_pretrained(teacher)
    ids = torch.tensor([tokenizer(text)["input_ids"] for text in texts])
    with torch.no_grad():
        log_pi, log_mu = (model(ids).logits.log_softmax(-1) for model in (pi, mu))
    return float((log_pi.exp() * (log_pi - log_mu)).sum(-1).mean())


def test_pure_distillation_moves_the_student_towards_the_teacher(models, tmp_path):
    rows = _run(
        models,
        tmp_path,
        f"rl.teacher.model={models['teacher']}",
        "rl.teacher.mode=alone",
        "rl.steps=8",
        "rl.lr=1e-2",
        "rl.warmup_steps=0",
        "rl.prompts_per_step=4",
        "rl.group_size=4",
        "rl.micro_batch_size=8",
        "rollout.max_new_tokens=8",
    )
    assert (
        rows[0]["distill/reverse_kl"] > 0.5
    )  # a different teacher: the student's samples are unlikely under it
    assert all(row["distill/advantage_share"] == 1.0 for row in rows)  # alone: the only advantage
    # the exact reverse KL at fixed positions (prompts of the same task, not the sampled tokens)
    texts = ["12+34=", "56+78=", "90+12=", "345+6="]
    before = _exact_reverse_kl(models["student"], models["teacher"], texts)
    after = _exact_reverse_kl(tmp_path / "checkpoints" / "latest", models["teacher"], texts)
    assert after < 0.9 * before, (before, after)  # 1.68 -> 1.37 when written
    from everyprompt.report import load_metrics, summarize

    (row,) = [
        r for r in summarize(load_metrics(tmp_path / "metrics.jsonl")) if r["key"] == "distill/reverse_kl"
    ]
    assert "teacher" in row["label"]  # `everyprompt report` shows it


def test_groups_without_reward_signal_still_learn_from_a_teacher(models, tmp_path):
    """Every group all-correct: without a teacher no step updates; with one, each does."""
    constant = ("rewards.function=tests.trainer.flaky_reward:always",)
    plain = _run(models, tmp_path / "plain", *constant)
    assert [row["actor/no_signal_update"] for row in plain] == [1.0, 1.0]
    taught = _run(models, tmp_path / "taught", *constant, f"rl.teacher.model={models['teacher']}")
    assert [row["actor/no_signal_update"] for row in taught] == [0.0, 0.0]
    assert all(row["distill/advantage_share"] == 1.0 for row in taught)  # GRPO's advantages are all 0


def test_several_teachers_each_for_the_prompts_its_column_value_selects(models, tmp_path):
    rows = _run(
        models,
        tmp_path,
        "rl.teacher.by=level",
        f"rl.teacher.models={{1: {models['teacher']}, 2: {models['student']}}}",
        "data.levels=[1,2,3]",
        "rl.levels=[1,2,3]",
        "rl.prompts_per_step=6",
        "rl.micro_batch_size=12",
        "rl.mini_batches=1",  # a step's figures are one update's (two would be averaged, ratio by ratio)
    )
    shares = [row["distill/token_share"] for row in rows]
    assert all(0.0 < share < 1.0 for share in shares), shares  # level-3 prompts have no teacher
    for row in rows:  # each teacher's own figures: their shares add up to the whole's
        assert row["distill/1/token_share"] + row["distill/2/token_share"] == pytest.approx(
            row["distill/token_share"]
        )
        both = (
            row["distill/1/reverse_kl"] * row["distill/1/token_share"]
            + row["distill/2/reverse_kl"] * row["distill/2/token_share"]
        )
        assert both == pytest.approx(row["distill/reverse_kl"] * row["distill/token_share"], rel=1e-6)
    # at the first step, teacher 2 is the student's own starting weights: its rows add nothing (to rounding:
    # it scores its rows alone, the policy all of them at once), teacher 1's do
    assert abs(rows[0]["distill/2/reverse_kl"]) < 1e-6 and rows[0]["distill/1/reverse_kl"] > 0.1
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())["rl"]["teacher"]
    assert written["by"] == "level" and written["models"] == {
        "1": str(models["teacher"]),
        "2": str(models["student"]),
    }


def _exit_code(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["train", *tiny_config_overrides(), *overrides, "--run-dir", "unused-run"])
    return code, capsys.readouterr().err


def tiny_config_overrides() -> list[str]:
    from tests.conftest import SYNCHRONOUS, TINY_OVERRIDES

    return [*TINY_OVERRIDES, *SYNCHRONOUS, "sft.steps=0"]


def test_a_teacher_with_another_tokenizer_exits_2_naming_both(models, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _exit_code(capsys, f"model.path={models['student']}", f"rl.teacher.model={models['chat']}")
    assert code == 2
    flat = " ".join(err.split())
    assert "rl.teacher.model" in flat and str(models["chat"]) in flat and str(models["student"]) in flat
    assert "tokenizer" in flat and "Traceback" not in err


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["rl.teacher.model=no/such-teacher-dir/x"], "rl.teacher.model"),
        (["rl.teacher.model=EMPTY"], "rl.teacher.model"),
        (["rl.teacher.by=difficulty", "rl.teacher.models={1: STUDENT}"], "rl.teacher.by"),
        (["rl.teacher.by=level", "rl.teacher.models={9: STUDENT}"], "rl.teacher.models"),
        (["rl.teacher.models={1: STUDENT}"], "'rl.teacher': several teachers need both by and models"),
        (
            ["rl.teacher.model=STUDENT", "rl.teacher.by=level", "rl.teacher.models={1: STUDENT}"],
            "'rl.teacher': name one",
        ),
        (["rl.teacher.model=STUDENT", "rl.teacher.coef=0"], "rl.teacher.coef"),
        (["rl.teacher.model=STUDENT", "rl.teacher.mode=replace"], "rl.teacher.mode"),
        (["rl.teacher.temperature=2"], "rl.teacher.temperature"),
    ],
)
def test_a_bad_teacher_setting_exits_2_naming_its_key(
    models, capsys, tmp_path, monkeypatch, overrides, named
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    paths = {"STUDENT": str(models["student"]), "EMPTY": str(tmp_path / "empty")}
    for word, path in paths.items():
        overrides = [o.replace(word, path) for o in overrides]
    code, err = _exit_code(capsys, f"model.path={models['student']}", *overrides)
    assert code == 2, err
    assert named in err and "Traceback" not in err
    assert not (tmp_path / "unused-run" / "metrics.jsonl").exists()


def test_teacher_settings_in_the_config_schema():
    with pytest.raises(ConfigError, match="one teacher"):
        tiny_config("rl.teacher.model=a", "rl.teacher.by=level", "rl.teacher.models={1: b}")
    with pytest.raises(ConfigError, match="by"):
        tiny_config("rl.teacher.models={1: b}")
    section = tiny_config("rl.teacher.by=level", "rl.teacher.models={1: a, 2: b}").rl.teacher
    assert section.enabled and section.named() == {"1": "a", "2": "b"}  # values matched as text
    assert not tiny_config().rl.teacher.enabled


def test_each_row_is_scored_by_the_teacher_its_column_value_names(models):
    from everyprompt.batch import RolloutBatch
    from everyprompt.trainer.learner_side.distill import Distillation
    from everyprompt.trainer.learner_side.forward import PolicyForward

    config = tiny_config(
        "rl.teacher.by=level", f"rl.teacher.models={{1: {models['teacher']}, 2: {models['student']}}}"
    )
    distill = Distillation(config, torch.device("cpu"))
    student, tokenizer = load_pretrained(models["student"])
    teacher, _ = load_pretrained(models["teacher"])
    batch = RolloutBatch(
        prompt_ids=[[1, 5, 6], [1, 7], [1, 8, 9, 10]],
        completion_ids=[[11, 12], [13, 14, 15], [16]],
        rollout_logprobs=[torch.zeros(2), torch.zeros(3), torch.zeros(1)],
        finish_reason=["eos"] * 3,
        group_index=torch.tensor([0, 1, 2]),
        prompt_index=[0, 1, 2],
        teacher_keys=["1", "2", "3"],  # the third prompt's level has no teacher
    )
    data = batch.padded([0, 1, 2], tokenizer.pad_token_id)
    forward = PolicyForward(student.eval(), None, None, False, config, tokenizer.pad_token_id)
    logp, covered, each = distill.scores(forward, data, slice(0, 3), [0, 1, 2], batch)
    assert covered.tolist() == [True, True, False]
    assert {name: rows.tolist() for name, rows in each.items()} == {
        "1": [True, False, False],
        "2": [False, True, False],
    }
    mask = data["mask"].bool()
    by_teacher, by_student = (forward.frozen_logprobs(m, data, slice(0, 3)) for m in (teacher, student))
    torch.testing.assert_close(logp[0][mask[0]], by_teacher[0][mask[0]], rtol=0, atol=1e-6)
    torch.testing.assert_close(logp[1][mask[1]], by_student[1][mask[1]], rtol=0, atol=1e-6)
    assert not torch.equal(by_teacher[0][mask[0]], by_student[0][mask[0]])  # the two teachers differ
    assert logp[2].abs().sum() == 0


def test_several_teachers_by_a_column_of_a_data_file(models, tmp_path):
    """A data file's own column picks the teacher: `task` math rows are taught, the others are not."""
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "task": "math" if a % 2 else "copy"}
        for a, b in [(12, 34), (51, 7), (23, 45), (66, 11), (37, 28), (40, 2), (19, 19), (8, 80)]
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    metrics = _run(
        models,
        tmp_path / "run",
        f"data.train_file={tmp_path / 'train.jsonl'}",
        "rl.teacher.by=task",
        f"rl.teacher.models={{math: {models['teacher']}}}",
        "rl.prompts_per_step=4",
        "rl.micro_batch_size=8",
    )
    shares = [row["distill/token_share"] for row in metrics]
    assert all(0.0 < share < 1.0 for share in shares), shares  # each step drew prompts of both tasks
    assert any(row["distill/reverse_kl"] != 0.0 for row in metrics)


def test_without_a_teacher_the_advantage_term_changes_nothing():
    """The learner's advantage term when rl.teacher names none: every one of its steps a no-op, so the
    learner asks no "is there a teacher?" of its own."""
    from everyprompt.trainer.learner_side.distill import AdvantageTerm, Distillation, advantage_term

    term = advantage_term(tiny_config(), torch.device("cpu"))
    assert type(term) is AdvantageTerm and not isinstance(term, Distillation)
    still = torch.tensor([True, False, True])
    assert term.prepare(None, still) is still and term.carries(None) is False
    assert term.scores(None, {}, slice(0, 2), [0, 1], None) is None
    estimated = torch.tensor([0.5, -0.5])
    advantages, sums = term.advantages(None, torch.zeros(2, 3), estimated, torch.ones(2, 3))
    assert advantages is estimated and sums == {}
    stats = {"loss/policy": 1.0}
    term.finish(stats, 10.0)
    assert stats == {"loss/policy": 1.0}
