"""A lent GPU: the models its suite measures (suite.sh runs them), and docs/gpu.md's tables from its results.

Each runs from the repository's root:
- `python -m bench.gpu.gpu_models`: The models bench/gpu/suite.sh measures: SmolLM2-135M-Instruct and its
  8-expert sparse upcycle, or (with `--smoke`) a tiny dense Llama and its
- `python -m bench.gpu.gpu_tables`: docs/gpu.md's decode-step table from a lent GPU's `dense` (or `moe`)
  result: what the suite's bench/throughput wrote (throughput_<model>_cuda.json),
- `bash bench/gpu/suite.sh`: the suite a lent GPU runs (`--dry-run`, `--smoke`: on the CPU)
"""
