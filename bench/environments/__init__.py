"""Multi-turn episodes: an observation's cost to the native engine, step-wise turns, and the calculator tool on
a real model.

Each runs from the repository's root:
- `python -m bench.environments.episodes`: What an environment's observation costs the native engine's
  multi-turn rollout: each observation fed in one forward from its row's length
- `python -m bench.environments.stepwise`: Step-wise episodes on the native engine: each turn joining one
  running call as its environment answers (`env.stepwise_schedule=continuous`,
- `python -m bench.environments.tools`: The calculator tool on a real model: SmolLM2-135M-Instruct on
  products of two 2-digit numbers (configs/smollm2-tools.yaml), with the calculator
"""
