"""TRL's GRPOTrainer on an everyprompt recipe: the same model, prompts (as the recipe's data format renders
them: a chat model's as conversations, which TRL renders with the same chat template), math reward,
group size, prompts per step, learning rate, completion cap, temperature and precision. The RL-step bench
(bench/throughput/rl.py) and C7's TRL arm (bench/time_to_accuracy/) both build it here. TRL comes with the
`bench` extra; it generates with transformers' `generate` (vLLM does not install on this project's
machines)."""

from __future__ import annotations

from pathlib import Path


def trl_on_cpu(config) -> bool:
    """Whether TRL runs on the CPU: where the recipe's learner would (`model.device`; `auto` is the GPU
    when there is one). A fixed `use_cpu=True` had TRL on the CPU beside everyprompt on a GPU."""
    from everyprompt.devices.placement import resolve_device

    return resolve_device(config.model.device).type == "cpu"


def trl_dataset(config, tokenizer, rows: list[dict]):
    """`rows` (prompt, answer) as TRL's dataset: conversations for a chat format, else plain text."""
    from datasets import Dataset

    from everyprompt.data.formatting import ChatFormat, prompt_format_of

    chat = isinstance(prompt_format_of(config, tokenizer), ChatFormat)
    system = [{"role": "system", "content": config.data.system_prompt}] if config.data.system_prompt else []

    def prompt(text: str):
        return [*system, {"role": "user", "content": text}] if chat else text

    return Dataset.from_list([{"prompt": prompt(r["prompt"]), "answer": r["answer"]} for r in rows])


def math_reward_for_trl(prompts, completions, answer, **_):
    """The recipe's math reward as a plain TRL reward function (a completion it cannot read scores 0)."""
    from everyprompt.rewards import math_reward

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [0.0 if r is None else r for r in math_reward(texts, answer=answer)]


def grpo_config(config, run_dir: Path, max_steps: int, matched: bool, shuffle: bool = True):
    """GRPOConfig for the recipe: one generation of the whole step, `rl.mini_batches` optimizer steps over
    it (as everyprompt's learner), token-mean loss (`dapo`), no KL term, one pass. `matched`: its
    micro-batch is the recipe's `rl.micro_batch_size` on TRL's device (gradient accumulation up to the
    mini-batch, as everyprompt's learner does; `auto` with a token budget, which TRL has not: the whole
    mini-batch, as everyprompt's pass of SmolLM2's 64 sequences is); else one micro-batch holds a whole
    mini-batch. `shuffle=False`: the prompts in the dataset's order."""
    from trl import GRPOConfig

    rl = config.rl
    completions_per_step = rl.prompts_per_step * rl.group_size
    mini_batch = completions_per_step // rl.mini_batches
    size, _ = rl.micro_batching("cpu" if trl_on_cpu(config) else "cuda")
    micro = min(size or mini_batch, mini_batch) if matched else mini_batch
    return GRPOConfig(
        output_dir=str(run_dir),
        per_device_train_batch_size=micro,
        steps_per_generation=completions_per_step // micro,
        gradient_accumulation_steps=mini_batch // micro,
        num_generations=rl.group_size,
        max_completion_length=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature,
        learning_rate=rl.lr,
        max_grad_norm=rl.max_grad_norm,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=trl_on_cpu(config),  # TRL on the device the recipe trains on: the same card as ours
        bf16=config.model.dtype == "bf16",  # autocast, as model.dtype=bf16 is
        seed=config.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,  # TRL's default recomputes activations; everyprompt's trainer does not
        shuffle_dataset=shuffle,
    )


def grpo_trainer(model, tokenizer, args, dataset, callbacks=(), optimizers=(None, None)):
    """TRL's trainer with the recipe's math reward, without its per-step printout."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=math_reward_for_trl,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
        optimizers=optimizers,
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the tables
    return trainer
