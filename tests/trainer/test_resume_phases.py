"""A run cut short in any phase continues to the result of an uninterrupted run (item: resume from any
phase). The cut is an exception raised right after a step is logged, as a kill there would leave it."""

from __future__ import annotations

import json

import pytest
import torch

from everyprompt.data.passrate import PassRateStore
from everyprompt.pipeline import Run, train
from everyprompt.trainer.metrics import MetricsLogger
from tests.conftest import tiny_config


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs (not even `except Exception` handlers)."""


def _kill_after(monkeypatch, phase: str, step: int) -> None:
    real_log = MetricsLogger.log

    def log(self, at, metrics):
        real_log(self, at, metrics)
        if self._description == phase and at == step:
            raise Killed

    monkeypatch.setattr(MetricsLogger, "log", log)


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _assert_same_parameters(a, b) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=name)


def test_sft_cut_short_continues_from_its_checkpoint(tmp_path, monkeypatch):
    options = ("sft.steps=5", "sft.checkpoint_every=2", "rl.steps=1")
    straight = Run(tiny_config(*options), tmp_path / "straight").warm_started_model()[0]
    with monkeypatch.context() as patch:
        _kill_after(patch, "SFT", 3)
        with pytest.raises(Killed):
            Run(tiny_config(*options), tmp_path / "cut").warm_started_model()
    assert (tmp_path / "cut" / "checkpoints" / "sft_step_2").is_dir()
    resumed = Run(tiny_config(*options), tmp_path / "cut").warm_started_model()[0]
    _assert_same_parameters(straight, resumed)
    assert _steps(tmp_path / "cut" / "sft" / "metrics.jsonl") == [1, 2, 3, 4, 5]  # step 3 once
    assert not list((tmp_path / "cut" / "checkpoints").glob("sft_step_*"))  # the finished SFT cleans up


@pytest.mark.long  # 11 s on 2 cores: `make test-long`
@pytest.mark.parametrize("zve", [False, True])
def test_rl_cut_short_before_its_first_checkpoint_restarts_rl_exactly(tmp_path, monkeypatch, zve):
    options = ["rl.steps=3", "checkpoint.every=0"]
    if zve:
        options += [
            "zve.enabled=true",
            "zve.filter.enabled=true",
            "zve.filter.samples=2",
            "rewards.function=tests.trainer.flaky_reward:parity",
        ]
    straight = train(tiny_config(*options), run_dir=tmp_path / "straight")
    with monkeypatch.context() as patch:
        _kill_after(patch, "RL", 2)
        with pytest.raises(Killed):
            train(tiny_config(*options), run_dir=tmp_path / "cut")
    assert not (tmp_path / "cut" / "checkpoints" / "latest").exists()
    resumed = train(tiny_config(*options), run_dir=tmp_path / "cut", resume=True)
    assert resumed.step == 3 and _steps(tmp_path / "cut" / "metrics.jsonl") == [1, 2, 3]
    _assert_same_parameters(straight.model, resumed.model)
    stores = [
        PassRateStore(tmp_path / name / "passrates.sqlite").state_dict() for name in ("straight", "cut")
    ]
    assert stores[0] == stores[1]


def test_rl_resumed_from_a_checkpoint_logs_each_step_once(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        _kill_after(patch, "RL", 3)  # checkpoints at 1 and 2; step 3 logged, then killed
        with pytest.raises(Killed):
            train(tiny_config("rl.steps=4"), run_dir=tmp_path)
    resumed = train(tiny_config("rl.steps=4"), run_dir=tmp_path, resume=True)
    assert resumed.step == 4 and _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
