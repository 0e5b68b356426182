"""A Ray weight sync's host memory and time: in buckets against the whole weights in one bucket, pipelined
against one side after the other, and to bf16 engines in bf16 against the learner's own dtype.

Each learner (one rank; two fsdp2 ranks training LoRA adapters) is started with one rollout worker (the
native engine) on a local Ray instance, as `cluster.backend=ray` starts them, over a Qwen3-MoE of the
tiny-moe preset widened to about 57M parameters (217 MiB in float32); then syncs run: the learner's
weights put into the object store (`RankedLearner.state_dict`) and loaded by the worker's engine
(`RayEngine.load_weights`). Around the second sync each actor returns its freed heap to the OS and samples
its own /proc/self/status every 2 ms: reported is how far its private memory (RssAnon: tensors, buckets,
copies) rose above where it was, and apart, the object store's pages it mapped (RssShmem). The reference
is the same code with `cluster.sync_bucket_mib` above the model's size: one bucket, the whole weights put
and fetched at once, as every sync was sent before buckets. Sync times are medians of `--syncs` after the
first. Then the same buckets pipelined, as a synchronous run sends them (`state_dict(streamed=True)`: the
worker loads each bucket as rank 0 puts it), against the bucketed row (the worker starts once rank 0
has put the last). Then, in buckets both ways, bf16 engines (one rank; two fsdp2 ranks training LoRA adapters on a
bf16 base) sent each weight in the dtype the engine holds it in (`cluster.sync_dtype=engine`: bf16),
against the learner's own (`learner`: float32, a bf16 base's adapted weights merged in float32).

    python -m bench.distributed.weight_sync            # ~7 minutes on 2 CPU cores; buckets of 16 MiB
    python -m bench.distributed.weight_sync --tiny     # ~3 minutes: a model of a few MiB in buckets of 1 MiB

Writes bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench.common import RESULTS, write_results

MODEL = [
    "model.hidden_size=512",
    "model.num_layers=8",
    "model.num_experts=8",
    "model.moe_intermediate_size=512",
]
TINY = [
    "model.hidden_size=256",
    "model.num_layers=2",
    "model.num_experts=4",
    "model.moe_intermediate_size=256",
]
WHOLE_MIB = 1 << 14  # above any model here: one bucket
FLOOR_MIB = 5.0  # a private-memory rise below this is allocator noise: no ratio is taken against it
FSDP2_LORA = ["cluster.trainer_ranks=2", "cluster.trainer_sharding=fsdp2", "model.lora.enabled=true"]
LEARNERS = {"1 rank": ["cluster.trainer_ranks=1"], "2 ranks fsdp2 + LoRA": FSDP2_LORA}
# the sync's dtype (bucketed both ways): bf16 engines sent the learner's float32 weights (a LoRA policy on a
# bf16 base: its float32 merges) against each weight cast to bf16 first (`cluster.sync_dtype`)
BF16_ENGINE = ["rollout.precision=bf16", "rl.old_logprobs=recompute"]
BF16_LEARNERS = {
    "1 rank, bf16 engine": ["cluster.trainer_ranks=1", *BF16_ENGINE],
    "2 ranks fsdp2 + LoRA on a bf16 base, bf16 engine": [
        *FSDP2_LORA,
        "model.dtype=bf16",
        "model.frozen_dtype=bf16",
        *BF16_ENGINE,
    ],
}


def status_kib(fields: tuple[str, ...]) -> dict[str, int]:
    """This process's /proc/self/status figures `fields`, in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in fields:
                out[name] = int(line.split()[1])
    return out


FIELDS = ("RssAnon", "RssShmem")  # private memory (tensors, buckets) and the object store's pages mapped


def start_sampling(actor) -> dict[str, int]:
    """In an actor: return freed heap pages to the OS, then sample FIELDS every 2 ms until `stop_sampling`;
    the figures before."""
    import ctypes
    import threading

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status_kib(FIELDS)
    sampled = actor.bench_sampled = {"peak": dict(before), "stop": threading.Event()}  # on the actor

    def sample() -> None:
        while not sampled["stop"].wait(0.002):
            for name, value in status_kib(FIELDS).items():
                sampled["peak"][name] = max(sampled["peak"][name], value)

    sampled["thread"] = threading.Thread(target=sample, daemon=True)
    sampled["thread"].start()
    return before


def stop_sampling(actor) -> dict[str, int]:
    sampled = actor.bench_sampled
    sampled["stop"].set()
    sampled["thread"].join()
    return dict(sampled["peak"])


