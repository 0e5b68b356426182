"""A stop signal sent to the run's whole process group, as GNU `timeout`, Slurm's `scancel`, a job runner
or a terminal's Ctrl-C send it: the run ends its step, writes the checkpoint and prints the resume line
(or, where there was no step to finish, stops at once and says what it kept); its children (reward
workers, an environment server) do not die under it; no traceback; no process left; and the resumed run
continues exactly as an uninterrupted one."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from everyprompt.processes import descendants, is_alive
from tests.conftest import SYNCHRONOUS, TINY_OVERRIDES, computed_figures

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")

STEPS = 4
WORKERS = [*TINY_OVERRIDES, *SYNCHRONOUS, "rewards.function=tests.trainer.flaky_reward:slow_scattered",
           "rewards.workers=3", "checkpoint.every=0"]  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]  # the tests' rewards are imported as `tests.…`


def _train(run_dir: Path, args: list[str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "everyprompt.cli", "train", *args, *extra, "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # a group of its own, which the test signals as `timeout` would
    )


def _finish(run_dir: Path, args: list[str]) -> None:
    """The run to its end: resumed where it has a start, else (a start that left nothing) afresh."""
    if (run_dir / "config.yaml").is_file():
        done = subprocess.run(
            [sys.executable, "-m", "everyprompt.cli", "train", "--resume", str(run_dir), f"rl.steps={STEPS}"],
            capture_output=True, text=True, cwd=ROOT, timeout=600,
        )  # fmt: skip
    else:
        done = subprocess.run(
            [sys.executable, "-m", "everyprompt.cli", "train", *args, f"rl.steps={STEPS}", "--run-dir",
             str(run_dir)], capture_output=True, text=True, cwd=ROOT, timeout=600,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr


def _figures(run_dir: Path) -> list[dict]:  # a resumed run checks the engine against the trainer again
    return [{k: v for k, v in r.items() if not k.startswith("parity/")} for r in computed_figures(run_dir)]


def _same(mine: list[dict], theirs: list[dict]) -> None:
    assert [r["step"] for r in mine] == [r["step"] for r in theirs]
    for a, b in zip(mine, theirs):
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert math.isclose(value, b[key], rel_tol=1e-6, abs_tol=1e-9), (a["step"], key, value, b[key])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("straight")
    _finish(run_dir, WORKERS)
    return _figures(run_dir)


def _wait_until(process: subprocess.Popen, ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, f"the run ended first: {process.stderr.read()}"
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.02)


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


def _stop(run: subprocess.Popen, signum: int, twice: bool = False) -> tuple[int, str, set[int]]:
    """`signum` to the run's group (twice, 0.1 s apart, with `twice`); its exit code, stderr and the
    processes it had started."""
    children = descendants(run.pid)
    try:
        os.killpg(run.pid, signum)
        if twice:
            time.sleep(0.1)
            if run.poll() is None:
                os.killpg(run.pid, signum)
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    return run.returncode, err, children


def _none_left(children: set[int]) -> None:
    deadline = time.monotonic() + 10
    while any(is_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in children if is_alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


# (signal, RL steps logged before it is sent, then seconds more): the first step's rewards in flight,
# between two steps, the middle of a later step, Ctrl-C's SIGINT as well as SIGTERM
MOMENTS = [
    (signal.SIGTERM, 0, 0.15),  # right after RL began (sampling the first step, rewards in flight)
    (signal.SIGTERM, 1, 0.0),
    (signal.SIGTERM, 1, 0.25),
    (signal.SIGINT, 1, 0.1),
    (signal.SIGINT, 2, 0.3),
    (signal.SIGTERM, 2, 0.05),
]


@pytest.mark.long
@pytest.mark.parametrize(("signum", "after", "delay"), MOMENTS)
def test_a_group_signal_during_rl_checkpoints_resumes_exactly_and_leaves_nothing(
    tmp_path, uninterrupted, signum, after, delay
):
    run = _train(tmp_path, WORKERS, "rl.steps=40")
    metrics = tmp_path / "metrics.jsonl"
    began = tmp_path / "checkpoints"  # (nothing there before RL; the log says when RL started)
    # after=0: once SFT's checkpoint is written, the trainer is built and RL's first step starts
    _wait_until(run, lambda: _lines(metrics) >= after and (began / "sft").is_dir())
    time.sleep(delay)
    code, err, children = _stop(run, signum)
    assert len(children) >= 3  # the reward workers were running
    assert code == 128 + signum, err
    assert "Traceback" not in err and "Error" not in err, err
    steps = _lines(metrics)
    if steps:
        assert (began / "latest").resolve().name == f"step_{steps}"
        assert f"continue with: everyprompt train --resume {tmp_path}" in err
    else:  # it landed while the trainer was being built: nothing to finish, SFT's checkpoint kept
        assert after == 0 and "stopped at once" in err, err
    _none_left(children)
    _finish(tmp_path, WORKERS)
    _same(_figures(tmp_path), uninterrupted[: len(_figures(tmp_path))])
    assert len(_figures(tmp_path)) == STEPS


@pytest.mark.long
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_group_signal_stops_at_once_without_a_traceback(tmp_path, uninterrupted, signum):
    run = _train(tmp_path, WORKERS, "rl.steps=40")
    _wait_until(run, lambda: _lines(tmp_path / "metrics.jsonl") >= 1)
    code, err, children = _stop(run, signum, twice=True)
    assert code == 128 + signum and "Traceback" not in err, err
    _none_left(children)
    _finish(tmp_path, WORKERS)  # from the last checkpoint written, whichever it was
    _same(_figures(tmp_path)[-STEPS:], uninterrupted)


@pytest.mark.long
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_group_signal_while_the_run_loads_stops_at_once_and_leaves_no_run_directory(tmp_path, signum):
    run_dir = tmp_path / "run"
    run = _train(run_dir, [*WORKERS, "sft.steps=0"])
    _wait_until(run, lambda: run_dir.is_dir())  # the run directory exists: the model is being loaded
    code, err, children = _stop(run, signum)
    assert code == 128 + signum and "Traceback" not in err, err
    assert "stopped at once" in err or "continue with" in err, err
    assert not run_dir.exists() or (run_dir / "checkpoints" / "latest").exists(), sorted(run_dir.iterdir())
    _none_left(children)


@pytest.mark.long
def test_a_group_signal_reaches_the_run_and_not_its_environment_server(tmp_path):
    pytest.importorskip("openenv.core", reason="openenv-core is the optional extra everyprompt[openenv]")
    import json

    rows = [{"prompt": f"What is {n} + 1?", "answer": str(n + 1), "mode": ""} for n in range(8)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = (
        "{app: tests.envs.openenv_app:app, row_fields: [answer, mode], first_message: prompt, stop: [' ']}"
    )
    args = [*TINY_OVERRIDES, *SYNCHRONOUS, "model.preset=tiny-chat-moe", "sft.steps=0", "env.name=openenv",
            f"env.options={options}", "env.max_turns=2", f"data.train_file={data}", f"data.eval_file={data}",
            "rl.group_size=2", "rollout.max_new_tokens=32", "eval.num_samples=0", "checkpoint.every=0"]  # fmt: skip
    run_dir = tmp_path / "run"
    run = _train(run_dir, args, "rl.steps=40")
    _wait_until(run, lambda: _lines(run_dir / "metrics.jsonl") >= 1)
    time.sleep(0.1)
    code, err, children = _stop(run, signal.SIGTERM)
    assert code == 143 and "Traceback" not in err, err
    assert f"continue with: everyprompt train --resume {run_dir}" in err
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("env/errors/") and value for line in lines for key, value in line.items())
    _none_left(children)
