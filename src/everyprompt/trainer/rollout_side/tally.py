"""What one rollout step's generate calls add up to: throughput, timing and reward components."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from everyprompt.rollout import summed_stats


@dataclass
class StepTally:
    """What one step's generate calls add up to (ZVE expansion makes several calls per step)."""

    generate_s: float = 0.0
    reward_wait_s: float = 0.0
    scored: int = 0  # completions sent to the reward (unfinished partial rollouts are not)
    engine_calls: list[dict[str, float]] = field(default_factory=list)
    components: dict[str, list[float | None]] = field(default_factory=dict)
    environment_errors: list[tuple[str, str]] = field(default_factory=list)  # (reason, error) an episode

    def add(self, scored) -> None:
        self.generate_s += scored.generate_s
        self.environment_errors.extend(scored.environment_errors)
        self.scored += scored.scored
        self.reward_wait_s += scored.reward_wait_s
        if scored.engine_stats:
            self.engine_calls.append(scored.engine_stats)
        for parts in scored.components:
            for name, value in (parts or {}).items():
                self.components.setdefault(name, []).append(value)

    def metrics(self) -> dict[str, float]:
        """rollout/* throughput over the calls, each reward component's mean (reward/<name>), and the sum of
        any namespaced figure the engine reports (such as cluster/actor_restarts)."""
        out = {
            f"reward/{name}": statistics.fmean(v for v in values if v is not None)
            if any(v is not None for v in values)
            else math.nan
            for name, values in self.components.items()
        }
        if self.environment_errors:
            out["env/errors"] = float(len(self.environment_errors))
            for reason, _ in self.environment_errors:  # env/errors/ServerGone, .../time_limit, ...
                out[f"env/errors/{reason}"] = out.get(f"env/errors/{reason}", 0.0) + 1.0
        calls = self.engine_calls
        for call in calls:  # namespaced figures an engine adds (cluster/*): summed over the step's calls
            for key, value in call.items():
                if "/" in key:
                    out[key] = out.get(key, 0.0) + value
        if calls:
            steps = max(sum(c["decode_steps"] for c in calls), 1)
            wall = sum(c["wall_s"] for c in calls)
            out["rollout/tokens_per_s"] = sum(c["tokens"] for c in calls) / wall if wall > 0 else 0.0
            out["rollout/slot_occupancy"] = (
                sum(c["slot_occupancy"] * c["decode_steps"] for c in calls) / steps
            )
            out["rollout/prefill_s"] = sum(c.get("prefill_s", 0.0) for c in calls)
            out["rollout/compiled"] = max(c.get("compiled", 0.0) for c in calls)
            out["rollout/decode_step_ms"] = (
                sum(c["decode_step_ms"] * c["decode_steps"] for c in calls) / steps
            )
            # where the engine reports them (the native engine's CUDA graphs)
            out.update({f"rollout/{name}": value for name, value in summed_stats(calls).items()})
        return out
