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

# Each benchmark command the README and docs name, as a run of seconds to a minute on a tiny model:
# tests/test_bench_runs.py runs every one from the repository's root (and fails on a command a page names
# without an entry here). The arguments are split as a shell would; in them `{model}` is a 2-layer checkpoint
# directory, `{chat_model}` the same with a chat template (the chat endpoint, multi-turn environments),
# `{recipe}` a recipe of a few completions a step, `{completions}` an eval's completions.jsonl of four rows,
# `{results}` the repository's bench/results (only read), `{out}` a fresh directory for what a run writes.
TINY_RUN = (  # a real recipe shrunk through overrides
    "model.path={model} data.num_train=4 data.num_eval=4 rl.steps=1 rl.prompts_per_step=2 rl.group_size=2"
    " rl.micro_batch_size=4 rollout.max_new_tokens=8 checkpoint.every=0"
)
SMOKE: dict[str, str] = {
    "bench.distributed.async": "--tiny --out {out}",
    "bench.distributed.ray_checkpoint": "--tiny --repeats 1 --out {out}/ray_checkpoint.json",
    "bench.distributed.scale": "--tiny --out {out}",
    "bench.distributed.weight_sync": "--tiny --syncs 1 --out {out}/weight_sync.json",
    "bench.engine.serve": "--model {chat_model} --concurrency 2 --max-tokens 4 --out {out}",
    "bench.environments.episodes": "--tiny --rounds 1 --out {out}/episodes.json",
    "bench.environments.stepwise": "--tiny --rounds 1 --out {out}/stepwise.json",
    "bench.environments.tools": f"--seeds 0 --set {TINY_RUN.replace('{model}', '{chat_model}')} --out {{out}}",
    "bench.evidence": "--summary --out {results}",
    "bench.evidence.verdict_rule": "--reps 40 --resamples 20 --out {out}/verdict_rule.json",
    "bench.gpu.gpu_tables": "{results}/throughput_smollm2-135m-instruct_cuda_h200.json",
    "bench.learner.contention": "--smoke --out {out}/contention.json",
    "bench.learner.heap_trace": "--model {model} --config {recipe} --kept 4 --out {out}",
    "bench.learner.learner_profile": "--model {model} --config {recipe} --updates 1 --out {out}",
    "bench.learner.memory": "--model {model} --rows 2 --grad-rows 1 --length 32 --completion 8 --chunk 16 --out {out}",
    "bench.learner.rl_growth": "--model {model} --config {recipe} --groups 2 --lengths 4 --steps 2 --out {out}",
    "bench.learner.rl_step": "--model {model} --config {recipe} --steps 2 --trainers everyprompt --out {out}",
    "bench.learner.speed_table": "--results {results} --readme {out}/README.md",
    "bench.learner.training": "--tiny --steps 2 --out {out}",
    "bench.quality.gym_agreement": "--items 5 --out {out}/gym_agreement.json",
    "bench.quality.inversion": "--groups 200 --out {out}",
    "bench.quality.reward_audit": "sample {completions} --count 3 --out {out}/sheet.jsonl",
    "bench.quality.smollm2": f"--seeds 0 --set {TINY_RUN} --out {{out}}",
    # a budget: --tiny alone runs 12,800 rollouts an arm, and its ZVE arms retire the tiny set's every prompt
    "bench.quality.zve": "--tiny --budget 8 --evals 1 --workers 1 --seeds 0 --methods GRPO ZVE --out {out}",
    "bench.throughput": "--model {model} --quick --decode-only --out {out}",
    "bench.time_to_accuracy": "--smoke --out {out}",
}
