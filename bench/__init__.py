"""The benchmarks: each a module run from the repository's root, `python -m bench.NAME` (bench/throughput
and bench/evidence are packages: `python -m bench.throughput`, `python -m bench.evidence`); what they share
is common.py. Results go to bench/results/, naming files by paths relative to the repository."""
