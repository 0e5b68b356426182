"""The learner and the RL step: one step against TRL's, how it grows with the group and the completion, where
its time and memory go, training set-ups, and the step beside another busy process.

Each runs from the repository's root:
- `python -m bench.learner.contention`: The RL step beside another busy process: how much slower it runs
  when something else takes one core.
- `python -m bench.learner.heap_trace`: Where an RL step's resident memory goes: the process's resident set
  against the bytes glibc's malloc has handed out (in use) and holds free, sampled
- `python -m bench.learner.learner_profile`: Where a learner update's time goes: one RL update of a recipe
  (configs/smollm2.yaml by default) timed and profiled with torch.profiler, on the
- `python -m bench.learner.memory`: Peak memory and time of the trainer's log-prob pass: the model's full
  logits against the chunked LM head (`model.logprob_chunk`,
- `python -m bench.learner.rl_growth`: How the RL step's time and peak memory grow with the group size and
  with the completion length: everyprompt against TRL's GRPOTrainer at each point,
- `python -m bench.learner.rl_step`: One RL step on a real model: everyprompt against TRL's GRPOTrainer on
  the same model, prompts, group size, completion cap, learning rate and
- `python -m bench.learner.speed_table`: The README's speed table, generated from the model benchmarks'
  results (bench/results/throughput_*.json written by `bench/throughput --model PATH`,
- `python -m bench.learner.training`: Training set-ups side by side: peak memory and step time of full fp32,
  bf16 autocast (as `auto` computes it on this CPU, and on torch's own bf16
- `python -m bench.learner.trl_grpo`: TRL's GRPOTrainer on an everyprompt recipe: the same model, prompts
  (as the recipe's data format renders them: a chat model's as conversations, which
"""
