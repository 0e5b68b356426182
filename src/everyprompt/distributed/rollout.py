"""Rollout workers as Ray actors, driven as one `RolloutEngine`.

`RayEngine.generate` deals the requests to the workers by predicted length, longest first, each to the
least-loaded worker (`rollout.scheduler.assign_lpt`), and yields their completions as they stream back, so
the rollout side scores each one while the others decode, exactly as with one engine. The rollout side
assembles its batch by request id, and every request samples from its own seed, so the batch does not
depend on how many workers ran it or which ran what.

A worker that dies mid-call is replaced by a new one (built from the latest weights) and its requests
that had not come back are sent to it again; `cluster/actor_restarts` counts the replacements.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from everyprompt.devices import keep_freed_memory, release_freed_memory
from everyprompt.distributed.buckets import (
    ArrivingWeights,
    BucketedWeights,
    WeightStream,
    names_of,
    put_in_buckets,
    readable,
)
from everyprompt.distributed.recipes import ModelRecipe
from everyprompt.distributed.runtime import actor_options, require_ray
from everyprompt.errors import ClusterError
from everyprompt.logs import quiet_libraries
from everyprompt.models.io import weights_as_held
from everyprompt.rollout import GenerationRequest, SamplingParams, build_engine, offers, summed_stats
from everyprompt.rollout.scheduler import assign_lpt

log = logging.getLogger(__name__)

MAX_RESTARTS_PER_CALL = 3  # replacements of one worker within one generate call before the run stops


@dataclass
class _CallDone:
    """A worker's last item of a generate call: its engine's figures."""

    stats: dict[str, float]


class RolloutWorker:
    """One engine (built by the engine factory) over a model rebuilt from a recipe."""

    def __init__(self, recipe: ModelRecipe, tokenizer, rollout_config, threads: int, kept_block_mib: int):
        """`kept_block_mib`: the largest freed block this process keeps (devices/host.py); 0: glibc's
        defaults."""
        quiet_libraries()
        torch.set_num_threads(max(1, threads))
        if kept_block_mib:
            keep_freed_memory(kept_block_mib)
        # the recipe's weights in the object store: fetched a bucket at a time as the model reads them
        weights = readable(recipe.weights, require_ray().get)
        self.engine = build_engine(rollout_config, recipe.build(weights), tokenizer)
        self._names = names_of(recipe.weights)  # what every sync sends: the engine's weights
        self._syncs: dict[int, ArrivingWeights] = {}  # pipelined syncs under way, by number
        self._put_away = 0  # the last one finished
        self._syncs_lock = threading.Lock()

    def ready(self) -> tuple[bool, bool, bool]:
        """Whether the engine records routes, runs episodes (GenerationRequest.episode) and keeps a decode
        state for checkpoints."""
        engine = self.engine
        return bool(engine.can_record_routes), offers(engine, "episodes"), offers(engine, "decode_state")

    def decode_state(self) -> dict:
        return self.engine.decode_state()

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        return self.engine.weight_dtypes() if offers(self.engine, "weight_dtypes") else {}

    def load_decode_state(self, state: dict) -> None:
        self.engine.load_decode_state(state)

    def generate(self, requests: list[GenerationRequest], params: SamplingParams):
        try:
            yield from self.engine.generate(requests, params)
        finally:
            release_freed_memory()  # reuse within a call, not across (devices/host.py)
        yield _CallDone(dict(self.engine.stats))

    def load_weights(self, weights: BucketedWeights) -> None:
        """The engine reads the buckets as it reaches them (a few held at a time)."""
        self.engine.load_weights(readable(weights, require_ray().get))

    # a pipelined sync: its buckets arrive (`arrive`, on the actor's second thread) while the engine reads
    def _sync(self, sync: int) -> ArrivingWeights | None:
        """Sync `sync`'s weights, made by whichever of its calls runs first (Ray may run them in any order);
        None once it is put away (a call of an abandoned sync that comes late)."""
        with self._syncs_lock:
            if sync <= self._put_away:
                return None
            if sync not in self._syncs:
                self._syncs[sync] = ArrivingWeights(self._names, require_ray().get)
            return self._syncs[sync]

    def load_arriving(self, sync: int) -> None:
        """Load sync `sync`'s weights as their buckets arrive (syncs come one at a time, numbered up)."""
        weights = self._sync(sync)
        try:
            self.engine.load_weights(weights)
            weights.wait_complete()  # every bucket sent has arrived: none comes after it is put away
        finally:
            with self._syncs_lock:
                del self._syncs[sync]
                self._put_away = sync

    def arrive(self, sync: int, ref: list, names: tuple[str, ...]) -> None:
        """A bucket of sync `sync`: its reference, in a list (Ray would fetch a bare one before the call)."""
        if (weights := self._sync(sync)) is not None:
            weights.arrive(ref[0], names)

    def end_sync(self, sync: int, count: int | None) -> None:
        """Sync `sync` sent `count` buckets in all; None: its sender failed."""
        if (weights := self._sync(sync)) is not None:
            weights.end(count)

    def sleep(self) -> None:
        self.engine.sleep()
        release_freed_memory()


