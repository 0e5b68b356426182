"""The evidence page of `everyprompt report` over an evidence file (bench/evidence/'s)."""

from __future__ import annotations

import base64
import json
import re

import pytest

from everyprompt.cli import main
from everyprompt.report.evidence import is_evidence, render_evidence
from tests.report.browser import laid_out, needs_chromium
from tests.test_bench import _load


def _payload() -> dict:
    """C1 on the tiny set-up, six seeds: ESPO a point or three above PPO-clip on every seed, GSPO mixed."""
    bench = _load("evidence")

    def runs(values):
        return [{"seed": s, "greedy_accuracy": v} for s, v in enumerate(values)]

    arms = {
        "ppo-clip": {"overrides": ["rl.loss=ppo_clip"], "runs": runs([0.80, 0.82, 0.79, 0.81, 0.80, 0.83])},
        "espo": {"overrides": ["rl.loss=espo"], "runs": runs([0.82, 0.83, 0.82, 0.82, 0.81, 0.85])},
        "gspo": {"overrides": ["rl.loss=gspo"], "runs": runs([0.81, 0.80, 0.80, 0.80, 0.82, 0.82])},
    }
    body = {"arms": arms, "seeds": list(range(6))}
    body["contrasts"] = bench.contrasts(bench.COMPARISONS["c1"], "tiny", arms)
    return {
        "benchmark": "evidence",
        "comparisons": {"c1": {"title": "the policy loss", "setups": {"tiny": body}}},
    }


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
def test_the_page_shows_every_seed_each_contrast_and_its_verdict():
    page = render_evidence(_payload())
    assert "C1: the policy loss, tiny" in page
    assert "0: 80.0 1: 82.0 2: 79.0" in page  # the baseline's seeds, as recorded
    assert "espo - ppo-clip" in page and "<strong>win</strong>" in page  # every pair above 0
    assert "<strong>no difference shown</strong>" in page  # gspo: -1 .. +1 by seed
    assert "reported, not judged" in page  # espo - gspo
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 1
    png = base64.b64decode(re.search(r'base64,([^"]+)"', page).group(1))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_reads_an_evidence_file(tmp_path, capsys):
    path = tmp_path / "evidence.json"
    path.write_text(json.dumps(_payload()))
    assert is_evidence(path) and not is_evidence(tmp_path / "nowhere.json")
    assert main(["report", str(path), "--html"]) == 0
    out = capsys.readouterr().out
    assert "espo - ppo-clip" in out and "win" in out
    assert "C1: the policy loss" in (tmp_path / "evidence.html").read_text()
    incomplete = _payload()
    body = incomplete["comparisons"]["c1"]["setups"]["tiny"]
    for contrast in body["contrasts"]:
        contrast["verdict"], contrast["seeds"] = None, [0, 1]
    assert "incomplete (2 seed pairs so far)" in render_evidence(incomplete)


@needs_chromium
def test_the_evidence_page_in_headless_chromium(tmp_path):
    page = render_evidence(_payload())
    assert laid_out(page, tmp_path, "tbody tr") == (1, 6)  # the figure; 3 arms and 3 contrasts
