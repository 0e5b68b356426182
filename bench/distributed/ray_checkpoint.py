"""A Ray run's checkpoint: written by the learner ranks against gathered into the driver, and the driver's
copy of the model let go.

Two learner ranks (`ddp`, then `fsdp2`) train a full fine-tuning of a Qwen3-MoE of the tiny-moe preset
widened to about 57M parameters (217 MiB in float32, 434 MiB of AdamW state) on a local Ray instance, as
`cluster.backend=ray` starts them; one update makes the optimizer's state. Then the checkpoint's model
and learner state are written as a run writes them now (`RankedLearner.save_model` and
`training_state(directory)`: rank 0 writes the weights, each rank its share of the optimizer state),
against the reference measured in the same run: as they were written before, gathered through Ray into
the driver (rank 0's whole weights sent and loaded into the driver's copy, saved from it, the whole
optimizer state sent to the driver and saved in trainer_state.pt: a checkpoint before 2026-11-29). Each way is written once to warm up,
then `--repeats` times; reported: the median time, the bytes that came through Ray to the driver, and
how far the driver's and rank 0's private memory (RssAnon, sampled every 2 ms after returning freed
heap to the OS) rose. Then what the driver's memory gives back when it lets its copy of the weights go,
as a run of the Ray learner does once it has started (`RLTrainer.train`).

    python -m bench.distributed.ray_checkpoint            # ~2 minutes on 2 CPU cores
    python -m bench.distributed.ray_checkpoint --tiny     # seconds: a model of a few MiB

Writes bench/results/ray_checkpoint.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, write_results
from bench.distributed.weight_sync import FLOOR_MIB, MODEL, TINY, start_sampling, status_kib, stop_sampling

SHARDINGS = ("ddp", "fsdp2")


class _Here:
    """Where the driver's own sampler keeps its figures (an actor keeps them on itself)."""


def _batch(tokenizer, rows: int = 8, prompt: int = 12, completion: int = 24):
    """A scored batch of random tokens, rewards that differ within each group of two (every row carries
    signal), so that the update steps the optimizer."""
    import torch

    from everyprompt.batch import RolloutBatch

    generator = torch.Generator().manual_seed(0)
    vocab = tokenizer.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    return RolloutBatch(
        prompt_ids=[ids(prompt) for _ in range(rows)],
        completion_ids=[ids(completion) for _ in range(rows)],
        rollout_logprobs=[torch.full((completion,), -1.0) for _ in range(rows)],
        finish_reason=["eos"] * rows,
        group_index=torch.arange(rows) // 2,
        prompt_index=[i // 2 for i in range(rows)],
        rewards=torch.tensor([float(i % 2) for i in range(rows)]),
        max_new_tokens=completion,
    )


def _write(learner, driver, tokenizer, directory: Path, gathered: bool) -> int:
    """One checkpoint's model and learner state into `directory`; the bytes that came to the driver."""
    import torch

    from everyprompt.models.io import save_pretrained

    directory.mkdir(parents=True)
    if gathered:  # the weights into the driver's copy and saved from it; the whole optimizer state here
        weights = learner._all([r.model_weights.remote() for r in learner.ranks], "checkpoint")[0]
        driver.load_state_dict(weights)
        arrived = _nbytes(weights)
        del weights  # let go once loaded, as the run did
        save_pretrained(driver, tokenizer, directory)
        state = learner.training_state()
        arrived += _nbytes(state)
    else:
        learner.save_model(driver, tokenizer, directory)
        state = learner.training_state(directory)
        arrived = _nbytes(state)
    torch.save(state, directory / "trainer_state.pt")
    return arrived


def _nbytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def measure(sharding: str, model: list[str], repeats: int, root: Path) -> dict:
    import ray

    from everyprompt.config import load_config
    from everyprompt.distributed.learner import RankedLearner
    from everyprompt.logs import quiet_libraries
    from everyprompt.models.io import load_model_and_tokenizer

    quiet_libraries()  # the driver's save_pretrained draws no progress bar in the reference's rows

    config = load_config(
        None,
        [
            *model,
            "cluster.backend=ray",
            "cluster.num_cpus=1",
            "cluster.trainer_ranks=2",
            f"cluster.trainer_sharding={sharding}",
            "rl.old_logprobs=recompute",
            "rl.mini_batches=1",
            "threads=1",
        ],
    )
    policy, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    learner = RankedLearner(config, policy, tokenizer.pad_token_id)
    here, rank0 = _Here(), learner.ranks[0]
    try:
        learner.update(_batch(tokenizer))
        rows = {}
        for label, gathered in (("gathered into the driver", True), ("written by the ranks", False)):
            times, rises = [], {}
            for attempt in range(repeats + 1):
                directory = root / f"{sharding}-{int(gathered)}-{attempt}"
                measured = attempt == 1
                if measured:
                    before = {
                        "driver": start_sampling(here),
                        "rank0": ray.get(rank0.__ray_call__.remote(start_sampling)),
                    }
                began = time.perf_counter()
                arrived = _write(learner, policy, tokenizer, directory, gathered)
                elapsed = time.perf_counter() - began
                if measured:
                    peaks = {
                        "driver": stop_sampling(here),
                        "rank0": ray.get(rank0.__ray_call__.remote(stop_sampling)),
                    }
                    for side, peak in peaks.items():
                        rises[f"{side}_private_rise_mib"] = round(
                            (peak["RssAnon"] - before[side]["RssAnon"]) / 1024, 1
                        )
                if attempt:  # the first warmed up
                    times.append(elapsed)
                shutil.rmtree(directory)
            rows[label] = {
                "to_driver_mib": round(arrived / 2**20, 1),
                **rises,
                "checkpoint_s": round(statistics.median(times), 3),
            }
        mine, theirs = rows["written by the ranks"], rows["gathered into the driver"]
        for key in ("driver_private_rise_mib", "rank0_private_rise_mib", "checkpoint_s"):
            floor = FLOOR_MIB if key.endswith("_rise_mib") else 0.0
            ratio = mine[key] / theirs[key] if theirs[key] > floor else None
            mine[f"{key.removesuffix('_rise_mib')}_vs_gathered"] = None if ratio is None else round(ratio, 3)
    finally:
        learner.close()
    # what the driver gives back when it lets its copy's weights go (RLTrainer.train under Ray)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    held = status_kib(("RssAnon",))["RssAnon"]
    weights = _nbytes(dict(policy.named_parameters()))
    policy.to("meta")
    libc.malloc_trim(0)
    released = (held - status_kib(("RssAnon",))["RssAnon"]) / 1024
    return {
        "weights_mib": round(weights / 2**20, 1),
        **rows,
        "driver_released_mib": round(released, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a small model and one measured write (seconds)")
    parser.add_argument("--repeats", type=int, default=3, help="measured writes of each way after the first")
    parser.add_argument("--out", default=str(RESULTS / "ray_checkpoint.json"))
    args = parser.parse_args(argv)
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(
        sys.modules["bench.distributed.weight_sync"]
    )  # the samplers run in the ranks
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    model, repeats = (TINY, 1) if args.tiny else (MODEL, args.repeats)
    setups = {}
    root = Path(tempfile.mkdtemp(prefix="ray-checkpoint-"))
    try:
        for sharding in SHARDINGS:
            setups[f"2 ranks {sharding}"] = row = measure(sharding, model, repeats, root)
            print(f"2 ranks {sharding}: {row}", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    write_results(Path(args.out), {"tiny": args.tiny, "setups": setups})
    return 0


if __name__ == "__main__":
    sys.exit(main())
