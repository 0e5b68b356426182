"""The startup parity check: engine and trainer score the same completions before the first RL step."""

from __future__ import annotations

import json

from everyprompt.cli import main
from everyprompt.pipeline import train
from everyprompt.rollout.native import attention as native_attention
from tests.conftest import TINY_OVERRIDES, tiny_config


def test_the_gap_is_logged_with_the_first_step(tmp_path):
    train(tiny_config("rl.steps=2"), run_dir=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= lines[0]["parity/logp_abs_diff"] < 1e-5 and lines[0]["parity/tokens"] > 0
    assert "parity/logp_abs_diff" not in lines[1]


def test_a_wrong_fast_path_stops_the_run_naming_the_gap_and_the_engine(tmp_path, capsys, monkeypatch):
    tables = native_attention.rope_tables

    def wrong_rope(config, head_dim):  # a fast path that gets the rotary frequencies slightly wrong
        inv_freq, scale = tables(config, head_dim)
        return inv_freq * 1.5, scale

    monkeypatch.setattr(native_attention, "rope_tables", wrong_rope)
    code = main(["train", *TINY_OVERRIDES, "rollout.engine=native", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in err[-1]
    assert "the native engine's log-probs of this qwen3_moe model differ from the trainer's by" in err[-1]
    assert "rollout.engine=hf" in err[-1]
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before the first RL step
    capsys.readouterr()
    code = main(
        [
            "train",
            *TINY_OVERRIDES,
            "rollout.engine=native",
            "rollout.parity_threshold=0",
            "--run-dir",
            str(tmp_path / "unchecked"),
        ]
    )
    assert code == 0  # the check turned off: the run goes on, wrong as it is
    first = json.loads((tmp_path / "unchecked" / "metrics.jsonl").read_text().splitlines()[0])
    assert "parity/logp_abs_diff" not in first
