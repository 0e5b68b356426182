"""What RL buys: the losses side by side, zero-variance elimination, real-model runs over seeds, the reward
model against the judge, and how the rewards read answers.

Each runs from the repository's root:
- `python -m bench.quality.algorithms`: Ablation of the policy losses: GRPO, DAPO, GSPO and ESPO on the demo
  task.
- `python -m bench.quality.gym_agreement`: The `reasoning_gym` reward against each task's own scorer, item
  by item (docs/data.md).
- `python -m bench.quality.inversion`: Advantage inversion: a noisy scalar reward model vs a ternary judge,
  on groups of known true quality.
- `python -m bench.quality.reward_audit`: How often the math reward reads a chat model's answer otherwise
  than a person does (docs/rewards.md).
- `python -m bench.quality.smollm2`: RL on a real model: SmolLM2-135M-Instruct with configs/smollm2.yaml,
  over several seeds.
- `python -m bench.quality.zve`: Zero-variance elimination: (a) the binomial law on a synthetic bandit, (b)
  GRPO vs ZVE on the demo task.
"""
