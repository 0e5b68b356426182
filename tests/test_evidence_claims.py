"""What the README claims from the evidence: its table is the one the results give, says how far each
contrast has run, and an exploratory win becomes a claim only once confirmed."""

from tests.test_bench import _load


def test_the_readme_claims_table_is_the_one_the_results_give():
    """The README's claims table is generated (python -m bench.evidence --readme); it must match the committed
    evidence file."""
    bench = _load("evidence")
    expected = bench.claims_table(bench.load(bench.RESULTS / "evidence.json"))
    assert bench.readme_section(bench.README.read_text()) == expected, (
        "run `python -m bench.evidence --readme`"
    )


def test_the_claims_table_says_how_far_each_contrast_has_run():
    bench = _load("evidence")

    def runs(values):
        return {"runs": [{"seed": s, "greedy_accuracy": v} for s, v in enumerate(values)]}

    arms = {"ppo-clip": runs([0.80] * 6), "espo": runs([0.82] * 6), "gspo": runs([0.80, 0.81])}
    rows = bench.claims_table({"comparisons": {"c1": {"setups": {"tiny": {"arms": arms}}}}}).splitlines()
    # the family waits for GSPO's seeds; the rule as first written judged ESPO on its own
    assert rows[2] == (
        "| C1 the policy loss | tiny | espo - ppo-clip | 6 | +2.0 | [+2.0, +2.0] | 0.000 | incomplete (6 of 6 "
        "seeds) | win (6 seeds) |"
    )
    assert rows[3] == (
        "| C1 the policy loss | tiny | gspo - ppo-clip | 2 | +0.5 | [-5.9, +6.9] | 0.500 | incomplete (2 of 6 "
        "seeds) | – |"
    )
    assert rows[4].endswith("| smollm2 | espo - ppo-clip | 0 | – | – | – | not run yet | – |")
    arms["gspo"] = runs([0.80, 0.81, 0.80, 0.79, 0.80, 0.80])
    rows = bench.claims_table({"comparisons": {"c1": {"setups": {"tiny": {"arms": arms}}}}}).splitlines()
    assert rows[2].endswith("| 0.000 (0.000) | **win** | win (6 seeds) |")
    assert rows[3].endswith("| **no difference shown** | no difference shown (6 seeds) |")


def test_an_exploratory_win_is_a_claim_only_once_confirmed():
    """docs/evidence.md: a win of the second step is a candidate; the README lists it only when the same
    runs on new seeds also win, never the candidate alone, never a failed confirmation."""
    bench = _load("evidence")
    tiny = "tiny"
    first, confirm = bench.COMPARISONS["c5-hard"], bench.COMPARISONS["c5-hard-confirm"]

    def body(comparison, espo):
        seeds = comparison.seeds_on(tiny)
        arms = {
            "ppo-clip": {"runs": [{"seed": s, "greedy_accuracy": 0.80} for s in seeds]},
            "espo": {"runs": [{"seed": s, "greedy_accuracy": v} for s, v in zip(seeds, espo, strict=True)]},
        }
        return {"setups": {"tiny": {"arms": arms}}}

    win, tie = [0.82] * 6, [0.78, 0.82] * 3

    def claims(first_espo, confirm_espo):
        recorded = {"c5-hard": body(first, first_espo)}
        if confirm_espo is not None:
            recorded["c5-hard-confirm"] = body(confirm, confirm_espo)
        return [row for row in bench.claims_table({"comparisons": recorded}).splitlines() if "C5" in row]

    assert claims(win, None) == []  # a candidate
    assert claims(win, tie) == []  # not confirmed
    assert claims(tie, win) == []  # no candidate to confirm
    assert claims(win, win) == [
        f"| C5-HARD-CONFIRM {confirm.title} | tiny | espo - ppo-clip | 6 | +2.0 | [+2.0, +2.0] | 0.000 (0.000) | "
        "**win** | win (6 seeds) |"
    ]
