"""`everyprompt sweep`: the grid's plan by hand, its refusals, and real sweeps of a tiny config (run, killed,
resumed; a failing cell reported and skipped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from everyprompt.cli import main
from everyprompt.config import ConfigError
from everyprompt.processes import descendants, is_alive
from everyprompt.run.layout import SweepLayout
from everyprompt.sweep import SweepPlan, parse_axes, prepare, split_values
from everyprompt.sweep.runner import SweepRunner, cell_command
from tests.conftest import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the plan
def test_values_split_at_top_level_commas_only():
    assert split_values("ppo_clip,espo") == ["ppo_clip", "espo"]
    assert split_values("[4,5],[5]") == ["[4,5]", "[5]"]
    assert split_values("{a: 1, b: 2},'x,y'") == ["{a: 1, b: 2}", "'x,y'"]
    assert split_values("0.1") == ["0.1"]


def test_single_values_apply_to_every_cell_and_lists_are_axes():
    fixed, grid = parse_axes(
        ["rl.loss=ppo_clip,espo", "rl.steps=3", "rl.levels=[4,5],[5]", "zve.enabled=true"]
    )
    assert fixed == ["rl.steps=3", "zve.enabled=true"]
    assert grid == {"rl.loss": ["ppo_clip", "espo"], "rl.levels": ["[4,5]", "[5]"]}


def test_cells_are_every_combination_times_the_seeds_named_by_their_settings():
    plan = SweepPlan({}, [], {"rl.loss": ["ppo_clip", "espo"], "zve.enabled": ["false", "true"]}, [0, 1])
    cells = plan.cells()
    assert len(cells) == 8
    assert [c.name for c in cells[:3]] == [
        "loss=ppo_clip,enabled=false,seed=0",
        "loss=ppo_clip,enabled=false,seed=1",
        "loss=ppo_clip,enabled=true,seed=0",
    ]
    assert cells[-1].overrides == ("rl.loss=espo", "zve.enabled=true", "seed=1")
    # two axes whose keys end alike are named by their whole keys; brackets do not reach a name
    plan = SweepPlan({}, [], {"zve.enabled": ["true"], "rl.kl.enabled": ["x"], "rl.levels": ["[4,5]"]}, [0])
    assert plan.cells()[0].name == "zve.enabled=true,rl.kl.enabled=x,levels=4-5,seed=0"


@pytest.mark.parametrize(
    "arguments, seeds, expected",
    [
        (["rl.loss=ppo_clip,espo", "rl.loss=gspo"], None, "'rl.loss' is given twice"),
        (["seed=0,1"], None, "--seeds"),
        (["rl.loss=ppo_clip,,espo"], None, "empty value"),
        (["rl.loss=espo,espo"], None, "repeats a value"),
        (["rl.loss=ppo_clip,espo"], "0,x", "expected integers"),
        (["rl.nope=1,2"], None, "unknown config key 'rl.nope'"),
        (["rl.loss=ppo_clip,not_a_loss"], None, "sweep cell loss=not_a_loss,seed=0"),
    ],
)
def test_a_bad_grid_is_refused_before_anything_runs(arguments, seeds, expected, tmp_path):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        prepare(None, arguments, seeds, tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()


def test_the_cli_exits_2_naming_the_key(tmp_path, capsys):
    assert main(["sweep", "rl.lossy=a,b", "--run-dir", str(tmp_path / "s")]) == 2
    assert "rl.lossy" in capsys.readouterr().err


def test_a_directory_holds_one_sweep(tmp_path):
    plan, directory = prepare(None, ["rl.loss=ppo_clip,espo"], "0,1", tmp_path / "sweep")
    assert SweepPlan.load(directory).same_as(plan) == []
    again, _ = prepare(None, ["rl.loss=ppo_clip,espo"], "0,1", directory)  # the same sweep: resumes
    assert again.cells() == plan.cells()
    with pytest.raises(ConfigError, match="holds another sweep.*seeds"):
        prepare(None, ["rl.loss=ppo_clip,espo"], "0,1,2", directory)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a sweep directory"):
        prepare(None, ["rl.loss=ppo_clip,espo"], None, tmp_path / "other")
    with pytest.raises(ConfigError, match="no sweep.json"):
        prepare(None, [], None, resume=tmp_path / "other")


def test_a_cell_runs_from_the_saved_base_config_then_resumes_from_its_run_directory(tmp_path):
    plan, directory = prepare(None, ["rl.loss=ppo_clip,espo", "rl.steps=3"], None, tmp_path / "s")
    cell = plan.cells()[1]
    command = cell_command(directory, cell, plan.fixed)
    assert command[-6:] == [
        str(directory / "base.yaml"),
        "rl.steps=3",
        "rl.loss=espo",
        "seed=0",
        "--run-dir",
        str(directory / cell.name),
    ]
    (directory / cell.name).mkdir()
    (directory / cell.name / "config.yaml").write_text("seed: 0\n")
    assert cell_command(directory, cell, plan.fixed)[-2:] == ["--resume", str(directory / cell.name)]


# ------------------------------------------------------------------ real sweeps
def _sweep_command(sweep_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "everyprompt.cli", "sweep", *TINY_OVERRIDES, "rl.loss=ppo_clip,espo",
        "--seeds", "0,1", "--run-dir", str(sweep_dir), *extra,
    ]  # fmt: skip


def _status(sweep_dir: Path) -> dict:
    path = SweepLayout(sweep_dir).status
    return json.loads(path.read_text()) if path.is_file() else {}


# slow (about 40 s): the SIGTERM test below covers a sweep stopped and resumed in the default run
@pytest.mark.slow
def test_a_2x2_sweep_killed_midway_resumes_and_its_report_names_the_differing_keys(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    driver = subprocess.Popen(
        _sweep_command(sweep_dir, "--parallel", "2"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill it once a cell is done and another is under way
        done = [name for name, s in _status(sweep_dir).items() if s["state"] == "done"]
        children = descendants(driver.pid)
        if done and children and driver.poll() is None:
            break
        assert driver.poll() is None, "the sweep ended before it could be killed"
        time.sleep(0.1)
    else:
        pytest.fail("no cell finished within 120 s")
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    time.sleep(1.0)
    assert not [pid for pid in children if is_alive(pid)], "a cell outlived the killed sweep"
    first_done = sweep_dir / done[0] / "eval.json"
    finished_at = first_done.stat().st_mtime_ns

    assert main(["sweep", "--resume", str(sweep_dir)]) == 0
    status = _status(sweep_dir)
    assert sorted(status) == sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert len(status) == 4 and status[done[0]]["state"] == "skipped"
    assert all(s["state"] in ("done", "skipped") for s in status.values())
    assert first_done.stat().st_mtime_ns == finished_at  # a finished cell is not run again
    for name in status:
        assert len((sweep_dir / name / "metrics.jsonl").read_text().splitlines()) == 2

    capsys.readouterr()
    html = tmp_path / "r.html"
    assert main(["report", str(sweep_dir), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "loss=ppo_clip" in out and "loss=espo" in out
    page = html.read_text()
    keys_table = page.split('<table id="keys">')[1].split("</table>")[0]
    assert "rl.loss" in keys_table and ">seed<" in keys_table
    assert keys_table.count("<tr>") == 3  # a header and the two keys that differ, nothing else


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
def test_a_failing_cell_is_reported_and_skipped_and_retried_on_resume(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("everyprompt.sweep.runner.LOG_EVERY_S", 0.0)  # progress lines without a terminal
    sweep_dir = tmp_path / "sweep"
    missing = tmp_path / "no-such-model"
    code = main(
        [
            "sweep",
            *TINY_OVERRIDES,
            f"model.path=null,{missing}",
            "--parallel",
            "2",
            "--run-dir",
            str(sweep_dir),
        ]
    )
    assert code == 1
    status = _status(sweep_dir)
    states = {name: s["state"] for name, s in status.items()}
    assert states == {"path=null,seed=0": "done", "path=no-such-model,seed=0": "failed"}
    failed = status["path=no-such-model,seed=0"]
    assert failed["exit_code"] == 2 and str(missing) in failed["error"]
    err = capsys.readouterr().err
    assert "1 of 2 cells failed" in err and "output.log" in err
    assert "cells ended; running: path=null,seed=0 step" in err
    # the report still draws: the failed run is listed with its error
    assert main(["report", str(sweep_dir), "--html"]) == 0
    page = (sweep_dir / "report.html").read_text()
    assert "state-failed" in page and "the cell failed" in page
    # a resume retries the failed cell only (it fails again: the model is still missing)
    assert main(["sweep", "--resume", str(sweep_dir)]) == 1
    assert {n: s["state"] for n, s in _status(sweep_dir).items()} == {
        "path=null,seed=0": "skipped",
        "path=no-such-model,seed=0": "failed",
    }


def test_parallel_below_one_is_refused(tmp_path, capsys):
    assert main(["sweep", "--parallel", "0", "rl.loss=ppo_clip,espo", "--run-dir", str(tmp_path / "s")]) == 2
    assert "--parallel 0" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_a_signalled_cell_is_done_when_it_wrote_its_evaluation_and_stopped_when_not(tmp_path):
    plan = SweepPlan({}, ["rl.steps=3"], {"rl.loss": ["ppo_clip", "espo"]}, [0])
    finished, midway = plan.cells()
    (tmp_path / finished.name).mkdir()
    (tmp_path / finished.name / "eval.json").write_text('{"greedy_accuracy": 0.5}')
    runner = SweepRunner(plan, tmp_path)
    assert runner._outcome(finished, -signal.SIGTERM, 1.0).state == "failed"  # nobody asked it to stop
    runner._signum = signal.SIGTERM  # the sweep was told to stop and told its cells
    # killed by the signal on its way out, after its evaluation: its work is complete
    assert runner._outcome(finished, -signal.SIGTERM, 1.0).state == "done"
    assert runner._outcome(finished, 143, 1.0).state == "done"
    assert runner._outcome(midway, 143, 1.0).state == "stopped"
    assert runner._outcome(midway, 1, 1.0).state == "failed"


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
def test_sigterm_stops_the_cells_after_their_checkpoints_and_the_sweep_resumes(tmp_path):
    # enough steps that the signal, forwarded within the driver's 0.2 s poll, lands mid-RL on a fast
    # machine too (with 4, a CI run once finished the cell and its evaluation before the signal came)
    STEPS = 40  # noqa: N806
    sweep_dir = tmp_path / "sweep"
    command = [
        sys.executable, "-m", "everyprompt.cli", "sweep", *(o for o in TINY_OVERRIDES if not o.startswith("rl.steps=")),
        f"rl.steps={STEPS}", "rl.loss=ppo_clip,espo",
        "--run-dir", str(sweep_dir),
    ]  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = sweep_dir / "loss=ppo_clip,seed=0"
    deadline = time.monotonic() + 600  # a bound on a hang, far above the work (~60 s on a loaded machine)
    while not (first / "metrics.jsonl").is_file():  # the first cell is in its RL phase
        assert driver.poll() is None and time.monotonic() < deadline, "the first cell never reached RL"
        time.sleep(0.05)
    children = descendants(driver.pid)
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=600)
    assert driver.returncode == 143, err
    assert "everyprompt sweep --resume" in err
    assert not [pid for pid in children if is_alive(pid)]
    assert _status(sweep_dir)["loss=ppo_clip,seed=0"]["state"] == "stopped"
    assert (first / "checkpoints" / "latest").exists() and not (first / "eval.json").exists()
    assert len((first / "metrics.jsonl").read_text().splitlines()) < STEPS
    assert not (sweep_dir / "loss=espo,seed=0").exists()  # no new cell started after the signal

    assert main(["sweep", "--resume", str(sweep_dir)]) == 0
    assert {s["state"] for s in _status(sweep_dir).values()} == {"done"}
    assert len((first / "metrics.jsonl").read_text().splitlines()) == STEPS
    assert "resumed from" in (first / "output.log").read_text()


def test_named_arms_bundle_several_keys_and_name_the_report_arms(tmp_path):
    """The library's arms (the benchmarks' methods): each a bundle of overrides, crossed with the grid."""
    from everyprompt.report.runs import arms_of

    arms = {"DAPO": ["rl.loss=ppo_clip", "rl.ppo.clip_high=0.28"], "ESPO": ["rl.loss=espo"]}
    plan = SweepPlan({}, ["rl.steps=3"], {"zve.enabled": ["false", "true"]}, [0, 1], arms=arms)
    cells = plan.cells()
    assert [c.name for c in cells[:2]] == ["DAPO,enabled=false,seed=0", "DAPO,enabled=false,seed=1"]
    assert cells[0].overrides == ("rl.loss=ppo_clip", "rl.ppo.clip_high=0.28", "zve.enabled=false", "seed=0")
    assert plan.config_of(cells[0]).rl.ppo.clip_high == 0.28 and plan.config_of(cells[-1]).rl.loss == "espo"
    plan.save(tmp_path / "s")
    assert SweepPlan.load(tmp_path / "s").same_as(plan) == []
    # a sweep's cells as the report reads them (config.yaml is all a started cell needs here)
    for cell in cells:
        (tmp_path / "s" / cell.name).mkdir()
        (tmp_path / "s" / cell.name / "config.yaml").write_text(
            yaml.safe_dump(plan.config_of(cell).model_dump(mode="json"))
        )
    from everyprompt.report.runs import load_runs

    names = [arm.name for arm in arms_of(load_runs([tmp_path / "s"]))]
    assert names == ["DAPO,enabled=false", "DAPO,enabled=true", "ESPO,enabled=false", "ESPO,enabled=true"]