class RayEngine:
    """`cluster.rollout_workers` rollout workers behind the `RolloutEngine` protocol."""

    def __init__(self, config, model, tokenizer):
        self.ray = require_ray()
        self.config, self.tokenizer = config, tokenizer
        recipe = ModelRecipe.plain(model)
        recipe.weights = put_in_buckets(
            recipe.weights.items(), config.cluster.sync_bucket_bytes, self.ray.put
        )
        self.recipe = recipe
        self.stats: dict[str, float] = {}
        self.restarts = 0  # workers replaced so far in this run
        self.syncs = 0  # pipelined syncs so far (each numbered, for the workers)
        self.workers = [self._spawn() for _ in range(config.cluster.rollout_workers)]
        # episodes travel to a worker with their requests and come back stepped, in the completion
        self.can_record_routes, episodes, decode_state = self._await_ready(self.workers)
        self.offers = frozenset(
            name for name, offered in (("episodes", episodes), ("decode_state", decode_state)) if offered
        )
        # the dtype the engines hold each weight in (every worker's engine is configured alike), which a
        # sync's sender narrows its weights to (`cluster.sync_dtype=engine`); empty: sent as they are
        self.weight_dtypes: dict[str, torch.dtype] = {}
        if config.cluster.sync_dtype == "engine":
            self.weight_dtypes = self.ray.get(self.workers[0].weight_dtypes.remote())

    def _spawn(self):
        cluster = self.config.cluster
        actor = self.ray.remote(RolloutWorker).options(**actor_options(cluster, max_concurrency=2))
        threads = max(1, int(cluster.num_cpus))
        kept = self.config.kept_block_mib if self.config.keep_freed_memory else 0
        return actor.remote(self.recipe, self.tokenizer, self.config.rollout, threads, kept)

    def _await_ready(self, workers) -> tuple[bool, bool, bool]:
        refs = [worker.ready.remote() for worker in workers]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.config.cluster.start_timeout_s)
        if len(ready) < len(refs):
            raise ClusterError(
                f"{len(refs) - len(ready)} of {len(refs)} rollout workers did not start within "
                f"cluster.start_timeout_s={self.config.cluster.start_timeout_s:g} s (not enough free "
                "resources for cluster.num_cpus / cluster.num_gpus per actor?)"
            )
        answers = self.ray.get(refs)
        return tuple(all(a[i] for a in answers) for i in range(3))

    def load_weights(self, weights) -> None:
        """Every worker takes the learner's weights: buckets in Ray's object store (put once by a learner
        rank, read by each worker without passing through this process; a `WeightStream`: handed on as
        each is put, the workers loading it while the next is made), or a state dict, put here in
        buckets as it is read (a local learner's: a LoRA policy's merged one weight at a time)."""
        if isinstance(weights, WeightStream):
            self.recipe.weights = self._relay(weights)
            return
        if not isinstance(weights, BucketedWeights):
            pairs = weights_as_held(weights, self.weight_dtypes)
            weights = put_in_buckets(pairs, self.config.cluster.sync_bucket_bytes, self.ray.put)
        self.recipe.weights = weights  # what a replacement worker starts from
        self.ray.get([worker.load_weights.remote(weights) for worker in self.workers])

    def _relay(self, stream: WeightStream) -> BucketedWeights:
        """A pipelined sync: each worker starts loading, then each bucket is handed to every worker as the
        learner puts it; if the learner fails, the workers are told and its error raised. The buckets'
        handle, for a worker that replaces a lost one."""
        self.syncs += 1
        sync = self.syncs
        loads = [worker.load_arriving.remote(sync) for worker in self.workers]
        sent = 0
        handed: list = []
        try:
            for ref, bucket in stream:
                handed += [worker.arrive.remote(sync, [ref], bucket) for worker in self.workers]
                sent += 1
        except BaseException:
            for worker in self.workers:
                worker.end_sync.remote(sync, None)
            raise
        handed += [worker.end_sync.remote(sync, sent) for worker in self.workers]
        self.ray.get([*handed, *loads])
        return stream.settled()

    def sleep(self) -> None:
        """Every worker frees its engine's weights and cache until the next `load_weights` (a worker that
        replaces a lost one starts awake, from the recipe's weights)."""
        self.ray.get([worker.sleep.remote() for worker in self.workers])

    def decode_state(self) -> dict:
        """Each worker's decode state (a worker's compile switch is its own: its eager time)."""
        return {"workers": self.ray.get([worker.decode_state.remote() for worker in self.workers])}

    def load_decode_state(self, state: dict) -> None:
        """Each worker continues its predecessor's decode state, where the checkpoint's run had as many."""
        states = state["workers"]
        if len(states) != len(self.workers):
            log.info(
                "resuming with %d rollout workers where the checkpoint's run had %d: their compile states "
                "start afresh",
                len(self.workers),
                len(states),
            )
            return
        self.ray.get([w.load_decode_state.remote(s) for w, s in zip(self.workers, states, strict=True)])

    def close(self) -> None:
        for worker in self.workers:
            self.ray.kill(worker)
        self.workers = []

    # ------------------------------------------------------------ one call
    def generate(self, requests, params: SamplingParams):
        requests = list(requests)
        began = time.perf_counter()
        guesses = [
            r.predicted_length if r.predicted_length is not None else params.max_new_tokens for r in requests
        ]
        plan = assign_lpt(guesses, len(self.workers))
        # each worker's requests not yet returned, by request id, in the order assigned (longest first)
        owed = {w: {requests[i].request_id: requests[i] for i in jobs} for w, jobs in enumerate(plan) if jobs}
        streams = {self._submit(w, list(owed[w].values()), params): w for w in owed}
        calls: list[dict[str, float]] = []
        replaced = {w: 0 for w in owed}
        while streams:
            ready, _ = self.ray.wait(list(streams), num_returns=1)
            stream = ready[0]
            worker = streams[stream]
            try:
                item = self.ray.get(next(stream))
            except StopIteration:
                del streams[stream]
                continue
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.ObjectLostError) as err:
                del streams[stream]
                replaced[worker] += 1
                unfinished = list(owed[worker].values())
                streams[self._replace(worker, unfinished, params, replaced[worker], err)] = worker
                continue
            if isinstance(item, _CallDone):
                calls.append(item.stats)
                continue
            del owed[worker][item.request_id]
            yield item
        self.stats = self._merge(calls, time.perf_counter() - began, sum(replaced.values()))

    def _submit(self, worker: int, requests: list[GenerationRequest], params: SamplingParams):
        return self.workers[worker].generate.options(num_returns="streaming").remote(requests, params)

    def _replace(self, worker: int, unfinished, params, times: int, err: Exception):
        """A new worker in place of dead worker `worker`, given the requests it had not returned."""
        if times > MAX_RESTARTS_PER_CALL:
            raise ClusterError(
                f"rollout worker {worker} died {times} times in one generate call; last: {err}"
            ) from None
        log.warning(
            "rollout worker %d died (%s); replacing it and re-queueing its %d unfinished requests",
            worker,
            type(err).__name__,
            len(unfinished),
        )
        self.ray.kill(self.workers[worker])
        self.workers[worker] = self._spawn()
        self._await_ready([self.workers[worker]])
        self.restarts += 1
        return self._submit(worker, unfinished, params)

    @staticmethod
    def _merge(calls: list[dict[str, float]], wall: float, restarts: int) -> dict[str, float]:
        """One call's figures over the workers: tokens summed, per-step figures weighted by decode steps,
        throughput over this process's wall time."""
        tokens = sum(c.get("tokens", 0.0) for c in calls)
        steps = sum(c.get("decode_steps", 0.0) for c in calls)

        def weighted(key: str) -> float:
            return sum(c.get(key, 0.0) * c.get("decode_steps", 0.0) for c in calls) / max(steps, 1.0)

        return {
            "tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "slot_occupancy": weighted("slot_occupancy"),
            "decode_step_ms": weighted("decode_step_ms"),
            "decode_steps": steps,
            "wall_s": wall,
            "workers": float(len(calls)),
            "compiled": max((c.get("compiled", 0.0) for c in calls), default=0.0),
            **summed_stats(calls),
            "cluster/actor_restarts": float(restarts),
        }
