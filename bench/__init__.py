"""The benchmarks, in rooms by concern; each is a module run from the repository's root as `python -m
bench.ROOM.NAME` (or a package of its own: `python -m bench.throughput`, `python -m bench.evidence`,
`python -m bench.time_to_accuracy`). Each room's `__init__.py` lists its benchmarks.

- `engine/`: the rollout engines' own costs (sampling, the matmul floor, the server, a judge, mismatch);
- `throughput/`: the engines' and the RL step's throughput against peers (the README's speed table);
- `learner/`: the learner and the RL step (against TRL's, its growth, time and memory, under contention);
- `quality/`: what RL buys (the losses, ZVE, real-model runs over seeds, rewards against people);
- `evidence/`: the pre-registered comparisons of docs/evidence.md and their verdict rules;
- `time_to_accuracy/`: held-out accuracy against wall-clock minutes, everyprompt against TRL;
- `environments/`: multi-turn episodes (an observation's cost, step-wise turns, the calculator tool);
- `distributed/`: scale-out, Ray checkpoints and weight syncs, asynchrony, runs killed and resumed;
- `gpu/`: a lent GPU's suite (`bash bench/gpu/suite.sh`) and its tables.

What they share: `common.py` (where results go, timing, the machine, a probe in a process of its own) and
`setups.py` (set-ups measured each in a fresh process). Results go to bench/results/, naming files by paths
relative to the repository.
"""
