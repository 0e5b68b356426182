"""bench/evidence/: docs/evidence.md's comparisons as sweeps, and the pre-registered statistic."""

import json
import math
from dataclasses import replace

import pytest

from everyprompt.report.stats import Difference, holm, paired_bootstrap, paired_t, t_verdict, verdict
from tests.test_bench import _load


def test_the_paired_statistic_and_the_verdict_rule_by_hand():
    same = paired_bootstrap([0.02, 0.02, 0.02])  # every seed gains 2 points: no spread, no doubt
    assert (same.value, same.low, same.high) == pytest.approx((0.02, 0.02, 0.02))
    assert verdict(same) == "win"
    mixed = paired_bootstrap([0.03, -0.01, 0.01, -0.02])
    assert mixed.value == pytest.approx(0.0025)
    assert -0.02 <= mixed.low < 0 < mixed.high <= 0.03  # within the extremes of the resampled means
    assert verdict(mixed) == "no difference shown"
    assert verdict(paired_bootstrap([-0.05, -0.04, -0.06])) == "loss"
    one = paired_bootstrap([0.1])
    assert one.value == 0.1 and one.low is None and verdict(one) is None
    assert math.isnan(paired_bootstrap([]).value)
    assert verdict(Difference(0.0, 0.0, 0.1)) == "no difference shown"  # touching 0 is not above it


def test_the_paired_t_test_and_holm_by_hand():
    # differences 1, 2, 3 points: mean 2, sd 1, se 1/sqrt(3); t = 2 sqrt(3) = 3.4641 on 2 degrees of
    # freedom: two-sided p = 1 - t / sqrt(2 + t^2) = 1 - 3.4641 / 3.7417 = 0.07418; interval 2 +- 4.3027 / sqrt(3)
    test = paired_t([0.01, 0.02, 0.03])
    assert test.n == 3 and test.value == pytest.approx(0.02)
    assert test.p == pytest.approx(1 - 3.4641016 / math.sqrt(2 + 12), rel=1e-6)
    assert (test.low, test.high) == pytest.approx(
        (0.02 - 0.043027 / math.sqrt(3), 0.02 + 0.043027 / math.sqrt(3)), rel=1e-4
    )
    same = paired_t([0.02, 0.02, 0.02])  # no spread: certain of its sign
    assert same.p == 0.0 and t_verdict(same.value, same.p) == "win"
    assert paired_t([0.0, 0.0, 0.0]).p == 1.0 and paired_t([0.1]).p is None
    # Holm: sorted 0.01, 0.03, 0.04 of three -> 0.03, 0.06, 0.06 (made non-decreasing), in the given order
    assert holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    assert holm([0.6, 0.9]) == pytest.approx([1.0, 1.0]) and holm([0.02]) == [0.02]
    assert t_verdict(-0.03, 0.049) == "loss" and t_verdict(0.03, 0.05) == "no difference shown"
    assert t_verdict(0.03, None) is None


def test_contrasts_pair_by_seed_and_judge_only_complete_ones():
    bench = _load("evidence")
    c1, tiny = bench.COMPARISONS["c1"], "tiny"

    def runs(values):
        return {"runs": [{"seed": s, "greedy_accuracy": v} for s, v in enumerate(values)]}

    arms = {
        "ppo-clip": runs([0.80] * 6),
        "espo": runs([0.82, 0.81, 0.83, 0.82, 0.81, 0.83]),
        "gspo": runs([0.8]),
    }
    out = {(c["arm"], c["reference"]): c for c in bench.contrasts(c1, tiny, arms)}
    espo = out[("espo", "ppo-clip")]
    assert espo["differences"] == pytest.approx([0.02, 0.01, 0.03, 0.02, 0.01, 0.03])
    assert espo["mean_difference"] == pytest.approx(0.02) and espo["complete"]
    assert espo["as_first_written"]["verdict"] == "win"  # the original rule needs only its own contrast
    assert espo["verdict"] is None and "Holm's family" in espo["status"]  # GSPO, its family, is not in
    gspo = out[("gspo", "ppo-clip")]  # one seed of six: no verdict yet, and the report says which lack
    assert gspo["seeds"] == [0] and not gspo["complete"] and gspo["verdict"] is None
    assert gspo["status"] == "not enough seeds: gspo lacks [1, 2, 3, 4, 5]"
    reported = out[("espo", "gspo")]
    assert not reported["judged"] and reported["verdict"] is None
    # the family complete: Holm over its two p-values
    arms["gspo"] = runs([0.80, 0.81, 0.79, 0.80, 0.82, 0.78])
    out = {(c["arm"], c["reference"]): c for c in bench.contrasts(c1, tiny, arms)}
    espo, gspo = out[("espo", "ppo-clip")], out[("gspo", "ppo-clip")]
    assert espo["p_holm"] == pytest.approx(2 * espo["p"]) and espo["verdict"] == "win"  # the smaller p, x2
    assert (
        gspo["p_holm"] == pytest.approx(max(gspo["p"], 2 * espo["p"]))
        and gspo["verdict"] == "no difference shown"
    )


