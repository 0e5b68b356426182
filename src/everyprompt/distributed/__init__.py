"""The Ray backend (`cluster.backend: ray`): the same two sides of the loop as Ray actors.

- `runtime`: joining a Ray cluster or starting a local one that ends with the run, even a killed one.
- `recipes`: a model as a transformers config and weights, rebuilt inside an actor.
- `rollout`: rollout workers (each an engine) behind one `RolloutEngine` the rollout side drives
  unchanged: requests dealt longest-predicted-first to the least-loaded worker, completions streamed back,
  a dead worker replaced and its unfinished requests re-queued.
- `learner`: learner ranks forming one torch.distributed group (gloo; ddp or fsdp2), driven as one
  learner.
- `backend`: the two sides built for the trainer loop.
- `reaper`: the process that ends a local Ray instance's leftovers when the driver dies.

Ray is the optional extra `ray` (`pip install everyprompt[ray]`); nothing here is imported by the local
backend. docs/cluster.md tells how to launch on a cluster.
"""
