"""Where a run's records go besides metrics.jsonl: wandb (the calls by hand with a stand-in, then the real
library offline) and the run's own warnings.log."""

from __future__ import annotations

import json
import logging
import sys
import time
import types
from pathlib import Path

import pytest

from everyprompt.cli import main
from everyprompt.config import ConfigError, WandbConfig
from everyprompt.pipeline import Run
from everyprompt.trainer.metrics import MetricsLogger
from tests.conftest import TINY_OVERRIDES, tiny_config

ROOT = Path(__file__).resolve().parents[2]


class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, data, step):
        self.calls.append(("log", step, data))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: calls.append(("init", kwargs)) or _FakeRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_gets_the_same_records_and_the_resolved_config(tmp_path, fake_wandb):
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 3\nrl:\n  loss: espo\n")
    settings = WandbConfig(project="ablations", mode="offline", entity="team")
    logger = MetricsLogger(
        run_dir / "sft", 2, "SFT", progress=False, tensorboard=False, wandb=settings, run_root=run_dir
    )
    logger.log(1, {"sft/loss": 2.5, "time/step_s": 0.1, "note": "not a number"})
    logger.log(2, {"sft/loss": float("nan")})
    logger.close()
    (kind, init), *logs, finish = fake_wandb
    assert kind == "init" and finish == ("finish",)
    assert init["project"] == "ablations" and init["mode"] == "offline" and init["entity"] == "team"
    assert init["config"] == {"seed": 3, "rl": {"loss": "espo"}}
    assert init["group"] == "my-run" and init["name"] == "my-run/sft" and init["job_type"] == "sft"
    assert init["id"].endswith("-sft") and init["resume"] == "allow" and init["dir"] == str(run_dir.resolve())
    assert logs[0] == ("log", 1, {"sft/loss": 2.5, "time/step_s": 0.1})
    assert logs[1][1] == 2 and logs[1][2]["sft/loss"] != logs[1][2]["sft/loss"]  # NaN passed on as NaN
    # the metrics file got the same records
    lines = [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]


@pytest.mark.parametrize("settings", [WandbConfig(), WandbConfig(project="p", mode="disabled")])
def test_no_project_or_disabled_no_wandb(tmp_path, fake_wandb, settings):
    logger = MetricsLogger(tmp_path, 1, "RL", progress=False, tensorboard=False, wandb=settings)
    logger.log(1, {"reward/mean": 1.0})
    logger.close()
    assert fake_wandb == []


def test_a_project_without_wandb_installed_stops_the_run_at_its_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match="logging.wandb.project.*everyprompt\\[wandb\\]"):
        Run(tiny_config("logging.wandb.project=p"), tmp_path / "run")
    code = main(["train", *TINY_OVERRIDES, "logging.wandb.project=p", "--run-dir", str(tmp_path / "cli")])
    assert code == 2 and "pip install 'everyprompt[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "cli" / "metrics.jsonl").exists()


@pytest.mark.long  # 6 s on 2 cores: `make test-long`
def test_wandb_offline_for_real(tmp_path, monkeypatch):
    """The real library in offline mode: its run file holds our keys, values and config."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("rl:\n  loss: espo_marker\n")
    logger = MetricsLogger(
        run_dir, 3, "RL", progress=False, tensorboard=False, wandb=WandbConfig(project="t", mode="offline")
    )
    for step in (1, 2, 3):
        logger.log(step, {"reward/accuracy_marker": 0.125 * step})
    logger.close()
    (record,) = list((run_dir / "wandb").glob("offline-run-*-rl/run-*.wandb"))
    # wandb's service closes the file a moment after `finish()` returns (only its header was there once,
    # on a loaded machine): read it until its records are in, for up to 120 s
    deadline = time.monotonic() + 120
    while b"0.375" not in (data := record.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert data.count(b"reward/accuracy_marker") >= 3 and b"0.375" in data and b"espo_marker" in data


def test_warnings_are_kept_in_the_run_directory_and_still_shown(tmp_path, capsys):
    log = logging.getLogger("everyprompt.rewards.test")
    Run(tiny_config(), tmp_path / "first")
    log.warning("first run's warning")
    Run(tiny_config(), tmp_path / "second")  # one run directory at a time
    log.warning("second run's warning")
    log.info("not a warning")
    assert (tmp_path / "first" / "warnings.log").read_text().count("warning") == 1
    second = (tmp_path / "second" / "warnings.log").read_text()
    assert "second run's warning" in second and "not a warning" not in second


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
def test_a_warning_still_reaches_the_console_outside_pytest(tmp_path):
    """With no logging set up (the CLI), a warning is printed as Python prints it, and kept in the file."""
    import subprocess

    code = (
        "import logging, sys; from everyprompt.pipeline import Run; from tests.conftest import tiny_config; "
        f"Run(tiny_config(), {str(tmp_path)!r}); logging.getLogger('everyprompt.x').warning('look here')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stderr.strip().endswith("look here")
    assert "look here" in (tmp_path / "warnings.log").read_text()


def test_the_progress_line_counts_steps_without_signal(tmp_path):
    from io import StringIO

    from rich.console import Console

    out = StringIO()
    logger = MetricsLogger(tmp_path, 3, "RL", tensorboard=False, console=Console(file=out, width=200))
    logger.log(1, {"reward/mean": 0.5, "actor/no_signal_update": 0.0})
    logger.log(2, {"reward/mean": 1.0, "actor/no_signal_update": 1.0})
    logger.log(3, {"reward/mean": 1.0, "actor/no_signal_update": 1.0})
    logger.close()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("RL step")]
    assert "no-signal" not in lines[0] and lines[1].endswith("no-signal steps 1"), lines
    assert lines[2].endswith("no-signal steps 2")
