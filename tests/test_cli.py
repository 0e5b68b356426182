"""Smoke tests of every entry point on a tiny model."""

import json
import subprocess
import sys

import pytest

from everyprompt.cli import main
from tests.conftest import TINY_OVERRIDES


def test_train_two_steps_then_eval_then_resume(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_OVERRIDES, "--run-dir", str(run)]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert main(["eval", str(run), *TINY_OVERRIDES, "--run-dir", str(tmp_path / "ev")]) == 0
    results = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert 0.0 <= results["greedy_accuracy"] <= 1.0 and "pass@2/level_1" in results
    # without a config, a run's checkpoint is evaluated with the run's own config (10 held-out prompts,
    # not the demo's 500), the command line's overrides on top
    capsys.readouterr()
    checkpoint = run / "checkpoints" / "step_2"
    assert main(["eval", str(checkpoint), "data.num_eval=4", "eval.num_samples=0"]) == 0
    assert "the run's own" in capsys.readouterr().err
    results = json.loads((checkpoint / "eval" / "eval.json").read_text())
    assert results["num_prompts"] == 4 and "pass@2" not in results
    assert main(["eval", str(run), "eval.num_samples=0", "--run-dir", str(tmp_path / "ev2")]) == 0
    assert json.loads((tmp_path / "ev2" / "eval.json").read_text())["num_prompts"] == 10
    assert main(["train", "--resume", str(run), "rl.steps=3"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


def test_eval_on_a_prompt_file(tmp_path):
    run = tmp_path / "run"
    assert main(["sft", *TINY_OVERRIDES, "--run-dir", str(run)]) == 0
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1=", "gold": "2"}\n{"question": "2+3=", "gold": "5"}\n')
    code = main(
        [
            "eval",
            str(run / "checkpoints" / "sft"),
            *TINY_OVERRIDES,
            "--data",
            str(data),
            "--prompt-field",
            "question",
            "--answer-field",
            "gold",
            "--run-dir",
            str(tmp_path / "ev"),
        ]
    )
    assert code == 0
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["num_prompts"] == 2


def test_demo_writes_summary(tmp_path, capsys):
    assert main(["demo", *TINY_OVERRIDES, "--seed", "3", "--run-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("accuracy_before_rl", "accuracy_after_rl", "wall_seconds", "run_dir"):
        assert key in summary
    assert summary["seed"] == 3
    assert summary["machine"]["cpu_capability"] and summary["machine"]["torch_threads"] >= 1
    assert "Held-out accuracy before and after RL" in capsys.readouterr().out
    # the report of that run: tables, curves of both phases, the demo's before/after
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "training accuracy" in out and "SFT loss" in out and "demo: held-out greedy accuracy" in out
    for name in ("summary.md", "summary.json", "rl_curves.png", "sft_curves.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert "Demo: held-out greedy accuracy" in (tmp_path / "report" / "summary.md").read_text()


def test_score_command(tmp_path, capsys):
    data = tmp_path / "c.jsonl"
    data.write_text(
        '{"completion": "so |85", "answer": "85", "id": 1}\n{"completion": "84", "answer": "85"}\n'
    )
    out = tmp_path / "scored.jsonl"
    assert main(["score", str(data), "--reward", "math", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reward"] for r in rows] == [1.0, 0.0] and rows[0]["id"] == 1


def test_score_renamed_fields_and_bad_row(tmp_path, capsys):
    data = tmp_path / "c.jsonl"
    data.write_text('{"text": "#### 3", "gold": 3}\n')
    assert main(["score", str(data), "--completion-field", "text", "--answer-field", "gold"]) == 0
    assert json.loads(capsys.readouterr().out)["reward"] == 1.0
    data.write_text('{"text": "#### 3", "gold": 3}\n{"text": oops}\n')
    assert main(["score", str(data), "--completion-field", "text", "--answer-field", "gold"]) == 2
    assert "c.jsonl:2: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "/nonexistent/ckpt"],
        ["score", "x.jsonl", "--reward", "nope"],
        ["filter", "builtin", "--model", "/nonexistent/ckpt"],
        ["filter", "/nonexistent/prompts.jsonl", "--model", "/nonexistent/ckpt"],
        ["report", "/nonexistent/run"],
    ],
)
def test_bad_paths_exit_2(argv, capsys, tmp_path):
    if argv[0] == "score":
        (tmp_path / "x.jsonl").write_text('{"completion": "1", "answer": "1"}\n')
        argv = ["score", str(tmp_path / "x.jsonl"), "--reward", "nope"]
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "everyprompt.cli", "train", "rl.nope=1"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "everyprompt: config error: unknown config key 'rl.nope' (valid keys here: "
        + ", ".join(sorted(__import__("everyprompt.config").config.RLConfig.model_fields))
        + ")"
    )


def test_overrides_may_follow_the_options(capsys):
    # the override is taken (and rejected by the config), not an argparse error
    assert main(["filter", "builtin", "--model", "/nonexistent/ckpt", "rl.bogus=1"]) == 2
    assert "unknown config key 'rl.bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["filter", "builtin", "--model", "/nonexistent/ckpt", "--bogus"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["score", "x.jsonl", "rl.steps=3"])  # score takes no config overrides


@pytest.mark.parametrize(
    "argv",
    [
        ["score", "{missing}"],
        ["score", "{binary}"],
        ["eval", "{missing}"],
        ["filter", "{missing}", "--model", "{missing}"],
        ["train", "{missing}.yaml"],
        ["train", "--resume", "{missing}"],
        ["report", "{missing}"],
    ],
)
def test_every_command_given_a_missing_or_unreadable_file_exits_2_naming_it(tmp_path, capsys, argv):
    (tmp_path / "binary.jsonl").write_bytes(b'{"completion": "1", "answer": "1"}\n\xff\xfe\n')
    names = {"missing": str(tmp_path / "missing.jsonl"), "binary": str(tmp_path / "binary.jsonl")}
    args = [a.format(**names) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    named = names["binary"] + ":2" if "{binary}" in argv else names["missing"]
    assert err.startswith("everyprompt: ") and named in err and "Traceback" not in err


def test_a_config_path_holding_an_equals_sign_is_a_file_not_an_override(tmp_path):
    """A sweep names its run directories `arm,seed=1`: their config.yaml is a file to read, and a missing
    one is named as a file."""
    from everyprompt.cli.args import is_override, split_config_args

    cell = tmp_path / "levels,seed=4"
    cell.mkdir()
    (cell / "config.yaml").write_text("seed: 4\nrl:\n  steps: 3\n")
    path = str(cell / "config.yaml")
    assert split_config_args([path, "rl.steps=5"]) == (path, ["rl.steps=5"])
    assert is_override("data.reasoning_gym.tasks.leg_counting.weight=2") and is_override("seed=1")
    assert not is_override(str(cell / "other.yaml"))  # not a key before the `=`: a (missing) file
    run = tmp_path / "run"
    assert main(["train", path, *TINY_OVERRIDES, "rl.steps=1", "--run-dir", str(run)]) == 0
    assert "seed: 4" in (run / "config.yaml").read_text()


def test_a_start_that_fails_before_its_first_step_leaves_no_run_directory(tmp_path, capsys, monkeypatch):
    """A bad data row stops the start (exit 2, one line) after the run directory was made: it is removed
    again; a directory that existed before (an earlier run's, a sweep's cell) is kept."""
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "no answer"\n')
    argv = ["train", *TINY_OVERRIDES, f"data.train_file={bad}", f"data.eval_file={bad}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "train.jsonl:2:" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    kept = tmp_path / "earlier"
    kept.mkdir()
    assert main([*argv, "--run-dir", str(kept)]) == 2
    assert kept.is_dir() and (kept / "config.yaml").is_file()
