"""Runs: the run directory, the data and model of a config, and the train / demo pipelines."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from datetime import datetime
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from everyprompt.config import Config, ConfigError, save_config
from everyprompt.data import DataError, load_prompt_file, make_splits
from everyprompt.data.formatting import prompt_format_of
from everyprompt.data.passrate import PassRateStore
from everyprompt.evaluate import evaluate
from everyprompt.models.experts import select_moe_kernel
from everyprompt.models.io import load_model_and_tokenizer, load_pretrained
from everyprompt.models.lora import load_adapter
from everyprompt.models.precision import enable_gradient_checkpointing
from everyprompt.report.runs import WARNINGS_FILE
from everyprompt.rewards import build_reward
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout import SamplingParams, build_engine, resolve_engine
from everyprompt.rollout.stops import stop_token_ids
from everyprompt.trainer import RLTrainer, run_sft, save_checkpoint
from everyprompt.trainer.checkpoint import (
    CheckpointError,
    checkpoint_root,
    latest_complete_checkpoint,
    load_trainer_state,
    newest_complete,
    step_checkpoints,
    verify_checkpoint,
    write_json_atomic,
)
from everyprompt.trainer.metrics import progress_bar
from everyprompt.trainer.wandb_run import require_wandb
from everyprompt.zve import estimate_pass_rates, filter_by_pass_rate, seeded_sample

log = logging.getLogger(__name__)


class _RunWarnings(logging.FileHandler):
    """everyprompt's warnings, also kept in the run directory (the cross-run report lists them)."""

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if not logging.getLogger().handlers:  # nobody else shows it: print it as Python would have
            logging.lastResort.handle(record)


def record_warnings(run_dir: Path) -> None:
    """From now on everyprompt's warnings go to RUN_DIR/warnings.log too (one run directory at a time)."""
    logger = logging.getLogger("everyprompt")
    for handler in [h for h in logger.handlers if isinstance(h, _RunWarnings)]:
        logger.removeHandler(handler)
        handler.close()
    handler = _RunWarnings(run_dir / WARNINGS_FILE, encoding="utf-8", delay=True)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)


