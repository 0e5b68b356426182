"""C7's bench (bench/time_to_accuracy/): the training clock and its snapshots by hand, TRL given the prompts
in everyprompt's order, the seed's arms kept on one machine, and the whole comparison's smoke form (a tiny
model on the CPU) run end to end into an evidence file that the verdict code reads."""

import json
import sys

import pytest
from bench.time_to_accuracy.clock import Snapshots, TrainingClock


class FakeTime:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_clock_stops_while_a_snapshot_is_written_and_snapshots_fall_on_the_marks(tmp_path):
    """Steps end at 30, 50 (a 20 s snapshot written: the clock still reads 50) and 100 s of training; marks
    at 40, 60 and 90: the step that ended at 50 serves 40, the one at 100 serves 60 and 90 with one
    snapshot, and the budget (90) is spent there."""
    now = FakeTime()
    clock = TrainingClock(now)
    saved = []

    def save(directory):
        saved.append(directory.name)
        now.t += 20.0  # writing takes 20 s, off the clock

    snapshots = Snapshots(clock, [40.0, 60.0, 90.0], tmp_path, save)
    clock.start()
    now.t += 30.0
    assert snapshots.after_step(1) is False and saved == []
    now.t += 20.0
    assert snapshots.after_step(2) is False and saved == ["step_2"]
    assert clock.elapsed() == pytest.approx(50.0)
    now.t += 50.0
    assert snapshots.after_step(3) is True and saved == ["step_2", "step_3"]
    assert [(s["mark_s"], s["step"], s["clock_s"]) for s in snapshots.taken] == [
        (40.0, 2, 50.0),
        (60.0, 3, 100.0),
        (90.0, 3, 100.0),
    ]
    with pytest.raises(ValueError, match="ascending"):
        Snapshots(clock, [60.0, 40.0], tmp_path, save)
    with pytest.raises(RuntimeError, match="before the first step"):
        TrainingClock(now).elapsed()


def test_trl_is_given_the_prompts_everyprompt_draws_in_its_order(tmp_path):
    """bench's plan_order equals the prompts an everyprompt run of the same config and seed sampled, step
    by step (the rollout side's own plan, read as it draws)."""
    from bench.time_to_accuracy.arms import plan_order

    from everyprompt.pipeline import Run
    from tests.conftest import tiny_config

    config = tiny_config("rl.steps=3", "seed=5")
    run = Run(config, tmp_path / "run")
    trainer = run.trainer()
    drawn = []
    take = trainer.rollout.plan.take
    trainer.rollout.plan.take = lambda count, available: drawn.append(take(count, available)) or drawn[-1]
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = Run(config, tmp_path / "rows").rows.rl()
    expected = [rows[i]["prompt"] for step in drawn for i in step]
    assert len(drawn) == 3 and len(expected) == 3 * config.rl.prompts_per_step
    assert [r["prompt"] for r in plan_order(config, rows, 3)] == expected


def test_a_seed_begun_on_another_machine_is_run_whole_here():
    from bench.time_to_accuracy.__main__ import order_of, supersede

    body = {"arms": {arm: {"runs": []} for arm in ("trl", "recipe", "gpu")}}
    body["arms"]["trl"]["runs"] = [{"seed": 0, "machine": "A"}, {"seed": 1, "machine": "A"}]
    body["arms"]["recipe"]["runs"] = [{"seed": 1, "machine": "A"}]
    supersede(body, 0, "A")  # the same machine: its recorded arm stands
    assert body["arms"]["trl"]["runs"][0]["seed"] == 0
    supersede(body, 1, "B")  # another machine: seed 1's two records move aside
    assert [r["seed"] for r in body["arms"]["trl"]["runs"]] == [0]
    assert body["arms"]["recipe"]["runs"] == [] and len(body["superseded"]) == 2
    assert order_of(0) == ["trl", "recipe", "gpu"] and order_of(1) == ["recipe", "gpu", "trl"]


def _recorded_body() -> dict:
    """C7's records for two seeds of two arms and none of the third, marks at 45 and 90 s."""

    def run(seed, at45, at90, steps45, steps90):
        return {
            "seed": seed,
            "machine": "card",
            "greedy_accuracy_by_seconds": {"45": at45, "90": at90},
            "steps_by_seconds": {"45": steps45, "90": steps90},
        }

    return {
        "marks_s": [45.0, 90.0],
        "start": {"greedy_accuracy": 0.48},
        "arms": {
            "trl": {"runs": [run(0, 0.50, 0.52, 8, 17), run(1, 0.46, 0.50, 9, 18)]},
            "recipe": {"runs": [run(0, 0.54, 0.60, 20, 41), run(1, 0.56, 0.58, 21, 40)]},
            "gpu": {"runs": []},
        },
    }


