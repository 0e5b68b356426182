"""What the commands run: `train` (SFT warm start, RL, held-out evaluation), `demo` (the same with the
evaluation before RL too, and a table), `warm_start` (SFT alone), `evaluate_checkpoint` and
`filter_prompts` (ZVE stage 0 on a prompt file)."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from everyprompt.config import Config
from everyprompt.data import load_prompt_file
from everyprompt.hub import is_hub_name
from everyprompt.models.io import load_pretrained
from everyprompt.models.precision import training_dtype
from everyprompt.pipeline.resume import resolve_checkpoint
from everyprompt.pipeline.run import Run
from everyprompt.report.console import accuracy_table
from everyprompt.rollout import build_engine
from everyprompt.run.files import write_json_atomic, write_jsonl_atomic
from everyprompt.run.layout import eval_dir
from everyprompt.run.machine import machine
from everyprompt.trainer import RLTrainer
from everyprompt.zve.workflow import FilteredFile, filter_prompt_file


def train(config: Config, run_dir: str | Path | None = None, resume: bool = False) -> RLTrainer:
    """SFT warm start (if configured), then RL, then the held-out evaluation (`eval.json`); returns the
    trainer after its last step, closed (its workers have ended)."""
    run = Run(config, run_dir)
    with run.removed_on_failure():
        trainer = run.trainer(resume=resume)
        try:
            trainer.train(evaluate_fn=lambda engine: run.evaluate(engine, trainer.tokenizer))
            results = run.evaluate(trainer.engine, trainer.tokenizer)  # held-out, after the last step
        finally:
            trainer.close()  # reward workers, and with cluster.backend=ray the actors and the Ray session
    write_json_atomic(run.layout.eval_results, {"step": trainer.step, **results})
    pass_key = f"pass@{config.eval.pass_k}"
    sampled = (
        f", {pass_key} {results[pass_key]:.1%}" if pass_key in results else ""
    )  # eval.num_samples=0: none
    run.console.print(
        f"held-out after RL step {trainer.step}: greedy accuracy {results['greedy_accuracy']:.1%}{sampled} "
        f"({int(results['num_prompts'])} prompts; {run.layout.eval_results.name})"
    )
    run.console.print(f"run directory: {run.run_dir}")
    return trainer


def demo(config: Config, run_dir: str | Path | None = None, console: Console | None = None) -> dict:
    """SFT warm start, held-out eval, RL, held-out eval; prints the table and writes the demo summary."""
    started = time.perf_counter()
    run = Run(config, run_dir, console)
    with run.removed_on_failure():
        trainer = run.trainer()
        try:
            before = run.evaluate(trainer.engine, trainer.tokenizer)
            start = "after SFT" if config.sft.steps else "before RL"
            run.console.print(f"{start}: greedy accuracy {before['greedy_accuracy']:.1%}")
            trainer.train(evaluate_fn=lambda engine: run.evaluate(engine, trainer.tokenizer))
            after = run.evaluate(trainer.engine, trainer.tokenizer)
        finally:
            trainer.close()  # reward workers, and with cluster.backend=ray the actors and the Ray session
    summary = {
        "accuracy_before_rl": before["greedy_accuracy"],
        "accuracy_after_rl": after["greedy_accuracy"],
        "eval_before_rl": before,
        "eval_after_rl": after,
        "rl_steps": trainer.step,
        "seed": config.seed,
        "wall_seconds": time.perf_counter() - started,
        "run_dir": str(run.run_dir.resolve()),
        "machine": machine(training_dtype(config.model.dtype, run.device)),
    }
    write_json_atomic(run.layout.demo_summary, summary)
    out = console or Console()
    out.print(accuracy_table(before, after, f"pass@{config.eval.pass_k}"))
    out.print(
        f"wall time {summary['wall_seconds']:.0f} s; run directory {run.run_dir} ({run.layout.demo_summary.name}, "
        f"{run.layout.metrics.name}, {run.layout.tensorboard.name}/, {run.layout.checkpoints.name}/); "
        f"`everyprompt report {run.run_dir}` draws its curves"
    )
    return summary


def warm_start(config: Config, run_dir: str | Path | None = None) -> Path:
    """The SFT stage alone (reused or continued when the run directory holds it); its checkpoint."""
    run = Run(config, run_dir)
    with run.removed_on_failure():
        run.warm_started_model()
    run.console.print(f"SFT checkpoint: {run.layout.sft_checkpoint}")
    return run.layout.sft_checkpoint


def evaluate_checkpoint(
    config: Config,
    checkpoint: str | Path,
    data: str | None = None,
    fields: dict[str, str] | None = None,
    run_dir: str | Path | None = None,
) -> dict[str, float]:
    """Held-out evaluation of a checkpoint (or a run directory's latest) on `data` (a prompt file, its
    columns mapped by `data.columns` and `fields`) or the config's held-out rows; writes `eval.json` and
    the greedy completions (`completions.jsonl`: prompt, completion, extracted answer, reward) into
    `run_dir` (default: CHECKPOINT/eval, NAME-eval beside a .gguf file, ORG--NAME-eval for a Hub id)."""
    path = resolve_checkpoint(checkpoint)
    named = str(checkpoint) if is_hub_name(checkpoint) else None  # a Hub id: its snapshot is the cache's
    run = Run(config, run_dir=run_dir or eval_dir(path, named))  # also quiets library progress bars
    model, tokenizer = load_pretrained(path)
    columns = {**config.data.columns, **(fields or {})}
    rows = load_prompt_file(data, columns, what="--data") if data else None
    engine = build_engine(config.rollout, model, tokenizer)
    completions: list[dict] = []
    results = run.evaluate(engine, tokenizer, rows, completions, progress=True)
    write_json_atomic(run.layout.eval_results, results)
    write_jsonl_atomic(run.layout.completions, completions)
    if completions:
        first = completions[0]
        run.console.print("prompt 1 as the model saw it, and its greedy completion:")
        run.console.print(repr(first["prompt"]), markup=False, highlight=False)
        run.console.print(repr(first["completion"]), markup=False, highlight=False)
    run.console.print(f"wrote {run.layout.eval_results} and {run.layout.completions.name}")
    return results


def filter_prompts(
    config: Config, data: str, model: str | Path, out: str | Path | None = None
) -> FilteredFile:
    """ZVE stage 0 on `data` (a prompt file, or `builtin`: the config's RL prompts) with the model at
    `model`: writes the kept rows, a report, a histogram and the pass-rate store into `out` (default:
    DATA-filtered)."""
    builtin = data == "builtin"
    checkpoint = resolve_checkpoint(model)
    out = Path(out or (f"{Path(data).stem}-filtered" if not builtin else "builtin-filtered"))
    # a bad file fails first
    rows = None if builtin else load_prompt_file(data, config.data.columns, what="DATA")
    run = Run(config, run_dir=out)
    rows = run.rows.rl() if rows is None else rows
    policy, tokenizer = load_pretrained(checkpoint)
    return filter_prompt_file(policy, tokenizer, rows, config, out, data, str(checkpoint))
