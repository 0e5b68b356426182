"""The rollout side of the RL loop: it turns prompts into a trained-on batch. `side.py` (`LocalRolloutSide`)
draws the step's prompts, has the engine sample them (rewards scored as completions finish), and hands
the batch over; `assemble.py` builds the batch from the completions (advantages, zero-variance
elimination), `partial.py` carries sequences a step left unfinished into the next, `tally.py` adds up a
step's rollout figures. Nothing here imports the learner side (an import-linter contract)."""

from everyprompt.trainer.rollout_side.side import LocalRolloutSide

__all__ = ["LocalRolloutSide"]
