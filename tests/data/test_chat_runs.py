"""`everyprompt train` on a chat checkpoint with a GSM8K-style file: columns mapped, chat rendering shown,
SFT on the file's worked answers; bad data set-ups exit 2 naming the file or the key."""

from __future__ import annotations

import json

import pytest

from everyprompt.cli import main
from tests.conftest import TINY_OVERRIDES
from tests.families import save_chat_checkpoint

PROBLEMS = [(a, b) for a in range(2, 6) for b in range(3, 6)]


def _gsm8k_rows():
    return [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"He has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in PROBLEMS
    ]


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    rows = _gsm8k_rows()
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "test.json").write_text(json.dumps(rows[:4]))  # a JSON array, as datasets' to_json(lines=False)
    corpus = [r["question"] + " " + r["answer"] for r in rows]
    return root, save_chat_checkpoint(root / "model", corpus)


def _argv(root, checkpoint, run, *extra):
    return [
        "train",
        *TINY_OVERRIDES,
        f"model.path={checkpoint}",
        f"data.train_file={root / 'train.jsonl'}",
        f"data.eval_file={root / 'test.json'}",
        "data.columns.prompt=question",
        "rewards.function=math",
        *extra,
        "--run-dir",
        str(run),
    ]


def test_train_on_a_gsm8k_style_file_with_a_chat_checkpoint(chat_setup, tmp_path, capsys):
    root, checkpoint = chat_setup
    argv = _argv(
        root,
        checkpoint,
        tmp_path / "run",
        "data.columns.solution=answer",
        "data.system_prompt=Solve it.",
        "data.template_kwargs.enable_thinking=false",
        "sft.steps=2",
    )
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "SFT prompt 1 as the model sees it (data.format=chat):" in err
    assert "RL prompt 1 as the model sees it (data.format=chat):" in err
    shown = "'<|im_start|>system\\nSolve it.<|im_end|>\\n<|im_start|>user\\nTom has"
    assert shown in err and "<think>\\n\\n</think>\\n\\n'" in err  # the rendered text, thinking switched off
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    sft = [json.loads(line) for line in (tmp_path / "run" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(sft) == 2 and all(line["sft/loss"] > 0 for line in sft)


def test_sft_without_solutions_is_a_config_error(chat_setup, tmp_path, capsys):
    root, checkpoint = chat_setup
    run = tmp_path / "run"
    assert main(_argv(root, checkpoint, run, "sft.steps=2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert (
        "config key 'sft.steps'" in err[0] and "train.jsonl" in err[0] and "data.columns.solution" in err[0]
    )
    assert not (run / "checkpoints").exists()


def test_a_missing_column_exits_2_naming_the_file_and_its_columns(chat_setup, tmp_path, capsys):
    root, checkpoint = chat_setup
    argv = _argv(root, checkpoint, tmp_path / "run", "sft.steps=0", "data.columns.prompt=problem")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "train.jsonl: no column 'problem' for `prompt` (data.columns.prompt)" in err[0]
    assert "['answer', 'question']" in err[0]


@pytest.mark.long  # 19 s on 2 cores: `make test-long`
def test_the_cpu_twin_config_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """configs/gsm8k-qwen3-moe-cpu.yaml as shipped (its data paths are relative to the repository root),
    shortened: SFT on chat data, RL with LoRA on attention, experts and routers, then the evaluation."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    run = tmp_path / "twin"
    shorter = ["sft.steps=4", "rl.steps=2", "checkpoint.every=1", "eval.num_samples=1", "eval.pass_k=1"]
    argv = ["train", "configs/gsm8k-qwen3-moe-cpu.yaml", *shorter, "logging.progress=false"]
    assert main([*argv, "--run-dir", str(run)]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "RL prompt 1 as the model sees it (data.format=chat)" in err and "held-out after RL step 2" in err
    assert (run / "checkpoints" / "step_2" / "adapter_model.safetensors").is_file()
    assert json.loads((run / "eval.json").read_text())["num_prompts"] == 60
