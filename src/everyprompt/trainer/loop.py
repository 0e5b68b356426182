"""The RL loop: a rollout side and a learner side, composed synchronously.

One step is the rollout side's batch, the learner's update on it, and the weights handed back:

    batch = self.rollout.next_batch(self.step)
    metrics = self.learner.update(batch)
    self.rollout.load_weights(self.learner.state_dict(), self.step)

The two sides (trainer/interface.py) share nothing but the `RolloutBatch` and the weights (docs/architecture.md),
so either can move to another process. The loop also owns the run's counters, the metrics log and the
checkpoints (both sides' state, the RNG streams and the model, written atomically).

With `rl.max_staleness` = k >= 1 the rollout side runs in a producer thread, k policy versions ahead of
the learner (`trainer/asynchrony.py`): the step takes a batch the producer made while the previous
update ran, and hands its weights over after the step's evaluation and checkpoint.

The loop is given its two sides: `pipeline/backends.py` builds them by `cluster.backend` (`local`, both in
this process; `ray`, the rollout workers and the learner ranks as Ray actors, `distributed/`). The learner
is anything that implements `trainer/interface.py`'s `LearnerSide`.
"""

from __future__ import annotations

import logging
import random
import signal
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from everyprompt.config import Config
from everyprompt.devices import release_freed_memory, resolve_device
from everyprompt.devices.cores import CoreShare
from everyprompt.errors import ClusterError
from everyprompt.processes import GracefulStop, StopRequested
from everyprompt.run.layout import RunLayout
from everyprompt.trainer.asynchrony import (
    RolloutPipeline,
    batch_to_state,
    batches_from_state,
    own_copy,
    staleness_metrics,
    threads_per_side,
)
from everyprompt.trainer.checkpoint import save_checkpoint
from everyprompt.trainer.interface import LearnerSide, RolloutSide
from everyprompt.trainer.learner_side.optim import NumericsError
from everyprompt.trainer.metrics import MetricsLogger
from everyprompt.trainer.parity import check_parity

log = logging.getLogger(__name__)


class StepHook(Protocol):
    """Told of the run's steps (`RLTrainer.train(hooks=...)`), in this process, between steps."""

    def on_train_begin(self, trainer: RLTrainer) -> None:
        """The pipeline is up; the first step starts next (a resumed run: the first step after resuming)."""

    def after_step(self, trainer: RLTrainer, metrics: dict[str, float]) -> bool:
        """Step `trainer.step` is done, logged and checkpointed; True ends the run here (its final checkpoint
        is written as at `rl.steps`)."""