def quiet_libraries() -> None:
    """Silence library progress bars and advisory warnings that would bury our own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class Run:
    """One run directory and what a config needs: data splits, model, evaluation."""

    def __init__(self, config: Config, run_dir: str | Path | None = None, console: Console | None = None):
        quiet_libraries()
        self.config = config
        self.console = console or Console(stderr=True)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir or config.run_dir or f"runs/{config.name}-{stamp}")
        try:  # fail now, not at the first checkpoint an hour in
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise CheckpointError(
                f"{self.run_dir}: cannot write the run directory ({err.strerror or err})"
            ) from None
        record_warnings(self.run_dir)
        if config.logging.wandb.enabled:  # a missing extra fails now, not when the first step logs
            require_wandb()
        if config.threads:
            torch.set_num_threads(config.threads)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self._splits = None
        self._shown: set[str] = set()  # stages whose first rendered prompt was printed

    # ------------------------------------------------------------ data
    def _builtin(self):
        if self._splits is None:
            data = self.config.data
            self._splits = make_splits(data.split_seed, data.num_train, data.num_eval, data.levels)
        return self._splits

    def rl_rows(self) -> list[dict]:
        data = self.config.data
        if data.train_file:
            return load_prompt_file(data.train_file, data.columns)
        levels = set(self.config.rl.levels or data.levels)
        return [p.as_row() for p in self._builtin()[0] if p.level in levels]

    def sft_rows(self) -> list[dict]:
        """The worked solutions SFT trains on; a train file without them is a config error (sft.steps)."""
        data = self.config.data
        if not data.train_file:
            levels = set(self.config.sft.levels)
            return [p.as_row() for p in self._builtin()[0] if p.level in levels]
        rows = load_prompt_file(data.train_file, data.columns, require=())
        lacking = [i for i, row in enumerate(rows) if not row.get("solution")]
        if lacking:
            column = data.columns.get("solution", "solution")
            raise ConfigError(
                f"config key 'sft.steps': SFT ({self.config.sft.steps} steps) needs a worked solution per "
                f"row, and row {lacking[0] + 1} of {data.train_file} has no {column!r} (map the column "
                "with data.columns.solution=COLUMN, or set sft.steps=0)"
            )
        return rows

    def eval_rows(self) -> list[dict]:
        data = self.config.data
        if data.eval_file:
            return load_prompt_file(data.eval_file, data.columns)
        return [p.as_row() for p in self._builtin()[1]]

    # ------------------------------------------------------------ model
    def warm_started_model(self):
        """The starting policy: the configured model, after the SFT stage when `sft.steps` > 0.

        A finished SFT checkpoint in the run directory is reused; an SFT stage that was cut short continues
        from its newest complete `sft_step_N` checkpoint.
        """
        root = checkpoint_root(self.run_dir)
        if self.config.sft.steps and (root / "sft").is_dir():
            try:
                verify_checkpoint(root / "sft")
                model, tokenizer = load_pretrained(root / "sft")
                return self.prepare_for_training(model), tokenizer
            except CheckpointError as err:
                log.warning("the SFT checkpoint is damaged (%s); SFT runs again", err)
        sft_rows = self.sft_rows() if self.config.sft.steps else []  # bad SFT data fails before any loading
        partial = newest_complete(root, "sft_step_") if self.config.sft.steps else None
        if partial is not None:
            model, tokenizer = load_pretrained(partial)
            resume = load_trainer_state(partial)
            self.console.print(f"SFT resumes from {partial} at step {resume['step']}")
        else:
            model, tokenizer = load_model_and_tokenizer(self.config.model, self.config.seed)
            resume = None
        self.announce_engine(model.config)  # before any training: a model no engine runs stops here
        self.prepare_for_training(model)
        if self.config.sft.steps:
            prompt_format = prompt_format_of(self.config, tokenizer, stop_token_ids(model, tokenizer))
            run_sft(
                model,
                tokenizer,
                sft_rows,
                self.config.sft,
                self.config.seed,
                self.run_dir,
                self.config.logging,
                pack_sequences=self.config.model.pack_sequences,
                dtype=self.config.model.dtype,
                resume=resume,
                prompt_format=self.show_format(prompt_format, "SFT", sft_rows[0]),
            )
            save_checkpoint(self.run_dir, "sft", model, tokenizer, state=None)
            for stale in step_checkpoints(root, "sft_step_"):
                shutil.rmtree(stale)
        return model, tokenizer

    def prepare_for_training(self, model):
        """The policy with the configured training MoE kernel and gradient checkpointing."""
        select_moe_kernel(model, self.config.model.moe_kernel)
        if self.config.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return model

    def announce_engine(self, model_config) -> str:
        """The engine that will decode this model (UnsupportedModelError if the configured one cannot),
        printed once with why when `auto` chose it."""
        configured = self.config.rollout.engine
        engine = resolve_engine(configured, model_config, self.config.rollout.precision)
        how = (
            f"auto: the fastest engine for {model_config.model_type}"
            if configured == "auto"
            else "configured"
        )
        self.console.print(f"rollout engine: {engine} ({how})")
        return engine

    def trainer(self, resume: bool = False) -> RLTrainer:
        """The RL trainer of this run. With `resume`, whichever phase was cut short continues: RL from its
        newest complete checkpoint, else the run restarts RL from its beginning, reusing a finished SFT
        stage and offline filter (SFT itself continues from its own checkpoints)."""
        save_config(self.config, self.run_dir / "config.yaml")
        if resume and not step_checkpoints(checkpoint_root(self.run_dir)):
            resume = False  # RL never checkpointed: its pass rates start again from the run's start
            (self.run_dir / "passrates.sqlite").unlink(missing_ok=True)
        store = self.pass_rate_store()
        if resume:
            latest = latest_complete_checkpoint(self.run_dir)
            if self.config.model.lora.enabled:  # the adapter on the run's own base (SFT or model.path)
                base, tokenizer = self.warm_started_model()
                model, reference = load_adapter(base, latest), None
            else:
                model, tokenizer = load_pretrained(latest)
                self.prepare_for_training(model)
                reference = self.warm_started_model()[0] if self.config.rl.kl.estimator else None
            trainer = RLTrainer.build(
                self.config, model, tokenizer, self.filtered_rl_rows(), self.run_dir, reference, store
            )
            try:
                trainer.load_state_dict(load_trainer_state(latest))
            except BaseException:
                trainer.close()
                raise
            self.console.print(f"resumed from {latest} at step {trainer.step}")
            return trainer
        rows, filter_rollouts = self.rl_rows(), 0  # bad RL data fails before SFT, not after it
        model, tokenizer = self.warm_started_model()
        if self.config.zve.enabled and self.config.zve.filter.enabled:
            if (self.run_dir / "filter.json").is_file():  # it finished before the run was cut short
                rows, filter_rollouts = self.filtered_rl_rows(store), self._filter_report()["rollouts"]
            else:
                rows, filter_rollouts = self.offline_filter(model, tokenizer, rows, store)
        trainer = RLTrainer.build(self.config, model, tokenizer, rows, self.run_dir, store=store)
        trainer.rollouts_total = filter_rollouts  # the filter's samples count against rl.max_rollouts
        self.show_format(trainer.rollout.prompt_format, "RL", rows[0])
        return trainer

    def show_format(self, prompt_format, stage: str, row: dict):
        """Print once per stage how the first prompt is rendered (what the model sees); returns the format."""
        if stage not in self._shown:
            self._shown.add(stage)
            self.console.print(f"{stage} prompt 1 as the model sees it (data.format={prompt_format.name}):")
            self.console.print(repr(prompt_format.text(row)), markup=False, highlight=False)
        return prompt_format

    # ------------------------------------------------------------ zero-variance elimination
    def pass_rate_store(self) -> PassRateStore:
        """The run's store (`passrates.sqlite`), seeded from `zve.pass_rates` when the run starts."""
        zve = self.config.zve
        path = self.run_dir / "passrates.sqlite"
        fresh = not path.exists()
        store = PassRateStore(path, ema_decay=zve.retirement.ema_decay)
        if fresh and zve.pass_rates:
            source = Path(zve.pass_rates)
            if not source.is_file():
                raise ConfigError(f"config key 'zve.pass_rates': no pass-rate store at {source}")
            store.load_state_dict(PassRateStore(source).state_dict())
        return store

    def offline_filter(
        self, model, tokenizer, rows: list[dict], store: PassRateStore
    ) -> tuple[list[dict], int]:
        """ZVE stage 0 before RL: estimate pass rates with the starting policy, keep low < p < high.

        Returns the kept rows and the number of rollouts the estimate cost.
        """
        config, rules = self.config, self.config.zve.filter
        chosen = seeded_sample(range(len(rows)), rules.max_prompts, config.seed)
        candidates = [rows[i] for i in chosen]
        started = time.perf_counter()
        estimate, result = run_offline_filter(model, tokenizer, candidates, config, store)
        kept = [chosen[i] for i in result.kept]
        report = {
            "prompts": len(rows),
            "estimated": len(candidates),
            "samples": rules.samples,
            "kept": len(kept),
            "too_easy": result.too_easy,
            "too_hard": result.too_hard,
            "unscored": result.unscored,
            "reward_errors": estimate.errors,
            "histogram": result.histogram,
            "seconds": time.perf_counter() - started,
            "rollouts": len(candidates) * rules.samples,
            "kept_indices": kept,
            "records": estimate.records(candidates),  # the store's step -1, again on a resume
        }
        write_json_atomic(self.run_dir / "filter.json", report)
        self.console.print(
            f"offline filter: kept {len(kept)} of {len(candidates)} prompts "
            f"({result.too_easy} too easy, {result.too_hard} too hard) in {report['seconds']:.0f} s"
        )
        if not kept:
            raise DataError(
                f"the offline filter kept no prompt ({result.too_easy} too easy, {result.too_hard} too hard); "
                "widen zve.filter.low / zve.filter.high"
            )
        return [rows[i] for i in kept], len(candidates) * rules.samples

    def _filter_report(self) -> dict:
        report = self.run_dir / "filter.json"
        if not report.is_file():
            raise DataError(f"{report}: missing; the run's offline filter result is needed to resume")
        return json.loads(report.read_text())

    def filtered_rl_rows(self, store: PassRateStore | None = None) -> list[dict]:
        """The RL prompts of this run: after the offline filter when it ran (its kept list is saved).
        With `store`, the filter's pass rates are recorded in it again (RL restarts from its start)."""
        rows = self.rl_rows()
        if not (self.config.zve.enabled and self.config.zve.filter.enabled):
            return rows
        report = self._filter_report()
        if store is not None:
            store.record([tuple(r) for r in report["records"]], step=-1)
        return [rows[i] for i in report["kept_indices"]]

    def evaluate(self, engine, tokenizer, rows: list[dict] | None = None) -> dict[str, float]:
        config = self.config
        return evaluate(
            engine,
            tokenizer,
            rows if rows is not None else self.eval_rows(),
            build_reward(config.rewards),  # no run_dir: judge samples are logged for training only
            max_new_tokens=config.rollout.max_new_tokens,
            num_samples=config.eval.num_samples,
            pass_k=config.eval.pass_k,
            temperature=config.eval.temperature,
            seed=config.seed,
            stop=tuple(config.rollout.stop),
            prompt_format=prompt_format_of(config, tokenizer),
            workers=config.rewards.workers,
            timeout_s=config.rewards.timeout_s,
        )


