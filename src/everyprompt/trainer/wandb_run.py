"""Weights & Biases as an optional second home of a run's metrics (`logging.wandb.project`).

One wandb run per phase (`sft`, `rl`), grouped under the run directory's name, with the same namespaced
keys and steps as `metrics.jsonl` and the resolved config (`config.yaml`). The wandb run's id is derived
from the run directory, so a resumed run continues the same wandb runs (wandb ignores steps it has
already seen: the steps re-done after the last checkpoint keep their first values there, while
metrics.jsonl keeps the new ones). wandb is an extra: `pip install 'everyprompt[wandb]'`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from everyprompt.config import ConfigError, WandbConfig
from everyprompt.run.layout import RunLayout


def require_wandb():
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "config key 'logging.wandb.project': wandb is not installed; pip install 'everyprompt[wandb]' "
            "or leave logging.wandb.project unset"
        ) from None
    return wandb


class WandbRun:
    """A phase's wandb run: `log(step, metrics)`, `close()`."""

    def __init__(self, settings: WandbConfig, run_root: Path, phase: str):
        wandb = require_wandb()
        run_root = Path(run_root).resolve()
        config_path = RunLayout(run_root).config
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
        ident = hashlib.sha1(str(run_root).encode()).hexdigest()[:12]
        self._run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            mode=settings.mode,
            dir=str(run_root),
            id=f"{run_root.name[:40]}-{ident}-{phase}".replace("/", "-"),
            name=f"{run_root.name}/{phase}",
            group=run_root.name,
            job_type=phase,
            config=config,
            resume="allow",
            reinit="finish_previous",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # wandb shows NaN and inf as gaps; they are kept as they are
        self._run.log(
            {k: v for k, v in metrics.items() if k != "step" and isinstance(v, float | int)}, step=step
        )

    def close(self) -> None:
        self._run.finish()
