"""The staged difficulty curriculum (Compass-Thinker-7B, arXiv 2508.08909; docs/zve.md).

RL runs in stages; each stage has a difficulty mixture (weights over buckets), its own response-length
cap and settings, and ends after its step budget or once the recent training accuracy passes its
threshold. The last stage runs until the run ends.
"""

from __future__ import annotations

from collections import deque

from everyprompt.config import CurriculumConfig, CurriculumStage


class Curriculum:
    def __init__(self, config: CurriculumConfig):
        if not config.stages:
            raise ValueError("a curriculum needs at least one stage (curriculum.stages)")
        self.config = config
        self.index = 0
        self.started_at = 0  # RL step at which the current stage began
        self._recent: deque[float] = deque(maxlen=config.window)

    @property
    def stage(self) -> CurriculumStage:
        return self.config.stages[self.index]

    @property
    def is_last(self) -> bool:
        return self.index == len(self.config.stages) - 1

    def observe(self, step: int, accuracy: float) -> bool:
        """Record step `step`'s training accuracy (after the step); True when the next stage begins."""
        self._recent.append(accuracy)
        if self.is_last:
            return False
        stage = self.stage
        done = stage.steps is not None and step - self.started_at >= stage.steps
        full = len(self._recent) == self._recent.maxlen
        if stage.advance_accuracy is not None and full:
            done = done or sum(self._recent) / len(self._recent) >= stage.advance_accuracy
        if done:
            self.index += 1
            self.started_at = step
            self._recent.clear()
        return done

    def state_dict(self) -> dict:
        return {"index": self.index, "started_at": self.started_at, "recent": list(self._recent)}

    def load_state_dict(self, state: dict) -> None:
        if not 0 <= state["index"] < len(self.config.stages):
            raise ValueError(
                f"checkpoint is in curriculum stage {state['index'] + 1}; the config has "
                f"{len(self.config.stages)} stage(s)"
            )
        self.index, self.started_at = state["index"], state["started_at"]
        self._recent = deque(state["recent"], maxlen=self.config.window)
