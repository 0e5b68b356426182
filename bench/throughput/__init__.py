"""The rollout-throughput benchmark (`python bench/throughput`, __main__.py): the engine against transformers'
`generate` (engine.py), on a real model (model.py), against its own matrix products (floor.py), rewards
overlapped and length-aware scheduling (rollout.py), one RL step against TRL (rl.py), and their shared set-up
(setup.py)."""
