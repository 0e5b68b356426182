"""Scale-out and its safety: rollout workers and learner ranks, a Ray run's checkpoint and weight sync,
asynchronous training, and runs killed and resumed.

Each runs from the repository's root:
- `python -m bench.distributed.async`: Asynchronous training on this machine: the demo's RL phase
  synchronous and with rl.max_staleness 1 and 2, from the same SFT checkpoint, at equal RL
- `python -m bench.distributed.chaos`: Chaos: kill training runs with SIGKILL at random instants, resume
  them, compare with an uninterrupted run.
- `python -m bench.distributed.ray_checkpoint`: A Ray run's checkpoint: written by the learner ranks against
  gathered into the driver, and the driver's copy of the model let go.
- `python -m bench.distributed.scale`: Scale-out on this machine: the RL step of the demo with 1 or 2
  rollout workers and 1 or 2 learner ranks on a local Ray instance, against the local
- `python -m bench.distributed.weight_sync`: A Ray weight sync's host memory and time: in buckets against
  the whole weights in one bucket, pipelined against one side after the other, and to bf16 ...
"""
