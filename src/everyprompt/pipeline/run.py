"""A run's stages over its run directory: the warm-started model (SFT: start_model.py), the offline filter
(offline.py), the RL trainer (fresh or resumed) and the held-out evaluation. The process it runs in is set up
by process.py; where a stage starts is `pipeline/resume.py`'s decision; which file holds what is
`run/layout.py`'s."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from everyprompt.config import Config, save_config
from everyprompt.data.rows import ConfigRows
from everyprompt.evaluate import evaluate_config
from everyprompt.logs import quiet_libraries
from everyprompt.pipeline.backends import build_trainer
from everyprompt.pipeline.hub_names import pin_hub_names
from everyprompt.pipeline.offline import OfflineFilter
from everyprompt.pipeline.preflight import check_before_work
from everyprompt.pipeline.process import open_run_dir, removed_on_failure, set_up_process, threads_fitted
from everyprompt.pipeline.resume import rl_start
from everyprompt.pipeline.start_model import PromptDisplay, WarmStart
from everyprompt.trainer import RLTrainer
from everyprompt.trainer.checkpoint import load_trainer_state

if TYPE_CHECKING:
    from everyprompt.data.passrate import PassRateStore


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
            self.device = set_up_process(config, self.console)
            self.rows = ConfigRows(config)
        self.display = PromptDisplay(self.console, config.env.name)
        self.warm_start = WarmStart(config, self.layout, self.device, self.rows, self.display)
        self.filter = OfflineFilter(config, self.layout, self.console)

    def removed_on_failure(self):
        """Within it, a failure before any stage made a result removes the run directory this start created
        (process.py: `removed_on_failure`)."""
        return removed_on_failure(self.layout, self.created, self.console)

    def warm_started_model(self):
        """The starting policy and its tokenizer: the configured model, after the SFT stage when `sft.steps` > 0
        (start_model.py)."""
        return self.warm_start.model()

    def trainer(self, resume: bool = False) -> RLTrainer:
        """The RL trainer of this run. With `resume`, whichever phase was cut short continues: RL from its
        newest complete checkpoint, else the run restarts RL from its beginning, reusing a finished SFT
        stage and offline filter (SFT itself continues from its own checkpoints)."""
        save_config(self.config, self.layout.config)
        rows, filter_rollouts = self.rows.rl(), 0  # bad RL data fails before SFT, not after it
        check_before_work(self.config, rows)
        checkpoint = rl_start(self.layout, resume)
        store = self.filter.pass_rate_store()
        if checkpoint is not None:
            return self._resumed_trainer(checkpoint, store, rows)
        model, tokenizer = self.warm_started_model()
        if self.filter.enabled:
            if self.layout.filter_result.is_file():  # it finished before the run was cut short
                rows, filter_rollouts = self.filter.kept_rows(rows, store), self.filter.report()["rollouts"]
            else:
                rows, filter_rollouts = self.filter.run(model, tokenizer, rows, store)
        trainer = build_trainer(self.config, model, tokenizer, rows, self.run_dir, store=store)
        trainer.rollouts_total = filter_rollouts  # the filter's samples count against rl.max_rollouts
        rollout = trainer.rollout  # with an environment, the prompt is its first messages
        shown = tokenizer.decode(rollout.first_prompts(1)[0]) if rollout.episodes is not None else None
        self.display.show(rollout.prompt_format, "RL", rows[0], shown)
        return trainer

    def _resumed_trainer(self, checkpoint: Path, store: PassRateStore, rows: list[dict]) -> RLTrainer:
        model, tokenizer, reference = self.warm_start.resumed(checkpoint)
        trainer = build_trainer(
            self.config, model, tokenizer, self.filter.kept_rows(rows), self.run_dir, reference, store
        )
        try:
            trainer.load_state_dict(load_trainer_state(checkpoint))
        except BaseException:
            trainer.close()
            raise
        self.console.print(f"resumed from {checkpoint} at step {trainer.step}")
        return trainer

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
        with threads_fitted(self.config):
            return evaluate_config(self.config, engine, tokenizer, rows, completions, progress)