def test_too_few_or_mismatched_seeds_get_no_verdict_and_say_so():
    bench = _load("evidence")
    c3 = bench.COMPARISONS["c3"]
    arms = {
        "no-replay": {"runs": [{"seed": s, "greedy_accuracy": 0.5} for s in (0, 1, 2)]},
        "r3": {"runs": [{"seed": s, "greedy_accuracy": 0.6} for s in (0, 2, 5)]},  # seed 1 missing, 5 extra
    }
    (r3,) = bench.contrasts(c3, "smollm2-moe", arms)
    assert r3["seeds"] == [0, 2] and r3["verdict"] is None and r3["p_holm"] is None
    assert r3["status"] == "not enough seeds: r3 lacks [1]"
    smoke = replace(c3, seeds=(0, 1))  # complete at two pairs: still fewer than the rule needs
    arms["r3"]["runs"] = [{"seed": s, "greedy_accuracy": 0.6} for s in (0, 1)]
    (r3,) = bench.contrasts(smoke, "smollm2-moe", arms)
    assert r3["complete"] and r3["verdict"] is None
    assert r3["status"] == "not enough seeds: 2 pairs, the rule needs 3"


def test_calls_on_other_comparisons_keep_each_others_records(tmp_path):
    """Two calls that loaded the file before either saved (c1 and c2 running at once): each save writes
    its own comparison into the file as it is then, so the later one does not drop the earlier's runs."""
    bench = _load("evidence")
    path = tmp_path / "evidence.json"

    def call(name, arms):
        payload = bench.load(path)  # what the call read when it started
        entry = payload["comparisons"].setdefault(name, {"title": "", "setups": {}})
        runs = {arm: {"overrides": [], "runs": [{"seed": 0, "greedy_accuracy": 0.5}]} for arm in arms}
        entry["setups"]["tiny"] = {"arms": runs}
        return payload

    first, second = call("c1", ["ppo-clip", "espo"]), call("c2", ["grpo", "zve"])
    bench.save(path, first, False, "c1", "tiny")
    written = bench.save(path, second, False, "c2", "tiny")
    on_disk = json.loads(path.read_text())
    assert set(on_disk["comparisons"]) == {"c1", "c2"} == set(written["comparisons"])
    assert set(on_disk["comparisons"]["c1"]["setups"]["tiny"]["arms"]) == {"ppo-clip", "espo"}
    assert on_disk["comparisons"]["c1"]["title"] == bench.COMPARISONS["c1"].title
    assert not list(tmp_path.glob(".evidence.json.tmp-*"))  # written through a renamed temporary file


