"""The rollout engines' own costs: sampling, the matrix-product floor, the server under load, a judge's
throughput, and the train-inference mismatch.

Each runs from the repository's root:
- `python -m bench.engine.floor`: The matrix-product floor of a computation: the matrix products (GEMMs) it
  dispatches, recorded with their shapes, strides and dtypes, then run alone
- `python -m bench.engine.genrm`: GenRM judge throughput: completions judged per second at reward batch size
  1 against 16, in one run.
- `python -m bench.engine.mismatch`: Train/inference mismatch: engine precision x router replay, on the demo
  model after SFT.
- `python -m bench.engine.mismatch_analysis`: The per-token analysis of bench/engine/mismatch.py: the router
  perturbation between the engine's and the trainer's router logits, how a route flip ...
- `python -m bench.engine.sampling`: Sampling cost: `sample_tokens` (temperature, nucleus filter, counter-
  based noise, argmax, log-prob and entropy) eager against its compiled graph (the
- `python -m bench.engine.serve`: `everyprompt serve` under load: the same chat requests one at a time and
  all at once (continuous batching), through the official `openai` client
"""
