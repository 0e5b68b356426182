"""A run's stages over its run directory: the warm-started model (SFT), the offline filter, the RL trainer
(fresh or resumed) and the held-out evaluation. Where a stage starts is `pipeline/resume.py`'s decision; which
file holds what is `run/layout.py`'s."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
from datetime import datetime
from functools import partial
from pathlib import Path

import torch
from rich.console import Console

from everyprompt.config import Config, ConfigError, save_config
from everyprompt.data import DataError
from everyprompt.data.formatting import prompt_format_of
from everyprompt.data.passrate import PassRateStore
from everyprompt.data.rows import ConfigRows
from everyprompt.devices import keep_freed_memory, resolve_device
from everyprompt.devices.bf16 import slow_bf16_note
from everyprompt.devices.cores import CoreShare
from everyprompt.devices.malloc import malloc_note
from everyprompt.envs.episode import probe_environment
from everyprompt.errors import InputError
from everyprompt.evaluate import evaluate_config, held_out_rewards
from everyprompt.logs import quiet_libraries, record_warnings, stop_recording_warnings
from everyprompt.models.io import config_tokenizer, load_model_and_tokenizer, load_pretrained, save_pretrained
from everyprompt.models.kernels import check_kernels
from everyprompt.models.lora import load_adapter, lora_base_dtype
from everyprompt.models.precision import emulates_bf16, training_dtype, training_kernels
from everyprompt.pipeline.backends import build_trainer
from everyprompt.pipeline.hub_names import pin_hub_names
from everyprompt.pipeline.resume import rl_start, sft_start
from everyprompt.processes import StoppedAtOnce
from everyprompt.rewards import build_reward
from everyprompt.rollout import resolve_engine
from everyprompt.rollout.stops import stop_token_ids
from everyprompt.run.files import write_json_atomic
from everyprompt.run.layout import RunLayout
from everyprompt.trainer import RLTrainer, run_sft, save_checkpoint
from everyprompt.trainer.checkpoint import CheckpointError, load_trainer_state
from everyprompt.trainer.learner_side.distill import check_teachers, student_name
from everyprompt.trainer.wandb_run import require_wandb
from everyprompt.zve import seeded_sample
from everyprompt.zve.workflow import filter_counts, run_offline_filter

log = logging.getLogger(__name__)


def open_run_dir(run_dir: Path) -> RunLayout:
    """Create the run directory and check that it is writable (fail now, not at the first checkpoint an
    hour in); from now on everyprompt's warnings are kept in it too."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"{run_dir}: cannot write the run directory ({err.strerror or err})") from None
    layout = RunLayout(run_dir)
    record_warnings(layout.warnings)
    return layout


def learner_device(config: Config) -> torch.device:
    """Where this process trains: `model.device` (local backend; the Ray backend's driver keeps its copy on
    the CPU, its learner ranks place themselves). Every device setting is resolved now, so a CUDA device
    that is not there, or GPUs reserved for actors that would leave them idle, stop the run before any
    work with the key named."""
    resolve_device(config.rollout.device, "rollout.device")  # the engine resolves it again where it is built
    device = resolve_device(config.model.device, "model.device")
    cluster = config.cluster
    if cluster.num_gpus > 0:
        settings = {"model.device": config.model.device, "rollout.device": config.rollout.device}
        on_cpu = [key for key, value in settings.items() if value == "cpu"]
        if on_cpu:
            raise ConfigError(
                f"config key 'cluster.num_gpus' is {cluster.num_gpus:g} but {' and '.join(on_cpu)} = cpu: the "
                "GPUs would be reserved and left idle; set the devices to auto (or cuda) or num_gpus to 0"
            )
        if cluster.backend == "local" and not torch.cuda.is_available():
            raise ConfigError(
                f"config key 'cluster.num_gpus' is {cluster.num_gpus:g} but torch sees no CUDA device here "
                "(the local backend runs both sides in this process); run on a GPU machine or set it to 0"
            )
        actors = cluster.rollout_workers + cluster.trainer_ranks
        have = torch.cuda.device_count()
        if cluster.backend == "ray" and cluster.address is None and have < actors * cluster.num_gpus:
            raise ConfigError(
                f"config key 'cluster.num_gpus' is {cluster.num_gpus:g}: {actors} actors need "
                f"{actors * cluster.num_gpus:g} GPUs and this machine has {have} (a local Ray instance); "
                "set cluster.address to a cluster that has them, or num_gpus to 0"
            )
    return torch.device("cpu") if cluster.backend == "ray" else device


