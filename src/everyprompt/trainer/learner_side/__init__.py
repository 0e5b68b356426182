"""The learner side of the RL loop: it turns a batch into an update. `learner.py` (`Learner`) is the
update's recipe; `old_policy.py` gives the old policy's values, `step.py` runs a mini-batch step (its
micro-batches and their `LossBatch`), `passes.py` is how both reach the rows; `forward.py`, `logprobs.py`
and `head.py` compute the policy's log-probs (packed rows, the fused LM head), `signal.py` decides whether
a batch carries any, `distill.py` adds a teacher's term to the advantages, `mismatch.py` and `replica.py`
measure the train-inference mismatch, `optim.py` owns the optimizer and schedule (`Optimization`),
`data_parallel.py` spreads the update over ranks.
Nothing here imports the rollout side (an import-linter contract)."""

from everyprompt.trainer.learner_side.learner import Learner

__all__ = ["Learner"]