def train(config: Config, run_dir: str | Path | None = None, resume: bool = False) -> RLTrainer:
    """SFT warm start (if configured), then RL, then the held-out evaluation (`eval.json`); returns the
    trainer after its last step, closed (its workers have ended)."""
    run = Run(config, run_dir)
    trainer = run.trainer(resume=resume)
    try:
        trainer.train(evaluate_fn=lambda engine: run.evaluate(engine, trainer.tokenizer))
        results = run.evaluate(trainer.engine, trainer.tokenizer)  # held-out, after the last step
    finally:
        trainer.close()  # reward workers, and with cluster.backend=ray the actors and the Ray session
    write_json_atomic(run.run_dir / "eval.json", {"step": trainer.step, **results})
    pass_key = f"pass@{config.eval.pass_k}"
    run.console.print(
        f"held-out after RL step {trainer.step}: greedy accuracy {results['greedy_accuracy']:.1%}, "
        f"{pass_key} {results.get(pass_key, float('nan')):.1%} ({int(results['num_prompts'])} prompts; eval.json)"
    )
    run.console.print(f"run directory: {run.run_dir}")
    return trainer


def accuracy_table(before: dict[str, float], after: dict[str, float], pass_key: str) -> Table:
    table = Table(title="Held-out accuracy before and after RL")
    for column in (
        "split",
        "greedy before",
        "greedy after",
        "change",
        f"{pass_key} before",
        f"{pass_key} after",
    ):
        table.add_column(column, justify="right")
    levels = sorted(k.split("/", 1)[1] for k in before if k.startswith("greedy_accuracy/"))
    for label, suffix in [("overall", "")] + [(lvl.replace("_", " "), "/" + lvl) for lvl in levels]:
        b, a = before[f"greedy_accuracy{suffix}"], after[f"greedy_accuracy{suffix}"]
        pb, pa = (
            before.get(f"{pass_key}{suffix}", float("nan")),
            after.get(f"{pass_key}{suffix}", float("nan")),
        )
        table.add_row(label, f"{b:.1%}", f"{a:.1%}", f"{(a - b) * 100:+.1f} pt", f"{pb:.1%}", f"{pa:.1%}")
    return table


