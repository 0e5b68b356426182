"""`cluster.backend: ray`: the loop's two sides over Ray actors.

The rollout side itself (prompt source, curriculum, pass-rate store, reward pool, ZVE stage 1) stays in
the driver, which is light work; its engine is `RayEngine`, the rollout workers. The learner is
`RankedLearner`, the learner ranks. Reward functions run in the driver's RewardPool processes (the
reward contract: never in a trainer process), scoring each completion as it streams back from a worker.
"""

from __future__ import annotations

from everyprompt.distributed.learner import RankedLearner
from everyprompt.distributed.rollout import RayEngine
from everyprompt.distributed.runtime import RaySession
from everyprompt.trainer.rollout_side import LocalRolloutSide


def ray_sides(config, model, tokenizer, prompts, run_dir, store, reference):
    cluster = config.cluster
    session = RaySession(cluster, actors=cluster.rollout_workers + cluster.trainer_ranks)
    closers = [session.close]
    try:
        engine = RayEngine(config, model, tokenizer)
        closers.append(engine.close)
        learner = RankedLearner(config, model, tokenizer.pad_token_id, reference)
        closers.append(learner.close)
        learner.send_as(engine.weight_dtypes)
        rollout = LocalRolloutSide.build(config, model, tokenizer, prompts, run_dir, store, engine=engine)
    except BaseException:
        while closers:
            closers.pop()()
        raise
    return rollout, learner, closers