class RLTrainer:
    """Runs `rl.steps` steps of a rollout side and a learner side (trainer/interface.py); logs, evaluates and
    checkpoints."""

    def __init__(
        self,
        config: Config,
        rollout: RolloutSide,
        learner: LearnerSide,
        model,
        tokenizer,
        run_dir,
        *,
        closers=(),
    ):
        self.config, self.rl = config, config.rl
        self.rollout, self.learner = rollout, learner
        self.closers = list(closers)  # the backend's own resources (actors, a Ray session), closed last
        # the policy here (what checkpoints are written from, unless the learner writes its own: Ray)
        self.model, self.tokenizer = model, tokenizer
        self.run_dir = Path(run_dir)
        self.layout = RunLayout(run_dir)
        self.step = 0
        self.rollouts_total = 0  # rollouts generated so far (the offline filter's count in when it ran)
        self.reward_errors = 0
        self.startup_metrics: dict[str, float] = {}  # parity check figures, logged with the next step
        self.pipeline: RolloutPipeline | None = None  # rl.max_staleness >= 1: the producer thread
        self.restored: dict = {}  # batches made ahead by an asynchronous run, from its checkpoint
        self.weights = None  # async: the last update's weights (an own copy), handed over at its step's end
        self.published = 0  # async: the version last handed to the producer
        self.cores: CoreShare | None = None  # the threads fitted to the free cores (`_fits_threads`)

    @property
    def engine(self):
        """The rollout side's engine (evaluation decodes with it)."""
        return self.rollout.engine

    def close(self) -> None:
        """Stop the rollout side's reward workers and the backend's actors (the trainer is not used after
        this). Safe to call twice."""
        try:
            if self.pipeline is not None:
                self.pipeline.close()
            self.rollout.close()
        finally:
            while self.closers:
                self.closers.pop()()

    # ------------------------------------------------------------ one step
    def _fits_threads(self) -> bool:
        """Whether this step's phases fit torch's threads to the free cores: `cpu_threads=adaptive`, a
        synchronous run in this process (an asynchronous one splits the cores between its two threads),
        and both sides on the CPU."""
        settings = {"model.device": self.config.model.device, "rollout.device": self.config.rollout.device}
        on_cpu = all(resolve_device(value, key).type == "cpu" for key, value in settings.items())
        return (
            self.config.cpu_threads == "adaptive"
            and self._in_process
            and not self.rl.max_staleness
            and on_cpu
        )

    def _fit_threads(self, phase: str) -> dict[str, float]:
        if self.cores is None:
            return {}
        threads = self.cores.fit()
        return {f"cpu/threads_{phase}": float(threads), f"cpu/other_cores_before_{phase}": self.cores.others}

    def train_step(self) -> dict[str, float]:
        fitted = self._fit_threads("rollout") if self.pipeline is None else {}
        batch, waits = self._next_batch()
        if self.pipeline is None:  # idle until the weight sync below: its memory is the learner's
            self.rollout.sleep()
            fitted.update(self._fit_threads("update"))
        metrics = {**fitted, **self.learner.update(batch)}
        synced = time.perf_counter()
        weights = self.learner.state_dict(streamed=self.pipeline is None)  # loaded at once, below
        self.step += 1
        if self.pipeline is None:
            self.rollout.load_weights(weights, self.step)
        else:  # handed to the producer once this step's evaluation and checkpoint are done
            self.weights = own_copy(weights)
            # the update compared its pre-update policy with an engine some versions older: drift and
            # mismatch together (the rollout thread measured the mismatch itself: `_measure`)
            metrics = {
                (f"async/proximal_{key[len('mismatch/') :]}" if key.startswith("mismatch/") else key): value
                for key, value in metrics.items()
            }
        metrics["time/weight_sync_s"] = time.perf_counter() - synced
        metrics["sync/bytes"] = float(self.learner.last_sync_bytes)
        return {**batch.stats, **self._count(batch), **waits, **metrics}

    def _next_batch(self):
        """This step's batch (one restored from an asynchronous run's checkpoint comes first) and, when
        asynchronous, how long each side waited and how stale its tokens are."""
        if self.pipeline is None:
            batch, waits = self.restored.pop(self.step, None) or self.rollout.next_batch(self.step), {}
        else:
            batch, waits = self.pipeline.take(self.step)
        if self.pipeline is None and not self.config.rollout.partial:
            return batch, waits
        return batch, {**waits, **staleness_metrics(batch, self.step, self.staleness_bound)}

    @property
    def staleness_bound(self) -> int:
        """The most updates a token may be behind the learner that trains on it: rl.max_staleness, and a
        partial rollout's early tokens up to rollout.max_versions_per_sequence - 1 more."""
        rollout = self.config.rollout
        return self.rl.max_staleness + (rollout.max_versions_per_sequence - 1 if rollout.partial else 0)

    @property
    def _in_process(self) -> bool:
        """The learner runs in this process (the local backend), beside the rollout thread."""
        return self.learner.in_process

    def _start_pipeline(self) -> None:
        """rl.max_staleness >= 1: start the producer from the learner's current weights."""
        if self.rl.max_staleness and self.pipeline is None and not self.finished:
            measure = self._in_process and self.rl.async_mismatch_rows > 0
            if measure:
                self.learner.make_replica()
            self.pipeline = RolloutPipeline(
                self.rollout,
                self.rl.max_staleness,
                stop_at=self.rl.steps,
                version=self.step,
                weights=self.learner.state_dict(),
                pending=self.restored,
                measure=self._measure if measure else None,
            )
            self.published = self.step
            self.restored = {}

    def _measure(self, batch, weights, version: int) -> None:
        """In the rollout thread: `mismatch/*` of the batch against the weights that sampled it, on up to
        `rl.async_mismatch_rows` rows sampled by that version alone (a replica; the learner is untouched)."""
        rows = [
            row
            for row, versions in enumerate(batch.versions or [])
            if len(versions) and int(versions.min()) == int(versions.max()) == version
        ][: self.rl.async_mismatch_rows]
        batch.stats.update(self.learner.behaviour_mismatch(batch, weights, rows))

    def _publish(self) -> None:
        """Async: hand the last update's weights to the producer."""
        if self.pipeline is not None and self.published < self.step:
            self.pipeline.publish(self.step, self.weights)
            self.published = self.step

    def _engine_at_learner(self):
        """The engine, free of the producer and holding the learner's latest weights (evaluation)."""
        if self.pipeline is not None:
            self.pipeline.idle()
            if self.rollout.version != self.step:
                self.rollout.load_weights(self.weights, self.step)
        return self.engine

    def _count(self, batch) -> dict[str, float]:
        """The run's running totals after `batch`, and its timings."""
        self.rollouts_total += int(batch.stats.get("zve/generated_rollouts", len(batch)))
        self.reward_errors += int(batch.stats.get("reward/errors", 0))
        return {
            "rollout/total": float(self.rollouts_total),
            "reward/errors_total": float(self.reward_errors),
            **{f"time/{name}": value for name, value in batch.timing.items()},
        }

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything a resume needs but the learner's (`save` adds it: `learner.training_state`); an
        asynchronous run's also holds the batches made ahead (taken once its producer waits, so its
        rollout-side state matches them)."""
        pending = {}
        if self.pipeline is not None:
            self.pipeline.idle()
            pending = self.pipeline.pending()
        pending.update({n: batch_to_state(b) for n, b in self.restored.items()})
        return {
            "pending_batches": pending,
            "step": self.step,
            "rollouts_total": self.rollouts_total,
            "reward_errors": self.reward_errors,
            "rollout": self.rollout.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.rollouts_total, self.reward_errors = state["rollouts_total"], state["reward_errors"]
        self.rollout.load_state_dict(state["rollout"])
        self.learner.load_training_state(state["learner"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.restored = batches_from_state(state.get("pending_batches", {}))
        self.rollout.load_weights(self.learner.state_dict(), self.step)

    def save(self) -> Path:
        state = self.state_dict()
        merged = self.config.model.lora.save_merged
        return save_checkpoint(
            self.layout.step_checkpoint(self.step),
            partial(self.learner.save_model, self.model, self.tokenizer, merged=merged),
            state,
            keep_last=self.config.checkpoint.keep_last,
            parts={"learner": self.learner.training_state},  # the Ray ranks write their own shares there
        )

    def _last_checkpoint(self) -> str:
        latest = self.layout.latest
        if latest.exists():
            return f"{latest.resolve()} (`everyprompt train --resume {self.run_dir}` continues from it)"
        return "the starting model (no RL checkpoint was written yet)"

    # ------------------------------------------------------------ the loop
    @property
    def finished(self) -> bool:
        """`rl.steps` done, or `rl.max_rollouts` rollouts generated (offline-filter samples included)."""
        budget = self.rl.max_rollouts
        return self.step >= self.rl.steps or (budget is not None and self.rollouts_total >= budget)

    def train(self, evaluate_fn=None, hooks: Sequence[StepHook] = ()) -> list[dict[str, float]]:
        """Run until finished; checkpoint every `checkpoint.every` steps and at the end. SIGINT / SIGTERM
        end the current step, write a checkpoint and raise StopRequested (exit 130 / 143). `hooks`: each is
        told when the first step starts and after every step (its metrics logged, its checkpoint written),
        and may end the run there, as `rl.steps` would (a wall-clock budget, snapshots: `StepHook`)."""
        if self.cores is None and self._fits_threads():  # measuring from here: the first step fits too
            self.cores = CoreShare(torch.get_num_threads())
        released = next(self.model.parameters()).is_meta  # by an earlier `train` (below)
        if self.config.rollout.parity_threshold > 0 and not released:
            self.startup_metrics.update(
                check_parity(
                    self.model,
                    self.tokenizer,
                    self.config,
                    self.rollout.first_prompts(self.config.rollout.parity_prompts),
                )
            )
            log.info(
                "startup parity: engine vs trainer mean |dlogp| %.2e",
                self.startup_metrics["parity/logp_abs_diff"],
            )
        if self.learner.saves_own_weights:
            # nothing reads this copy's weights from now on (the learner writes the checkpoints): its
            # memory goes back; the model keeps its structure and config on the meta device
            self.model.to("meta")
        logger = MetricsLogger(
            self.run_dir,
            self.rl.steps,
            "RL",
            start_step=self.step,
            progress=self.config.logging.progress,
            tensorboard=self.config.logging.tensorboard,
            wandb=self.config.logging.wandb,
        )
        history = []
        # the local backend's two threads share this process's cores, unless `threads` was set
        split = bool(self.rl.max_staleness) and self._in_process and not self.config.threads
        try:
            with threads_per_side(split):
                self._run(logger, evaluate_fn, history, hooks)
        finally:
            logger.close()
            if self.cores is not None:  # the threads the run was given, for what follows it
                torch.set_num_threads(self.cores.limit)
        return history

    def _run(self, logger: MetricsLogger, evaluate_fn, history: list, hooks: Sequence[StepHook]) -> None:
        self._start_pipeline()
        for hook in hooks:
            hook.on_train_begin(self)
        with GracefulStop() as stop:
            while not self.finished:
                history.append(self._step(logger, evaluate_fn))
                if self.config.checkpoint.every and self.step % self.config.checkpoint.every == 0:
                    self.save()
                if stop.signum is not None:
                    self._stop(stop.signum)
                ended = [hook.after_step(self, history[-1]) for hook in hooks]  # every hook sees the step
                if any(ended):
                    break
                self._publish()
            if not self.layout.step_checkpoint(self.step).is_dir():
                self.save()
            self._finish_pipeline()

    def _finish_pipeline(self) -> None:
        """Async, at the end: the producer makes nothing more and its thread ends, and the engine gets the
        final weights (what the run's final evaluation decodes with, as in the synchronous loop). Training
        further (a larger `rl.steps`) starts a new producer from the final weights."""
        if self.pipeline is not None:
            self.pipeline.finish()
            self._engine_at_learner()
            self.pipeline.close()
            self.pipeline = None

    def _step(self, logger: MetricsLogger, evaluate_fn) -> dict[str, float]:
        started = time.perf_counter()
        try:
            metrics = self.train_step()
            release_freed_memory()  # reuse within a step, not across (devices/host.py)
        except NumericsError as err:
            raise NumericsError(f"{err}. The last good state is {self._last_checkpoint()}") from None
        except ClusterError as err:  # a learner rank lost: the others were stopped, nothing waits on them
            raise type(err)(
                f"{err}; the run stopped. The last good state is {self._last_checkpoint()}"
            ) from None
        every = self.config.eval.every
        if evaluate_fn is not None and every and self.step % every == 0 and not self.finished:
            metrics.update({f"eval/{k}": v for k, v in evaluate_fn(self._engine_at_learner()).items()})
        metrics["time/step_s"] = time.perf_counter() - started
        metrics.update(self.startup_metrics)  # the first logged step carries the startup figures
        self.startup_metrics = {}
        logger.log(self.step, metrics)
        return metrics

    def _stop(self, signum: int) -> None:
        if not self.layout.step_checkpoint(self.step).is_dir():
            self.save()
        raise StopRequested(
            signum,
            f"stopped by {signal.Signals(signum).name} after RL step {self.step}; checkpoint written; "
            f"continue with: everyprompt train --resume {self.run_dir}",
        )