def test_the_curve_table_by_hand():
    """Each arm's mean over its seeds at each mark (0 s: the starting model, no steps); an arm with no
    run recorded says so."""
    from bench.time_to_accuracy.curve import curve_table, points

    body = _recorded_body()
    assert points(body, "trl")[1]["marks"] == [(0.0, 0.48, 0), (45.0, 0.46, 9), (90.0, 0.50, 18)]
    lines = curve_table(body).splitlines()
    assert lines[0] == "| arm | seeds | 0 s | 45 s | 90 s |"
    # trl: (0.50 + 0.46) / 2 = 48.0% after (8 + 9) / 2 = 8.5 steps; (0.52 + 0.50) / 2 = 51.0% after 17.5
    assert lines[2] == "| trl | 2 | 48.0% | 48.0% (8.5 steps) | 51.0% (17.5 steps) |"
    assert lines[3] == "| recipe | 2 | 48.0% | 55.0% (20.5 steps) | 59.0% (40.5 steps) |"
    assert lines[4] == "| gpu | 0 | – | – | – |"


def test_the_curve_command_reads_the_records_and_draws_them(tmp_path, capsys):
    from bench.time_to_accuracy.__main__ import main

    assert main(["--curve", "--out", str(tmp_path)]) == 1  # nothing recorded: said, not drawn
    assert "no run recorded" in capsys.readouterr().out
    payload = {"comparisons": {"c7": {"setups": {"smollm2": _recorded_body()}}}}
    (tmp_path / "evidence.json").write_text(json.dumps(payload))
    assert main(["--curve", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| recipe | 2 | 48.0% | 55.0% (20.5 steps) | 59.0% (40.5 steps) |" in out
    assert (tmp_path / "c7_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_evidence_bench_hands_c7_to_its_own_runner(tmp_path):
    from bench.evidence import main

    with pytest.raises(SystemExit, match="python -m bench.time_to_accuracy"):
        main(["--comparison", "c7", "--setup", "smollm2", "--out", str(tmp_path)])


@pytest.mark.long
@pytest.mark.skipif(sys.platform != "linux", reason="the card's lock and the probes are Linux's")
def test_the_smoke_form_runs_every_arm_for_its_budget_and_records_them(tmp_path, capsys):
    """`--smoke --seeds 0`: a 2-layer chat model on the CPU, 2 s of each arm's clock: every arm recorded
    with a snapshot at each mark, the clock past the budget, each snapshot's evaluation written and its
    weights gone, TRL on TRL's trainer (its own output directory), and the contrasts computed."""
    pytest.importorskip("trl", reason="TRL comes with the dev and bench extras")
    from bench.common import ROOT
    from bench.time_to_accuracy.__main__ import main
    from bench.time_to_accuracy.cell import git_blob

    assert main(["--smoke", "--seeds", "0", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "evidence_smoke.json").read_text())
    assert payload["smoke"] is True
    body = payload["comparisons"]["c7"]["setups"]["smollm2"]
    assert body["marks_s"] == [1.0, 2.0] and 0.0 <= body["start"]["greedy_accuracy"] <= 1.0
    for arm in ("trl", "recipe", "gpu"):
        (run,) = body["arms"][arm]["runs"]
        assert run["seed"] == 0 and run["train_seconds"] >= 2.0 and run["rl_steps"] >= 1
        assert set(run["greedy_accuracy_by_seconds"]) == set(run["steps_by_seconds"]) == {"1", "2"}
        assert run["greedy_accuracy"] == run["greedy_accuracy_by_seconds"]["2"]
        assert run["steps_by_seconds"]["2"] == run["rl_steps"]
        assert run["config_blob"] == git_blob(
            ROOT / "configs" / ("smollm2-gpu.yaml" if arm == "gpu" else "smollm2.yaml")
        )
        cell = tmp_path / "evidence_runs" / "c7-smoke" / f"{arm}-seed0"
        for snapshot in (cell / "snapshots").iterdir():
            assert sorted(p.name for p in snapshot.iterdir()) == ["eval"]  # the weights are gone
            assert (snapshot / "eval" / "eval.json").is_file()
            assert (snapshot / "eval" / "completions.jsonl").is_file()
    assert (tmp_path / "evidence_runs" / "c7-smoke" / "trl-seed0" / "run").is_dir()  # TRL's output_dir
    contrasts = {(c["arm"], c["reference"]): c for c in body["contrasts"]}
    assert set(contrasts) == {("recipe", "trl"), ("gpu", "trl"), ("gpu", "recipe")}
    assert contrasts[("recipe", "trl")]["seeds"] == [0]
    assert main(["--curve", "--smoke", "--out", str(tmp_path)]) == 0  # the curve of what was recorded
    assert "| recipe | 1 |" in capsys.readouterr().out and (tmp_path / "c7_curve_smoke.png").is_file()

    # a call with less time than a cell takes starts none, and says so
    assert main(["--smoke", "--seeds", "1", "--time-left", "5", "--out", str(tmp_path)]) == 0
    assert "stopping here" in capsys.readouterr().out
    body = json.loads((tmp_path / "evidence_smoke.json").read_text())["comparisons"]["c7"]["setups"][
        "smollm2"
    ]
    assert all([r["seed"] for r in body["arms"][arm]["runs"]] == [0] for arm in ("trl", "recipe", "gpu"))
