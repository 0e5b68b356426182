"""The evidence file from elsewhere: a lent GPU's copy merged into this one (its runs added, a conflict
refused, every contrast rejudged), and a file rejudged under the rules in force."""

import json

import pytest

from tests.test_bench import _load


def test_rejudge_rewrites_a_files_contrasts_under_the_rules_in_force(tmp_path, capsys):
    bench = _load("evidence")
    runs = {
        arm: {"overrides": [], "runs": [{"seed": s, "greedy_accuracy": 0.8 + d * s} for s in range(6)]}
        for arm, d in (("ppo-clip", 0.0), ("espo", 0.001), ("gspo", -0.001))
    }
    old_style = {"arm": "espo", "reference": "ppo-clip", "judged": True, "verdict": "win"}  # no p, no status
    payload = {
        "benchmark": "evidence",
        "comparisons": {"c1": {"title": "", "setups": {"tiny": {"arms": runs, "contrasts": [old_style]}}}},
    }
    (tmp_path / "evidence.json").write_text(json.dumps(payload))
    assert bench.main(["--rejudge", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "evidence.json").read_text())
    contrasts = written["comparisons"]["c1"]["setups"]["tiny"]["contrasts"]
    assert [c["arm"] for c in contrasts] == ["espo", "gspo", "espo"]
    assert all("p" in c and "as_first_written" in c for c in contrasts)
    assert written["rules"]["amended"].startswith("paired t-test") and "rejudged" in capsys.readouterr().out


def _evidence(arms: dict[str, list[tuple[int, float]]], fixed=("rl.steps=30",), smoke=False) -> dict:
    body = {
        "fixed": list(fixed),
        "arms": {
            arm: {
                "overrides": [f"rl.loss={arm}"],
                "runs": [{"seed": s, "greedy_accuracy": v} for s, v in runs],
            }
            for arm, runs in arms.items()
        },
    }
    return {
        "benchmark": "evidence",
        "smoke": smoke,
        "comparisons": {"c1": {"title": "", "setups": {"smollm2": body}}},
    }


def test_merging_adds_the_runs_another_copy_recorded_and_refuses_a_conflict():
    merging = _load("evidence_merge")
    ours = _evidence({"ppo-clip": [(0, 0.5), (3, 0.54)], "espo": [(0, 0.51)]})
    theirs = _evidence({"ppo-clip": [(0, 0.5), (4, 0.57)], "espo": [(4, 0.55)], "gspo": [(4, 0.5)]})
    theirs["comparisons"]["c6-smollm2"] = _evidence({"grpo": [(0, 0.52)]})["comparisons"]["c1"]
    added = merging.merge(ours, theirs)
    assert sorted(added) == [
        "c1/smollm2/espo seed 4",
        "c1/smollm2/gspo seed 4",
        "c1/smollm2/ppo-clip seed 4",
        "c6-smollm2/smollm2/grpo seed 0",
    ]
    arms = ours["comparisons"]["c1"]["setups"]["smollm2"]["arms"]
    assert [r["seed"] for r in arms["ppo-clip"]["runs"]] == [0, 3, 4]  # the shared seed 0 once, in order
    assert arms["gspo"]["overrides"] == ["rl.loss=gspo"]
    assert ours["comparisons"]["c6-smollm2"]["setups"]["smollm2"]["fixed"] == ["rl.steps=30"]
    assert merging.merge(ours, theirs) == []  # nothing new the second time

    before = json.dumps(ours, sort_keys=True)
    other = _evidence({"ppo-clip": [(3, 0.60), (5, 0.5)]})  # seed 3 recorded here with another figure
    with pytest.raises(merging.MergeConflict, match="ppo-clip seed 3: two different records"):
        merging.merge(ours, other)
    assert json.dumps(ours, sort_keys=True) == before  # nothing half-merged (seed 5 not added)
    with pytest.raises(merging.MergeConflict, match="fixed settings"):
        merging.merge(ours, _evidence({"ppo-clip": [(5, 0.5)]}, fixed=("rl.steps=10",)))
    renamed = _evidence({"ppo-clip": [(5, 0.5)]})
    renamed["comparisons"]["c1"]["setups"]["smollm2"]["arms"]["ppo-clip"]["overrides"] = ["rl.loss=espo"]
    with pytest.raises(merging.MergeConflict, match="overrides"):
        merging.merge(ours, renamed)
    with pytest.raises(merging.MergeConflict, match="smoke"):
        merging.merge(ours, _evidence({"ppo-clip": [(5, 0.5)]}, smoke=True))
    unplanned = _evidence({"ppo-clip": [(5, 0.5)]})
    unplanned["comparisons"]["c9"] = unplanned["comparisons"].pop("c1")  # _write would not know it
    with pytest.raises(merging.MergeConflict, match="c9: no such comparison in the plan"):
        merging.merge(ours, unplanned)
    assert json.dumps(ours, sort_keys=True) == before


def test_merge_at_the_command_line_rejudges_or_exits_2_naming_the_file(tmp_path, capsys):
    bench = _load("evidence")
    (tmp_path / "evidence.json").write_text(
        json.dumps(_evidence({"ppo-clip": [(0, 0.5)], "espo": [(0, 0.48)]}))
    )
    returned = tmp_path / "gpu.json"
    returned.write_text(json.dumps(_evidence({"ppo-clip": [(1, 0.55)], "espo": [(1, 0.5)]})))
    assert bench.main(["--merge", str(returned), "--out", str(tmp_path)]) == 0
    assert "merged 2 run(s)" in capsys.readouterr().out
    body = json.loads((tmp_path / "evidence.json").read_text())["comparisons"]["c1"]["setups"]["smollm2"]
    espo = next(c for c in body["contrasts"] if c["arm"] == "espo" and c["reference"] == "ppo-clip")
    assert espo["seeds"] == [0, 1] and espo["mean_difference"] == pytest.approx(-0.035)  # rejudged
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert bench.main(["--merge", str(broken), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "not an evidence file" in err
    assert bench.main(["--merge", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
