"""Where a run's two sides run: one process (`local`) or Ray actors with a torch.distributed learner."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from everyprompt.config.base import Section


class ClusterConfig(Section):
    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: both sides in this process; ray: rollout workers and learner ranks as Ray actors.",
    )
    address: str | None = Field(
        None, description="A running Ray cluster to join ('auto' or host:port); none starts a local one."
    )
    rollout_workers: int = Field(1, ge=1, description="Rollout worker actors, each holding an engine.")
    trainer_ranks: int = Field(
        1, ge=1, description="Learner ranks: one torch.distributed data-parallel group."
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs each actor asks Ray for (also its torch threads).")
    num_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs each actor asks Ray for (a learner rank or a rollout worker then runs on the one "
        "Ray gives it; the learner group uses NCCL there); the local backend: > 0 asks for a GPU in this "
        "process (docs/gpu.md).",
    )
    trainer_sharding: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="ddp: every rank holds the whole model, gradients all-reduced; fsdp2: parameters and "
        "optimizer state sharded with torch's fully_shard.",
    )
    sync_bucket_mib: int = Field(
        512,
        ge=1,
        description="Weights go to the actors through Ray's object store in buckets of this many MiB, each "
        "put as soon as it is full and read as the engine reaches it, so neither side holds a whole second "
        'host copy (docs/cluster.md, "Weight sync"); a weight larger than a bucket goes alone.',
    )
    sync_dtype: Literal["engine", "learner"] = Field(
        "engine",
        description="engine: each weight sent to the rollout workers in the dtype their engine holds it in "
        "where that is narrower than the learner's (bf16 engines get bf16 from a float32 learner or a LoRA "
        "policy's float32 merges: the bits their own cast would make, in half the bytes); learner: as the "
        "learner holds them.",
    )
    start_timeout_s: float = Field(
        300.0, gt=0, description="Seconds to wait for the actors to be placed and to load the model."
    )

    @property
    def sync_bucket_bytes(self) -> int:
        return self.sync_bucket_mib << 20

    @model_validator(mode="after")
    def _one_process_is_local(self) -> ClusterConfig:
        if self.backend == "local" and (self.rollout_workers > 1 or self.trainer_ranks > 1):
            raise ValueError(
                f"rollout_workers={self.rollout_workers} and trainer_ranks={self.trainer_ranks} need "
                "cluster.backend=ray (the local backend is one process)"
            )
        return self
