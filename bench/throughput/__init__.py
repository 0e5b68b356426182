"""The rollout-throughput benchmark (`python -m bench.throughput`, __main__.py): the engine against transformers'
`generate` (engine.py), on a real model (model.py, with equal work in work.py and the compiled and static
steps beside the plain one in steps.py), against its own matrix products (floor.py), rewards overlapped and
length-aware scheduling (rollout.py), one RL step against TRL (rl.py), and their shared set-up (setup.py)."""