def bf16_on_cpu(config: Config, device: torch.device) -> list[str]:
    """The settings that put torch's bfloat16 matmul kernels on the CPU in this run (not the learner's
    products where it emulates them: models/emulated_bf16.py)."""
    keys = []
    learner_bf16 = device.type == "cpu" and training_dtype(config.model.dtype, device) == "bf16"
    if learner_bf16 and not emulates_bf16(device, config.model.dtype, config.model.cpu_bf16):
        keys.append("model.dtype=bf16")
    rollout = resolve_device(config.rollout.device, "rollout.device")
    if rollout.type == "cpu" and config.rollout.precision == "bf16":
        keys.append("rollout.precision=bf16")
    return keys


class Run:
    """One run directory and what a config needs: data rows, the model, evaluation."""

    def __init__(self, config: Config, run_dir: str | Path | None = None, console: Console | None = None):
        quiet_libraries()
        self.config = config
        self.console = console or Console(stderr=True)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir or config.run_dir or f"runs/{config.name}-{stamp}")
        self.config = config = pin_hub_names(config, self.console)  # before anything is written
        self.created = not self.run_dir.exists()  # by this start: removed again if it fails before a step
        self.layout = open_run_dir(self.run_dir)
        with self.removed_on_failure():
            self._set_up(config)
        self._shown: set[str] = set()  # stages whose first rendered prompt was printed

    @contextlib.contextmanager
    def removed_on_failure(self):
        """Within it, a failure (or a stop) before any stage made a result removes the run directory this
        start created (saying so unless the failure is bad input, which says its own one line): a failed
        start leaves nothing in runs/. A directory that existed
        before (a resume, a sweep's cell, `--run-dir` of an earlier run), or one holding any result, stays."""
        try:
            yield
        except BaseException as err:
            if self.created and self.run_dir.is_dir() and not self.layout.holds_results():
                stop_recording_warnings()
                shutil.rmtree(self.run_dir, ignore_errors=True)
                # bad input is said in its one line; a stop or a failure of the run says where its files went
                said = "" if isinstance(err, InputError) else f"removed {self.run_dir}: nothing to keep"
            elif isinstance(err, StoppedAtOnce) and self.layout.latest.exists():
                said = f"kept {self.run_dir}: `everyprompt train --resume {self.run_dir}` continues from its last checkpoint"
            else:
                said = ""
            if said:
                self.console.print(said, markup=False, highlight=False)
            raise

    def _set_up(self, config: Config) -> None:
        if config.logging.wandb.enabled:  # a missing extra fails now, not when the first step logs
            require_wandb()
        if config.threads:
            torch.set_num_threads(config.threads)
        if note := malloc_note(config.malloc):
            self.console.print(note, markup=False, highlight=False)
        if config.keep_freed_memory:
            keep_freed_memory(config.kept_block_mib)
        self.device = learner_device(config)  # CUDA asked for and absent: exit 2 now, before any work
        # likewise layer kernels this device cannot run (Liger's off CUDA or not installed, no compiler)
        check_kernels(config.model.kernels, self.device)
        if note := slow_bf16_note(bf16_on_cpu(config, self.device)):
            log.warning(note)
            self.console.print(f"warning: {note}", markup=False, highlight=False)
        if emulates_bf16(self.device, config.model.dtype, config.model.cpu_bf16):
            self.console.print(
                f"model.dtype=bf16 on this CPU ({torch.backends.cpu.get_cpu_capability()}): bf16 products on "
                f"float32 kernels, rounded to bf16 (model.cpu_bf16={config.model.cpu_bf16})",
                markup=False,
                highlight=False,
            )
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.rows = ConfigRows(config)

    # ------------------------------------------------------------ model
    def warm_started_model(self):
        """The starting policy: the configured model, after the SFT stage when `sft.steps` > 0.

        A finished SFT checkpoint in the run directory is reused; an SFT stage that was cut short continues
        from its newest complete checkpoint (`pipeline/resume.py`).
        """
        start = sft_start(self.layout, self.config.sft.steps)
        # a LoRA base nothing trains first is read as it will be held (`model.frozen_dtype`)
        base = lora_base_dtype(self.config, self.device) if self.config.model.lora.enabled else torch.float32
        if start.finished is not None:
            model, tokenizer = load_pretrained(start.finished, dtype=base)
            return self.prepare_for_training(model), tokenizer
        sft_rows = self.rows.sft() if self.config.sft.steps else []  # bad SFT data fails before any loading
        if start.partial is not None:
            model, tokenizer = load_pretrained(start.partial)
            resume = load_trainer_state(start.partial)
            self.console.print(f"SFT resumes from {start.partial} at step {resume['step']}")
        else:
            dtype = base if not self.config.sft.steps else torch.float32
            model, tokenizer = load_model_and_tokenizer(self.config.model, self.config.seed, dtype)
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
                cpu_bf16=self.config.model.cpu_bf16,
                resume=resume,
                prompt_format=self.show_format(prompt_format, "SFT", sft_rows[0]),
            )
            save_checkpoint(
                self.layout.sft_checkpoint, partial(save_pretrained, model, tokenizer), state=None
            )
            for stale in self.layout.sft_step_checkpoints():
                shutil.rmtree(stale)
        return model, tokenizer

    def prepare_for_training(self, model):
        """The policy on the learner's device, with the kernels it trains with (`training_kernels`)."""
        return training_kernels(model.to(self.device), self.config.model)

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
        save_config(self.config, self.layout.config)
        if self.config.eval.reward is not None:  # one that does not resolve fails now, not after RL
            build_reward(held_out_rewards(self.config))
        rows, filter_rollouts = self.rows.rl(), 0  # bad RL data fails before SFT, not after it
        if self.config.env.name is not None:  # an unknown name, a bad option, a server that does not answer
            probe_environment(self.config.env.name, self.config.env.options)
        if self.config.rl.teacher.enabled:  # a teacher that does not fit fails now, before SFT
            student = config_tokenizer(self.config.model)
            check_teachers(self.config.rl.teacher, student, student_name(self.config), rows)
        checkpoint = rl_start(self.layout, resume)
        store = self.pass_rate_store()
        if checkpoint is not None:
            return self._resumed_trainer(checkpoint, store, rows)
        model, tokenizer = self.warm_started_model()
        if self.config.zve.enabled and self.config.zve.filter.enabled:
            if self.layout.filter_result.is_file():  # it finished before the run was cut short
                rows, filter_rollouts = self.filtered_rl_rows(store, rows), self._filter_report()["rollouts"]
            else:
                rows, filter_rollouts = self.offline_filter(model, tokenizer, rows, store)
        trainer = build_trainer(self.config, model, tokenizer, rows, self.run_dir, store=store)
        trainer.rollouts_total = filter_rollouts  # the filter's samples count against rl.max_rollouts
        rollout = trainer.rollout  # with an environment, the prompt is its first messages
        shown = tokenizer.decode(rollout.first_prompts(1)[0]) if rollout.episodes is not None else None
        self.show_format(rollout.prompt_format, "RL", rows[0], shown)
        return trainer

    def _resumed_trainer(self, checkpoint: Path, store: PassRateStore, rows: list[dict]) -> RLTrainer:
        if self.config.model.lora.enabled:  # the adapter on the run's own base (SFT or model.path)
            base, tokenizer = self.warm_started_model()
            model, reference = load_adapter(base, checkpoint, lora_base_dtype(self.config, self.device)), None
        else:
            model, tokenizer = load_pretrained(checkpoint)
            self.prepare_for_training(model)
            reference = self.warm_started_model()[0] if self.config.rl.kl.estimator else None
        trainer = build_trainer(
            self.config, model, tokenizer, self.filtered_rl_rows(rows=rows), self.run_dir, reference, store
        )
        try:
            trainer.load_state_dict(load_trainer_state(checkpoint))
        except BaseException:
            trainer.close()
            raise
        self.console.print(f"resumed from {checkpoint} at step {trainer.step}")
        return trainer

    def show_format(self, prompt_format, stage: str, row: dict, text: str | None = None):
        """Print once per stage how the first prompt is rendered (what the model sees: `text` when given,
        an episode's); returns the format."""
        if stage not in self._shown:
            self._shown.add(stage)
            how = f"data.format={prompt_format.name}" if text is None else f"env.name={self.config.env.name}"
            self.console.print(f"{stage} prompt 1 as the model sees it ({how}):")
            shown = prompt_format.text(row) if text is None else text
            self.console.print(repr(shown), markup=False, highlight=False)
        return prompt_format

    # ------------------------------------------------------------ zero-variance elimination
    def pass_rate_store(self) -> PassRateStore:
        """The run's store, seeded from `zve.pass_rates` when the run starts."""
        zve = self.config.zve
        path = self.layout.pass_rates
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
            **filter_counts(estimate, result, rules),
            "seconds": time.perf_counter() - started,
            "rollouts": len(candidates) * rules.samples,
            "kept_indices": kept,
            "records": estimate.records(candidates),  # the store's step -1, again on a resume
        }
        write_json_atomic(self.layout.filter_result, report)
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
        report = self.layout.filter_result
        if not report.is_file():
            raise DataError(f"{report}: missing; the run's offline filter result is needed to resume")
        return json.loads(report.read_text())

    def filtered_rl_rows(
        self, store: PassRateStore | None = None, rows: list[dict] | None = None
    ) -> list[dict]:
        """The RL prompts of this run (`rows`: the config's, when already read): after the offline filter
        when it ran (its kept list is saved). With `store`, the filter's pass rates are recorded in it again
        (RL restarts from its start)."""
        rows = self.rows.rl() if rows is None else rows
        if not (self.config.zve.enabled and self.config.zve.filter.enabled):
            return rows
        report = self._filter_report()
        if store is not None:
            store.record([tuple(r) for r in report["records"]], step=-1)
        return [rows[i] for i in report["kept_indices"]]

    def evaluate(
        self,
        engine,
        tokenizer,
        rows: list[dict] | None = None,
        completions: list | None = None,
        progress: bool = False,
    ) -> dict[str, float]:
        """Held-out evaluation (the config's held-out rows unless `rows` are given); `completions`: a list
        that receives the greedy completions' records; `progress`: a progress bar (not while training,
        whose own bar is live)."""
        rows = rows if rows is not None else self.rows.held_out()
        with self.threads_fitted():
            return evaluate_config(self.config, engine, tokenizer, rows, completions, progress)

    @contextlib.contextmanager
    def threads_fitted(self):
        """Within it, torch's threads fitted to the free cores (`cpu_threads`: devices/cores.py)."""
        adaptive = self.config.cpu_threads == "adaptive"
        if not adaptive or resolve_device(self.config.rollout.device, "rollout.device").type != "cpu":
            yield
            return
        share = CoreShare(torch.get_num_threads())
        share.fit()
        try:
            yield
        finally:
            torch.set_num_threads(share.limit)
