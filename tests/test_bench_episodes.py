"""bench/environments/episodes.py: what an environment's observation costs a multi-turn rollout, and the same workload
on another git revision's engine (a temporary worktree) as the reference; bench/environments/stepwise.py: step-wise
episodes scheduled continuously against round by round."""

from __future__ import annotations

import json
import subprocess

import pytest
from bench.environments import episodes


@pytest.mark.long  # 15 s on 2 cores: `make test-long`
def test_the_episodes_bench_reports_each_observation_length(tmp_path, capsys):
    out = tmp_path / "episodes.json"
    episodes.main(["--tiny", "--observation", "8", "32", "--max-new-tokens", "256", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [row["observation"] for row in rows] == [8, 32]
    for row in rows:  # 16 episodes, three observations each (unless the cap cut one)
        assert 0 < row["observation_tokens"] <= 16 * 3 * row["observation"]
        assert row["extends"] >= 1 and row["extend_s"] > 0 and row["observation_token_cost"] > 0
        # the observations took no decode step: about one a model token (a turn's last is fed, the cap's not)
        assert row["decode_steps"] <= row["model_tokens"]
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow  # two engines' processes, each importing torch (~25 s)
def test_against_a_revision_the_bench_measures_its_engine_too_and_removes_the_worktree(tmp_path):
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout
    out = tmp_path / "episodes.json"
    episodes.main(["--tiny", "--observation", "32", "--max-new-tokens", "256", "--against", "HEAD",
                   "--rounds", "1", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    (compared,) = result["compared"]
    assert result["reference"] == "HEAD" and len(result["reference_rows"]) == 1
    assert compared["same_tokens"] and compared["ratio"] > 0
    assert subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout == worktrees


def test_the_stepwise_bench_compares_both_schedules_on_the_same_turns(tmp_path):
    from bench.environments import stepwise

    out = tmp_path / "stepwise.json"
    stepwise.main(["--tiny", "--turns", "2", "--latency", "0.05", "--rounds", "1", "--out", str(out)])
    (compared,) = json.loads(out.read_text())["compared"]
    assert compared["latency_s"] == 0.05 and compared["same_turns"] and compared["turns"] > 8  # past turn 1
    assert compared["continuous_wall_s"] > 0 and compared["rounds_wall_s"] > 0 and compared["ratio"] > 0
