"""C7 of docs/evidence.md: held-out accuracy after equal seconds of training, against TRL's GRPOTrainer on the
same card. Three arms (arms.py): `trl` (TRL on the smollm2 recipe's settings, the prompts in everyprompt's
order), `recipe` (configs/smollm2.yaml as shipped) and `gpu` (configs/smollm2-gpu.yaml, the project's GPU
recommendation). Each cell (arm, seed) runs in a process of its own, alone on the machine, for BUDGET_S
seconds of its training clock (clock.py: from its first step, model loading, snapshots and evaluations
excluded), with snapshots at MARKS_S evaluated after its training by one evaluation for every arm
(cell.py); the records go into bench/results/evidence.json as comparison `c7`, judged like the others
(`python -m bench.evidence --summary`). `python -m bench.time_to_accuracy` runs the cells not recorded."""

# the registration's figures (docs/evidence.md, C7): TRL's RL step of the recipe took 5.27 s on an H200
# (2026-11-28), so 180 s hold about 34 of its steps, above the recipe's 30
BUDGET_S = 180.0
MARKS_S = (45.0, 90.0, 135.0, 180.0)