def measure(overrides: list[str], model: list[str], syncs: int, streamed: bool = False) -> dict:
    """One set-up's syncs; `streamed`: pipelined, as a synchronous run's (`state_dict(streamed=True)`)."""
    import ray

    from everyprompt.config import load_config
    from everyprompt.distributed.learner import RankedLearner
    from everyprompt.distributed.rollout import RayEngine
    from everyprompt.models.io import load_model_and_tokenizer
    from everyprompt.models.lora import apply_lora

    config = load_config(
        None,
        [
            *model,
            "cluster.backend=ray",
            "cluster.num_cpus=1",
            "rollout.engine=native",
            "threads=1",
            *overrides,
        ],
    )
    policy, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    if config.model.lora.enabled:
        policy = apply_lora(policy, config.model.lora)
    learner = RankedLearner(config, policy, tokenizer.pad_token_id)
    engine = RayEngine(config, policy, tokenizer)
    learner.send_as(engine.weight_dtypes)  # as a run's backend does (distributed/backend.py)
    try:
        actors = {"rank0": learner.ranks[0], "worker": engine.workers[0]}
        times, rises = [], {}
        for sync in range(syncs + 1):
            measured = sync == 1  # the first sync warmed up; the second is the one measured for memory
            if measured:
                before = {side: ray.get(a.__ray_call__.remote(start_sampling)) for side, a in actors.items()}
            began = time.perf_counter()
            engine.load_weights(learner.state_dict(streamed=streamed))
            times.append(time.perf_counter() - began)
            if measured:
                for side, actor in actors.items():
                    peak = ray.get(actor.__ray_call__.remote(stop_sampling))
                    for field, label in (("RssAnon", "private"), ("RssShmem", "store_pages")):
                        rises[f"{side}_{label}_rise_mib"] = round(
                            (peak[field] - before[side][field]) / 1024, 1
                        )
        handle = learner.state_dict()
        return {
            "weights_mib": round(handle.nbytes / 2**20, 1),
            "buckets": len(handle.buckets),
            **rises,
            "sync_s": round(statistics.median(times[1:]), 3),
        }
    finally:
        learner.close()
        engine.close()


def _row(
    rows: dict, name: str, overrides: list[str], model: list[str], syncs: int, streamed: bool = False
) -> dict:
    """Set-up `name` measured (`measure`) into `rows`, and printed."""
    row = rows[name] = measure(overrides, model, syncs, streamed)
    print(f"{name}: {row}", flush=True)
    return row


def _ratios(mine: dict, theirs: dict, versus: str) -> None:
    """`mine`'s figures over `theirs`, beside `mine` as `<figure>_vs_<versus>`; None for a memory rise under
    `FLOOR_MIB` in `theirs` (a few pages' wobble, no ratio worth reading)."""
    for key in ("weights_mib", "rank0_private_rise_mib", "worker_private_rise_mib", "sync_s"):
        floor = FLOOR_MIB if key.endswith("_rise_mib") else 0.0
        ratio = mine[key] / theirs[key] if theirs[key] > floor else None
        mine[f"{key.removesuffix('_rise_mib')}_vs_{versus}"] = None if ratio is None else round(ratio, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a small model and one measured sync (seconds)")
    parser.add_argument("--syncs", type=int, default=3, help="measured syncs after the first")
    parser.add_argument("--bucket-mib", type=int, help="the bucketed set-ups' buckets (16; --tiny: 1)")
    parser.add_argument("--out", default=str(RESULTS / "weight_sync.json"))
    args = parser.parse_args(argv)
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the samplers run in the actors
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # CPUs declared for every actor of a set-up (2 ranks and a worker); on a small machine they share cores
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    model, syncs = (TINY, 1) if args.tiny else (MODEL, args.syncs)
    bucket_mib = args.bucket_mib or (1 if args.tiny else 16)
    rows = {}
    buckets, whole = f"cluster.sync_bucket_mib={bucket_mib}", f"cluster.sync_bucket_mib={WHOLE_MIB}"
    try:
        for learner, overrides in LEARNERS.items():
            one = _row(rows, f"{learner}, one bucket", [*overrides, whole], model, syncs)
            mine = _row(rows, f"{learner}, {bucket_mib} MiB buckets", [*overrides, buckets], model, syncs)
            _ratios(mine, one, "one_bucket")
            name = f"{learner}, {bucket_mib} MiB buckets, pipelined"
            piped = _row(rows, name, [*overrides, buckets], model, syncs, streamed=True)
            _ratios(piped, mine, "one_after_the_other")
        for learner, overrides in BF16_LEARNERS.items():
            theirs = _row(
                rows,
                f"{learner}, learner dtype",
                [*overrides, buckets, "cluster.sync_dtype=learner"],
                model,
                syncs,
            )
            mine = _row(
                rows,
                f"{learner}, engine dtype",
                [*overrides, buckets, "cluster.sync_dtype=engine"],
                model,
                syncs,
            )
            _ratios(mine, theirs, "learner_dtype")
    finally:
        ray.shutdown()
    for name, row in rows.items():
        print(f"{name:40s} " + " ".join(f"{k}={v}" for k, v in row.items()))
    write_results(Path(args.out), {"tiny": args.tiny, "bucket_mib": bucket_mib, "setups": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
