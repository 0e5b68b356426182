"""Smoke tests of the benchmark scripts on a 2-layer model (the real runs are minutes long)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_algorithms_bench_smoke(tmp_path, capsys):
    bench = _load("algorithms")
    args = "--tiny --steps 2 --evals 1 --workers 1 --seeds 0".split() + ["--out", str(tmp_path)]
    assert bench.main([*args, "--methods", "DAPO", "ESPO"]) == 0
    payload = json.loads((tmp_path / "algorithms.json").read_text())
    assert [(r["method"], r["seed"]) for r in payload["runs"]] == [("DAPO", 0), ("ESPO", 0)]
    for run in payload["runs"]:
        # initial eval, one during the run (step 1), final (step 2)
        assert [e["step"] for e in run["evals"]] == [0, 1, 2]
        assert len(run["per_step"]["actor/clip_fraction"]) == 2
    assert "espo/clip_fraction_high" in payload["runs"][1]["espo"]
    assert (tmp_path / "algorithms.png").stat().st_size > 0
    assert "Policy-loss ablation" in capsys.readouterr().out


def test_zve_bench_smoke(tmp_path, capsys):
    bench = _load("zve")
    args = "--tiny --budget 8 --evals 1 --workers 1 --seeds 0 --methods GRPO ZVE".split()
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "zve.json").read_text())
    assert [(r["method"], r["seed"]) for r in payload["runs"]] == [("GRPO", 0), ("ZVE", 0)]
    grpo, zve = payload["runs"]
    assert grpo["rollouts"] == 8 and zve["rollouts"] >= 8  # the budget stops both (ZVE may overshoot a step)
    for row in payload["bandit"]:  # the binomial law, within sampling error of 200 groups
        assert abs(row["measured"] - row["predicted"]) < 0.15
    assert (tmp_path / "zve.png").stat().st_size > 0
    assert "equal rollout budget" in capsys.readouterr().out


def test_mismatch_bench_smoke(tmp_path, capsys):
    bench = _load("mismatch")
    assert bench.main(["--tiny", "--batches", "1", "--rl-steps", "1", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "mismatch.json").read_text())
    cells = {(c["precision"], c["replay"]): c for c in payload["cells"]}
    assert len(cells) == 6
    for precision in ("fp32", "bf16", "fp8"):
        assert cells[(precision, "r3")]["mismatch/routing_agreement"] == 1.0  # replay: by construction
    assert cells[("fp8", "off")]["mismatch/logp_abs_diff"] > cells[("fp32", "off")]["mismatch/logp_abs_diff"]
    assert cells[("fp8", "r3")]["rl"]["all_finite"]
    assert "mismatch per precision and replay mode" in capsys.readouterr().out