def demo(config: Config, run_dir: str | Path | None = None, console: Console | None = None) -> dict:
    """SFT warm start, held-out eval, RL, held-out eval; prints the table and writes summary.json."""
    started = time.perf_counter()
    run = Run(config, run_dir, console)
    trainer = run.trainer()
    try:
        before = run.evaluate(trainer.engine, trainer.tokenizer)
        run.console.print(f"after SFT: greedy accuracy {before['greedy_accuracy']:.1%}")
        trainer.train(evaluate_fn=lambda engine: run.evaluate(engine, trainer.tokenizer))
        after = run.evaluate(trainer.engine, trainer.tokenizer)
    finally:
        trainer.close()  # reward workers, and with cluster.backend=ray the actors and the Ray session
    pass_key = f"pass@{config.eval.pass_k}"
    summary = {
        "accuracy_before_rl": before["greedy_accuracy"],
        "accuracy_after_rl": after["greedy_accuracy"],
        "eval_before_rl": before,
        "eval_after_rl": after,
        "rl_steps": trainer.step,
        "seed": config.seed,
        "wall_seconds": time.perf_counter() - started,
        "run_dir": str(run.run_dir.resolve()),
    }
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    out = console or Console()
    out.print(accuracy_table(before, after, pass_key))
    out.print(
        f"wall time {summary['wall_seconds']:.0f} s; run directory {run.run_dir} (summary.json, metrics.jsonl, "
        f"tensorboard/, checkpoints/); `everyprompt report {run.run_dir}` draws its curves"
    )
    return summary


def run_offline_filter(model, tokenizer, rows: list[dict], config, store=None):
    """ZVE stage 0 as `everyprompt filter` and the training pipeline run it: estimate, filter, record.

    Samples with the config's rollout settings and reward; records every scored prompt in `store`
    (when given) at step -1. Returns (PassRateEstimate, FilterResult).
    """
    rules, rollout = config.zve.filter, config.rollout
    engine = build_engine(rollout, model, tokenizer)
    params = SamplingParams(
        rollout.max_new_tokens, rollout.temperature, rollout.top_p, stop=tuple(rollout.stop)
    )
    with (
        progress_bar(len(rows), "pass rates", enabled=config.logging.progress) as advance,
        RewardPool(
            build_reward(config.rewards),
            config.rewards.workers,
            config.rewards.timeout_s,
            load_timeout_s=config.rewards.load_timeout_s,
        ) as pool,
    ):
        estimate = estimate_pass_rates(
            engine,
            tokenizer,
            rows,
            pool,
            rules.samples,
            params,
            config.seed,
            config.zve.correct_reward,
            progress=advance,
            prompt_format=prompt_format_of(config, tokenizer),
        )
    if store is not None:
        store.record(estimate.records(rows), step=-1)
    return estimate, filter_by_pass_rate(estimate, rules.low, rules.high)