@pytest.mark.parametrize("keep", [False, True])
def test_a_recorded_cell_gives_up_its_checkpoints_unless_told_to_keep_them(tmp_path, keep):
    """What harvest records comes from eval.json and metrics.jsonl alone; a finished cell's checkpoints
    (8 GB for a MoE cell) go once it is recorded. A cell still running keeps its own: it resumes from them."""
    from everyprompt.config import demo_config_path, read_yaml
    from everyprompt.sweep import SweepPlan

    bench = _load("evidence")
    fixed = ["rl.steps=2"]
    plan = SweepPlan(read_yaml(demo_config_path()), fixed, {}, [0, 1], "demo", {"a": [], "b": []})
    sweep = tmp_path / "c1-tiny" / "sweep"
    plan.save(sweep)
    for cell in plan.cells():
        (sweep / cell.name / "checkpoints" / "step_2").mkdir(parents=True)
        if cell.name != "b,seed=1":  # finished; b seed 1 is still running
            (sweep / cell.name / "eval.json").write_text(json.dumps({"greedy_accuracy": 0.5}))
            (sweep / cell.name / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    # an earlier sweep stopped with a at seed 0 unfinished, and b at seed 1 not started; a seed 0 has since
    # run whole above, so nothing resumes the stopped one
    stopped = tmp_path / "c1-tiny" / "stopped"
    plan.save(stopped)
    (stopped / "a,seed=0" / "checkpoints" / "step_1").mkdir(parents=True)
    (stopped / "b,seed=1" / "checkpoints" / "step_1").mkdir(parents=True)
    body = {"arms": {"a": {"runs": []}, "b": {"runs": []}}}
    bench.harvest(tmp_path / "c1-tiny", body, fixed, None, keep_checkpoints=keep)
    assert {arm: [r["seed"] for r in a["runs"]] for arm, a in body["arms"].items()} == {"a": [0, 1], "b": [0]}
    kept = sorted(
        str(p.parent.relative_to(tmp_path / "c1-tiny")) for p in tmp_path.glob("c1-tiny/*/*/checkpoints")
    )
    pruned = ["stopped/a,seed=0", "sweep/a,seed=0", "sweep/a,seed=1", "sweep/b,seed=0"]
    resumable = ["stopped/b,seed=1", "sweep/b,seed=1"]  # b seed 1 is not recorded: a later call resumes it
    assert kept == (sorted(pruned + resumable) if keep else resumable)


@pytest.mark.parametrize(
    "name",
    [
        "c1",
        "c2",
        "c3",
        "c4",
        "c5-hard",
        "c5-groups",
        "c5-long",
        "c5-offpolicy",
        "c5-hard-confirm",
        "c5-recompute",
        "c6",
        "c6-smollm2",
    ],
)
def test_every_preregistered_cell_is_a_valid_config(name, tmp_path):
    from everyprompt.config import demo_config_path, read_yaml
    from everyprompt.sweep import SweepPlan

    bench = _load("evidence")
    comparison = bench.COMPARISONS[name]
    for setup_name in comparison.setups:
        setup = bench.SETUPS[setup_name]
        sft = tmp_path / "sft" if setup.shared_sft else None
        fixed = bench.fixed_overrides(comparison, setup, [], sft, setup.steps)
        path = setup.config or demo_config_path()
        seeds = list(comparison.seeds_on(setup_name))
        arms = {
            arm: [o.format(teacher=tmp_path / "teacher") for o in keys]
            for arm, keys in comparison.arms.items()
        }
        plan = SweepPlan(read_yaml(path), fixed, {}, seeds, str(path), arms)
        plan.validate()  # every cell's config built and checked
        assert len(plan.cells()) == len(comparison.arms) * len(seeds)
        if comparison.equal_rollouts:  # plain GRPO's rollouts at the setup's step count
            assert any(o.startswith("rl.max_rollouts=") for o in fixed)


def test_the_smollm2_condition_changes_only_where_the_old_policy_comes_from():
    """C5-recompute: C1's PPO-clip and ESPO on SmolLM2's set-up with the learner's own old policy and two
    mini-batches, nothing else changed; pre-registered in docs/evidence.md."""
    from everyprompt.config import load_config
    from tests.test_bench import ROOT

    bench = _load("evidence")
    c1, smollm2 = bench.COMPARISONS["c1"], bench.SETUPS["smollm2"]
    comparison = bench.COMPARISONS["c5-recompute"]
    assert comparison.setups == ("smollm2",) and comparison.exploratory
    assert comparison.arms == {arm: c1.arms[arm] for arm in ("ppo-clip", "espo")}
    base = load_config(smollm2.config, bench.fixed_overrides(c1, smollm2, [], None, smollm2.steps)).rl
    config = load_config(
        smollm2.config, bench.fixed_overrides(comparison, smollm2, [], None, smollm2.steps)
    ).rl
    differs = {k: v for k, v in config.model_dump().items() if v != base.model_dump()[k]}
    assert differs == {"old_logprobs": "recompute", "mini_batches": 2}
    assert "--comparison c5-recompute --setup smollm2" in (ROOT / "docs" / "evidence.md").read_text()


def test_the_second_step_changes_one_thing_each():
    """docs/evidence.md's second step: PPO-clip and ESPO with C1's keys on the tiny set-up, each condition
    one change to C1's runs (levels, group size, steps, mini-batches), every condition in the doc."""
    from everyprompt.config import load_config
    from tests.test_bench import ROOT

    bench = _load("evidence")
    c1, tiny = bench.COMPARISONS["c1"], bench.SETUPS["tiny"]
    base = load_config(None, bench.fixed_overrides(c1, tiny, [], None, tiny.steps))
    doc = (ROOT / "docs" / "evidence.md").read_text()
    changed = {
        "c5-hard": ("levels", [5]),
        "c5-groups": ("group_size", 4),
        "c5-long": ("steps", 360),
        "c5-offpolicy": ("mini_batches", 8),
    }
    for name, (key, value) in changed.items():
        comparison = bench.COMPARISONS[name]
        assert comparison.arms == {arm: c1.arms[arm] for arm in ("ppo-clip", "espo")}
        config = load_config(None, bench.fixed_overrides(comparison, tiny, [], None, tiny.steps))
        assert getattr(config.rl, key) == value != getattr(base.rl, key)
        differs = {k for k, v in config.rl.model_dump().items() if v != base.rl.model_dump()[k]}
        assert differs == {key}
        assert f"`{name}`" in doc or f"--comparison {name}" in doc
    confirm = bench.COMPARISONS["c5-hard-confirm"]  # the candidate's confirmation: new seeds, same runs
    assert (
        confirm.seeds_on("tiny") == (6, 7, 8, 9, 10, 11) and confirm.arms == bench.COMPARISONS["c5-hard"].arms
    )
    assert confirm.fixed == bench.COMPARISONS["c5-hard"].fixed and confirm.exploratory
    # complete, and so judged, only with its own six seeds in
    runs = {arm: {"runs": [{"seed": s, "greedy_accuracy": 0.8} for s in range(6)]} for arm in confirm.arms}
    assert not bench.contrasts(confirm, "tiny", runs)[0]["complete"]


@pytest.mark.slow  # an SFT checkpoint and six short runs, each a process (~1 min)
def test_evidence_bench_smoke(tmp_path):
    bench = _load("evidence")
    argv = ["--comparison", "c1", "--setup", "tiny", "--tiny", "--seeds", "0", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    payload = json.loads((tmp_path / "evidence_smoke.json").read_text())
    body = payload["comparisons"]["c1"]["setups"]["tiny"]
    assert payload["smoke"] is True
    assert {arm: [r["seed"] for r in a["runs"]] for arm, a in body["arms"].items()} == {
        "ppo-clip": [0, 1],
        "espo": [0, 1],
        "gspo": [0, 1],
    }
    assert all(0 <= r["greedy_accuracy"] <= 1 for a in body["arms"].values() for r in a["runs"])
    assert [c["seeds"] for c in body["contrasts"]] == [[0, 1]] * 3 and not body["contrasts"][0]["complete"]
    # the recorded cells keep their records' files, not their checkpoints
    cells = [p.parent for p in (tmp_path / "evidence_runs").glob("c1-tiny/*/*/eval.json")]
    assert len(cells) == 6 and all((c / "metrics.jsonl").is_file() for c in cells)
    assert not [c for c in cells if (c / "checkpoints").exists()]
    # a second call finds every cell recorded and runs nothing
    assert bench.main(argv) == 0
    again = json.loads((tmp_path / "evidence_smoke.json").read_text())
    assert again["comparisons"] == payload["comparisons"]
    # --arms: one arm's missing cell, the others' left for later
    assert bench.main([*argv[:5], "--seeds", "2", "--arms", "espo", "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "evidence_smoke.json").read_text())["comparisons"]["c1"]["setups"]["tiny"]
    assert {arm: [r["seed"] for r in a["runs"]] for arm, a in body["arms"].items()} == {
        "ppo-clip": [0, 1],
        "espo": [0, 1, 2],
        "gspo": [0, 1],
    }


def test_an_arm_the_comparison_lacks_is_named_before_any_work(tmp_path):
    bench = _load("evidence")
    argv = [
        "--comparison",
        "c1",
        "--setup",
        "tiny",
        "--tiny",
        "--arms",
        "espo",
        "ppo",
        "--out",
        str(tmp_path),
    ]
    with pytest.raises(SystemExit, match=r"c1 has no arm ppo \(its arms: ppo-clip, espo, gspo\)"):
        bench.main(argv)
    assert not (tmp_path / "evidence_runs").exists()


@pytest.mark.slow  # an SFT checkpoint, a teacher and three short runs (~1 min)
def test_the_distillation_bench_trains_its_teacher_once_and_hands_it_to_its_arms(tmp_path):
    bench = _load("evidence")
    argv = ["--comparison", "c6", "--setup", "tiny", "--tiny", "--seeds", "0", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    body = json.loads((tmp_path / "evidence_smoke.json").read_text())["comparisons"]["c6"]["setups"]["tiny"]
    teacher = tmp_path / "evidence_runs" / "teacher_tiny_seed100"
    assert body["teacher"]["run_dir"] == str(teacher) and 0 <= body["teacher"]["greedy_accuracy"] <= 1
    assert body["arms"]["distill"]["overrides"] == [
        f"rl.teacher.model={(teacher / 'checkpoints' / 'step_2')}"
    ]
    runs = {arm: a["runs"][0] for arm, a in body["arms"].items()}
    assert runs["grpo"]["distill_reverse_kl_first_last"] is None
    assert all(len(runs[arm]["distill_reverse_kl_first_last"]) == 2 for arm in ("distill", "distill-alone"))
    assert all(r["rl_steps"] == 2 for r in runs.values())  # a smoke run's 2 steps, not the comparison's 30
    made = (teacher / "eval.json").stat().st_mtime
    assert bench.main(argv) == 0 and (teacher / "eval.json").stat().st_mtime == made  # trained once


def test_the_cells_left_to_run_go_arm_by_arm_or_seed_by_seed():
    """What a call runs: only unrecorded cells; by default one sweep per set of arms missing the same
    seeds; `--seed-by-seed` one sweep per seed, so that a call cut short (a lent GPU's time limit) has
    finished whole seeds of every arm, the pairs the contrasts need."""
    bench = _load("evidence")
    runs = {"a": [{"seed": 3}], "b": [], "c": []}
    body = {"arms": {arm: {"runs": recorded} for arm, recorded in runs.items()}}
    arms, seeds = ["a", "b", "c"], [3, 4, 5]
    assert bench.pending_sweeps(body, arms, seeds) == [((4, 5), ["a"]), ((3, 4, 5), ["b", "c"])]
    assert bench.pending_sweeps(body, arms, seeds, seed_by_seed=True) == [
        ((3,), ["b", "c"]),
        ((4,), ["a", "b", "c"]),
        ((5,), ["a", "b", "c"]),
    ]
    done = {"arms": {arm: {"runs": [{"seed": s} for s in seeds]} for arm in arms}}
    assert bench.pending_sweeps(done, arms, seeds) == []
    assert bench.pending_sweeps(done, arms, seeds, seed_by_seed=True) == []


def test_a_cell_a_stopped_call_cut_short_resumes_in_the_next_calls_sweep(tmp_path):
    """A call stopped during b seed 4 (a seed 4 done, recorded) runs b alone next, in a sweep named for
    it: the cut-short cell moves there and resumes from its checkpoint (it started over before)."""
    from everyprompt.config import demo_config_path, read_yaml
    from everyprompt.sweep import SweepPlan
    from everyprompt.sweep.runner import cell_command

    bench = _load("evidence")
    root, base = tmp_path / "c8-long-tiny", read_yaml(demo_config_path())
    first = SweepPlan(base, ["rl.steps=2"], {}, [4], "demo", {"a": [], "b": []})
    first.save(root / "seeds4-a-b")
    for name in ("a,seed=4", "b,seed=4"):
        (root / "seeds4-a-b" / name / "checkpoints" / "step_1").mkdir(parents=True)
        (root / "seeds4-a-b" / name / "config.yaml").write_text("seed: 4\n")
    (root / "seeds4-a-b" / "a,seed=4" / "eval.json").write_text(json.dumps({"greedy_accuracy": 0.5}))
    other = SweepPlan(base, ["rl.steps=3"], {}, [4], "demo", {"b": []})  # other settings: not adopted
    other.save(root / "other")
    (root / "other" / "b,seed=4" / "checkpoints" / "step_2").mkdir(parents=True)
    second = SweepPlan(base, ["rl.steps=2"], {}, [4], "demo", {"b": []})
    second.save(root / "seeds4-b")
    moved = bench.adopt_cut_short(root, root / "seeds4-b", second)
    assert moved == [("b,seed=4", root / "seeds4-a-b" / "b,seed=4")]
    assert (root / "seeds4-b" / "b,seed=4" / "checkpoints" / "step_1").is_dir()
    (cell,) = second.cells()  # the sweep's runner continues it (`train --resume`), not a fresh run
    assert cell_command(root / "seeds4-b", cell, second.fixed)[-2:] == [
        "--resume",
        str(root / "seeds4-b" / "b,seed=4"),
    ]
    assert (root / "other" / "b,seed=4").is_dir() and (root / "seeds4-a-b" / "a,seed=4").is_dir()
    assert bench.adopt_cut_short(root, root / "seeds4-b", second) == []  # started here now: left alone
