"""Learner ranks as Ray actors: one torch.distributed group (NCCL when the ranks hold GPUs, gloo on CPUs),
driven as one learner.

Each rank rebuilds the policy from its recipe and runs `Learner.update` on the same batch, taking its
share of the micro-batches (`trainer/learner_side/data_parallel.py`); the update equals one process's. Rank 0's
figures are the step's. Weights for the rollout workers go into Ray's object store from rank 0, in
buckets as it reads them (distributed/buckets.py; under fsdp2 gathered a layer at a time), yielded by a
streaming call so that the driver owns them, and reach the workers without passing through the driver.
The ranks write a checkpoint's model and optimizer state themselves, in the local backend's format: rank 0
the weights (a LoRA policy's adapter), each rank its share of the optimizer state (torch.distributed.
checkpoint, keyed by parameter name); nothing of either passes through the driver, which writes the rest,
and a run resumes on any number of ranks, or in one process.

A rank that dies ends the run: the driver does not wait on the others (they would wait in a collective
forever); every rank is killed and the caller is told how to resume.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch

from everyprompt.devices import keep_freed_memory, release_freed_memory, resolve_device
from everyprompt.distributed.buckets import (
    Bucket,
    BucketedWeights,
    WeightStream,
    packed_buckets,
    put_in_buckets,
    readable,
)
from everyprompt.distributed.recipes import ModelRecipe
from everyprompt.distributed.runtime import actor_options, require_ray
from everyprompt.errors import ClusterError
from everyprompt.logs import quiet_libraries
from everyprompt.models.lora import is_lora, lora_base_dtype
from everyprompt.models.precision import training_kernels
from everyprompt.trainer.checkpoint import SHARDS, CheckpointError, full_weights, shard_files
from everyprompt.trainer.interface import LearnerSide
from everyprompt.trainer.learner_side.data_parallel import DataParallel
from everyprompt.trainer.learner_side.learner import Learner

GROUP_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}  # the learner group's torch.distributed backend by device


def _seen_here(directory: Path, files: list[str], rank: int) -> None:
    """CheckpointError unless this process sees every file learner rank `rank` wrote into `directory`."""
    unseen = [name for name in files if not (Path(directory) / name).is_file()]
    if unseen:
        raise CheckpointError(
            f"learner rank {rank} wrote {unseen[0]} into {directory}, and this process does not see it "
            "there: a run on several nodes needs its run directory on storage every node shares "
            "(docs/cluster.md)"
        )


class LearnerRankLost(ClusterError):
    """A learner rank died; the run cannot go on (the caller adds how to resume)."""


class LearnerRank:
    """One rank: a policy rebuilt from its recipe, in the group's `Learner`."""

    def __init__(self, rank: int, world: int, threads: int):
        quiet_libraries()
        torch.set_num_threads(max(1, threads))
        self.rank, self.world = rank, world
        self.learner = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the group: this node's address and a free port."""
        host = require_ray().util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind(("", 0))
            return host, probe.getsockname()[1]

    def start(self, host: str, port: int, config, recipe: ModelRecipe, pad_id: int, reference) -> bool:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
        if config.keep_freed_memory:
            keep_freed_memory(config.kept_block_mib)
        # the GPU Ray gave this actor (cuda:0 of its visible devices) under `auto`, else the CPU; the
        # group's backend follows the device: NCCL between GPUs, gloo between CPUs
        device = resolve_device(config.model.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            GROUP_BACKENDS[device.type],
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(minutes=30),
        )
        get = require_ray().get
        # a LoRA base in this device's dtype; the weights read a bucket at a time
        model = recipe.build(readable(recipe.weights, get), lora_base_dtype(config, device))
        training_kernels(model.to(device), config.model)
        if reference is not None:
            reference = reference.build(readable(reference.weights, get)).to(device)
        self.bucket_bytes = config.cluster.sync_bucket_bytes
        self.engine_dtypes: dict[str, torch.dtype] = {}  # what the engines hold each weight in (send_as)
        self.learner = Learner(
            config, model, pad_id, reference, DataParallel(config.cluster.trainer_sharding)
        )
        return True

    def update(self, batch) -> dict[str, float]:
        metrics = self.learner.update(batch)
        release_freed_memory()  # reuse within an update, not across (devices/host.py)
        return metrics

    def send_as(self, dtypes: dict[str, torch.dtype]) -> None:
        self.engine_dtypes = dtypes

    def _only_rank_0_works(self) -> bool:
        """Whether this rank has nothing to do for a whole-model call: ddp's replicas are identical, so rank
        0 answers alone; fsdp2's gathers need every rank."""
        return self.rank != 0 and not self.learner.parallel.sharded

    def engine_weight_stream(self):
        """Rank 0: the policy's weights for the engines, a bucket at a time as it fills (a Ray streaming
        generator): the bucket itself (stored by Ray as the caller's object, so the driver owns it and
        never fetches it), then its names and bytes. The other ranks yield nothing, taking their part in
        each layer's gather (fsdp2) or nothing at all (ddp). (Buckets this rank put itself and yielded by
        reference can lose their reference count on the way to a worker: Ray's issue 58080.)"""
        if self._only_rank_0_works():
            return
        pieces = self.learner.engine_weights(self.engine_dtypes)  # each narrowed first, on its device
        if self.rank != 0:
            for _ in pieces:
                pass
            return
        # through host memory: the object store holds host tensors (docs/cluster.md, "Weight sync")
        host = ((name, tensor.cpu()) for name, tensor in pieces)
        for bucket, names, nbytes in packed_buckets(host, self.bucket_bytes):
            yield bucket
            yield names, nbytes

    def model_weights(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The policy's own state dict (a LoRA policy's adapters unmerged), whole, on rank 0; with
        `trainable_only`, its trained parameters and its buffers alone (a LoRA policy's adapters, which is
        what its checkpoints hold)."""
        if self._only_rank_0_works():
            return {}
        model = self.learner.model
        if self.learner.parallel.sharded:
            return full_weights(model, ignore_frozen=trainable_only)
        if not trainable_only:
            return model.state_dict()
        frozen = {name for name, parameter in model.named_parameters() if not parameter.requires_grad}
        return {name: value for name, value in model.state_dict().items() if name not in frozen}

    def save_model(self, directory: str, merged: bool = False) -> list[str]:
        """Rank 0 writes the policy into `directory` in Hugging Face format and returns its files' paths
        (relative to it); the others []. A full fine-tuning's weights and config; a LoRA policy's adapter,
        and with `merged` the merged model under merged/. Under fsdp2 gathered to rank 0's host first
        (the merged weights a layer at a time): collective."""
        if self._only_rank_0_works():
            return []
        model = self.learner.model
        lora = is_lora(model)
        weights = self.model_weights(trainable_only=lora)  # a LoRA policy's adapter: what trains
        whole = dict(self.learner.engine_weights()) if lora and merged else None
        if self.rank != 0:
            return []
        model.save_pretrained(directory, state_dict=weights, safe_serialization=True)
        if whole is not None:
            base = model.get_base_model()
            base.save_pretrained(Path(directory) / "merged", state_dict=whole, safe_serialization=True)
        return sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*") if p.is_file())

    def training_state(self, directory: str | None = None) -> tuple[dict, list[str]]:
        """The learner's state (rank 0's; the others' {}), and with `directory` the shard files this rank
        wrote there (every rank writes its own share of the optimizer state: collective)."""
        if directory is None:
            return ({} if self._only_rank_0_works() else self.learner.training_state()), []
        state = self.learner.training_state(Path(directory))
        return (state if self.rank == 0 else {}), shard_files(Path(directory) / SHARDS, self.rank)

    def load_training_state(self, state: dict) -> None:
        self.learner.load_training_state(state)

    def version(self) -> int:
        return self.learner.version


class RankedLearner(LearnerSide):
    """The learner of the Ray backend: `cluster.trainer_ranks` ranks, used as the loop uses a `Learner`."""

    def __init__(self, config, model, pad_token_id: int, reference=None):
        self.ray = require_ray()
        self.config = config
        cluster = config.cluster
        world = cluster.trainer_ranks
        actor = self.ray.remote(LearnerRank).options(**actor_options(cluster))
        self.ranks = [actor.remote(rank, world, max(1, int(cluster.num_cpus))) for rank in range(world)]
        host, port = self._all([self.ranks[0].address.remote()], "start", cluster.start_timeout_s)[0]
        recipe = ModelRecipe.of(model, config.model.lora if config.model.lora.enabled else None)
        recipe.weights = put_in_buckets(recipe.weights.items(), cluster.sync_bucket_bytes, self.ray.put)
        if reference is not None:
            reference = ModelRecipe.plain(reference)
            reference.weights = put_in_buckets(
                reference.weights.items(), cluster.sync_bucket_bytes, self.ray.put
            )
        started = [r.start.remote(host, port, config, recipe, pad_token_id, reference) for r in self.ranks]
        self._all(started, "start", cluster.start_timeout_s)
        self.version = 0
        self.last_sync_bytes = 0
        self.saves_own_weights = True  # rank 0 writes them into the checkpoints (`save_model`)

    # ------------------------------------------------------------ the loop's learner
    def update(self, batch) -> dict[str, float]:
        shared = self.ray.put(batch)  # sent once; each rank reads it from the object store
        metrics = self._all([r.update.remote(shared) for r in self.ranks], "update")[0]
        self.version += 1
        return metrics

    def state_dict(self, streamed: bool = False) -> BucketedWeights | WeightStream:
        """The policy's weights in Ray's object store, in buckets (the rollout workers read them);
        `streamed`: at once, as a `WeightStream` of rank 0's buckets as they come (the rollout workers load
        each while rank 0 reads the next)."""
        streams = [r.engine_weight_stream.options(num_returns="streaming").remote() for r in self.ranks]
        stream = WeightStream(self._streamed(streams[0], streams[1:]))
        return stream if streamed else stream.settled()

    def _streamed(self, rank0, others: list) -> Iterator[Bucket]:
        """Rank 0's buckets as they come (each bucket's reference, then its names and bytes, read here),
        then the other ranks' end; a rank's failure as `_all` reports it."""
        total = 0
        items = iter(rank0)
        for bucket in items:
            about = next(items, None)
            if about is None:  # the stream ended inside a bucket: what rank 0 yielded last was its error
                self._all([bucket], "weight sync")
                raise ClusterError("learner rank 0 ended a weight sync inside a bucket")
            names, nbytes = self._all([about], "weight sync")[0]
            total += nbytes
            yield bucket, names, nbytes
        for other in others:
            self._all(list(other), "weight sync")  # nothing, or what ended it
        self.last_sync_bytes = total

    def send_as(self, dtypes: dict[str, torch.dtype]) -> None:
        """From now on, send each weight in its dtype in `dtypes` where that is narrower than the ranks'
        (the rollout engines', `RayEngine.weight_dtypes`: the same bits, fewer bytes)."""
        shared = self.ray.put(dtypes)
        self._all([r.send_as.remote(shared) for r in self.ranks], "start")

    def training_state(self, directory: Path | None = None) -> dict:
        """Rank 0's state; with `directory` (the checkpoint being written) every rank writes its share of
        the optimizer state there and nothing of it comes here. The directory must be one every rank's
        node sees: a share written elsewhere fails the checkpoint, naming the rank."""
        if directory is None:
            return self._all([r.training_state.remote() for r in self.ranks], "checkpoint")[0][0]
        results = self._all([r.training_state.remote(str(directory)) for r in self.ranks], "checkpoint")
        for rank, (_, files) in enumerate(results):
            _seen_here(Path(directory) / SHARDS, files, rank)
        return results[0][0]

    def save_model(self, model, tokenizer, directory: Path, merged: bool = False) -> None:
        """Rank 0 writes the policy into the checkpoint itself (a LoRA policy's adapter, and with `merged`
        the merged model), so that its weights do not come through Ray; `model`, the driver's copy, is not
        read (`saves_own_weights`). This process writes the tokenizer."""
        merged = merged and self.config.model.lora.enabled
        files = self._all([r.save_model.remote(str(directory), merged) for r in self.ranks], "checkpoint")[0]
        _seen_here(directory, files, 0)
        tokenizer.save_pretrained(directory)
        if merged:
            tokenizer.save_pretrained(Path(directory) / "merged")

    def load_training_state(self, state: dict) -> None:
        ref = self.ray.put(state)
        self._all([r.load_training_state.remote(ref) for r in self.ranks], "resume")
        self.version = state["version"]

    def close(self) -> None:
        for rank in self.ranks:
            self.ray.kill(rank)
        self.ranks = []

    # ------------------------------------------------------------ every rank, or none
    def _all(self, refs: list, what: str, timeout: float | None = None) -> list:
        """Every rank's result of one call, in rank order; the first failure kills every rank and raises
        (a rank left waiting in a collective would never return)."""
        pending = list(refs)
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                self.close()
                raise ClusterError(
                    f"the learner ranks did not {what} within cluster.start_timeout_s={timeout:g} s (not enough "
                    "free resources for cluster.num_cpus / cluster.num_gpus per actor?)"
                )
            try:
                self.ray.get(ready[0])
            except self.ray.exceptions.RayActorError as err:
                rank = refs.index(ready[0])
                self.close()
                why = str(err).strip().splitlines()[-1]  # Ray's last line says how it died
                raise LearnerRankLost(
                    f"learner rank {rank} of {len(refs)} died during {what} ({why})"
                ) from None
            except self.ray.exceptions.RayTaskError as err:
                self.close()
                raise err.as_instanceof_cause() from None
        return self.ray.get(refs)
