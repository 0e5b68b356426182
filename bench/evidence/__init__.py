"""The evidence bench (docs/evidence.md), a package of its own: the plan of the pre-registered comparisons
(plan.py), running their cells as sweeps and recording them (run.py: `python -m bench.evidence`), the
verdicts and the README's claims table (verdicts.py), the evidence file's reading, locked writing and
merging (store.py, merge.py: the file's layout is read through report/evidence.py's `arm_runs`)."""

from bench.evidence.plan import COMPARISONS, SETUPS, TEACHER_SEED, Comparison, Setup
from bench.evidence.run import RESULTS, adopt_cut_short, fixed_overrides, harvest, main, pending_sweeps
from bench.evidence.store import load, locked, merge_file, save, write
from bench.evidence.verdicts import README, claims_table, contrasts, readme_section, write_readme

__all__ = [
    "COMPARISONS",
    "README",
    "RESULTS",
    "SETUPS",
    "TEACHER_SEED",
    "Comparison",
    "Setup",
    "adopt_cut_short",
    "claims_table",
    "contrasts",
    "fixed_overrides",
    "harvest",
    "load",
    "locked",
    "main",
    "merge_file",
    "pending_sweeps",
    "readme_section",
    "save",
    "write",
    "write_readme",
]
