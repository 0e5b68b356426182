"""Where a learner update's time goes: one RL update of a recipe (configs/smollm2.yaml by default) timed and
profiled with torch.profiler, on the recipe's device (a GPU where torch sees one).

The run's first batches are made by its own rollout side (synchronously), the first updates warm up, and
the last is profiled: its operators by their own device time (self CUDA time on a GPU, CPU time elsewhere),
and the host syncs it made (CUDA's stream, event and device synchronisations and device-to-host copies,
counted from the profiler's runtime events). The GPU suite runs it (bench/gpu/suite.sh).

`--attention default,with-cudnn` profiles the update again with another attention (`ATTENTION`; the same
trainer and batches, one set-up after the other; the first is the result, the others go under
`variants`): the learner's own (on CUDA every SDPA backend of torch's but cuDNN's, models/attention.py),
then transformers' SDPA attention with torch choosing among all its backends (cuDNN's on a Hopper GPU,
whose plan for each new width cost an H200 0.59 s forward and 1.20 s backward of host time: docs/gpu-runs.md).

    python -m bench.learner.learner_profile --model models/smollm2-135m-instruct
    python -m bench.learner.learner_profile --model DIR --config configs/demo.yaml --updates 2   # smoke

Writes OUT/learner_profile_<model>.json and the profiler's table beside it (.txt).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import recipe_parser, repo_path, write_results
from bench.throughput.timeline import timeline

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# the attention an update is profiled with, by name: the learner's own, or transformers' SDPA attention
# with torch choosing its backend (the attention implementation the model is switched to; None: as it is)
ATTENTION = {"default": None, "with-cudnn": "sdpa"}


@contextlib.contextmanager
def attention_of(model, name: str):
    """`model` attending as `name` (an `ATTENTION` key) says, for the updates inside."""
    implementation = ATTENTION[name]
    before = model.config._attn_implementation
    if implementation is None or implementation == before:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def profile_updates(
    config_path: Path,
    overrides: list[str],
    updates: int,
    run_dir: Path,
    attention: list[str],
    kernels: list[str] = (),
) -> dict[str, tuple[dict, str]]:
    """Each set-up's figures and profiler table, by name: one trainer and one set of batches (made once by
    its rollout side) serve them all, each timed over `updates` updates and profiled on one more: each
    attention in the order given, then the learner's attention with each of `kernels` (`model.kernels`
    choices, models/kernels.py: the compiled layers made eager again after theirs, Liger's last, since
    its patching stays)."""
    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    base = [
        "rl.steps=1",
        "checkpoint.every=0",
        "rl.max_staleness=0",
        "eval.every=0",
        "logging.progress=false",
    ]
    config = load_config(config_path, [*overrides, *base])
    trainer = Run(config, run_dir).trainer()
    try:
        batches = [trainer.rollout.next_batch(step) for step in range(updates + 1)]
        profiles = {name: _profile(trainer.learner, batches, name) for name in attention}
        for name in sorted(kernels, key=lambda name: name == "liger"):
            profiles[name] = _with_kernels(trainer.learner, batches, name)
        return profiles
    finally:
        trainer.close()


def _with_kernels(learner, batches: list, name: str) -> tuple[dict, str]:
    """The learner's profile with layer kernels `name`, or why they could not run here (the other
    profiles stand)."""
    from everyprompt.models.compiled_layers import eager_layers
    from everyprompt.models.kernels import KernelsError, apply_kernels

    try:
        apply_kernels(learner.model, name)
    except KernelsError as err:
        print(f"{name}: not profiled: {err}")
        return {"skipped": str(err)}, ""
    try:
        return _profile(learner, batches, "default")
    finally:
        eager_layers(learner.model)


def _profile(learner, batches: list, attention: str) -> tuple[dict, str]:
    """`learner`'s updates on `batches` under `attention`: all but the last timed, the last profiled."""
    from torch.profiler import ProfilerActivity, profile

    device = next(learner.model.parameters()).device
    times = []
    with attention_of(learner.model, attention):
        for batch in batches[:-1]:
            synchronize(device)
            began = time.perf_counter()
            learner.update(batch)
            synchronize(device)
            times.append(time.perf_counter() - began)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            began = time.perf_counter()
            learner.update(batches[-1])
            synchronize(device)
            profiled_s = time.perf_counter() - began
    events = prof.key_averages()
    by = time_key(device)
    top = sorted(events, key=lambda e: getattr(e, by), reverse=True)[:25]
    syncs = {name: 0 for name in (*SYNCS, "device-to-host copies")}
    for event in events:
        if event.key in SYNCS:
            syncs[event.key] += event.count
        elif "Memcpy DtoH" in event.key:  # CUDA's name of a device-to-host copy
            syncs["device-to-host copies"] += event.count
    last = batches[-1]
    result = {
        "device": str(device),
        "attention": attention,
        "update_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "update_s_all": times,
        "sequences": len(last),
        "tokens": sum(len(p) + len(c) for p, c in zip(last.prompt_ids, last.completion_ids)),
        "host_syncs": syncs,
        "top_ops": [
            {
                "op": e.key,
                "count": e.count,
                "self_ms": getattr(e, by) / 1000,
                "cpu_ms": e.cpu_time_total / 1000,
            }
            for e in top
        ],
        "optimizer_fused": bool(learner.optimization.optimizer.defaults.get("fused")),
        # the profiled update's device timeline: how much of it the card was busy (bench/throughput/timeline.py)
        "timeline": timeline(prof, profiled_s, device),
    }
    return result, events.table(sort_by=by, row_limit=40)


def time_key(device) -> str:
    """The profiler's per-operator time to rank by: the device's own on a GPU (torch's name since 2.4;
    `self_cuda_time_total`, the older one, is gone from its averages), the host's on the CPU."""
    return "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = recipe_parser(__doc__)
    parser.add_argument("--updates", type=int, default=3, help="timed updates before the profiled one")
    parser.add_argument(
        "--attention",
        default="default",
        help=f"attention backends, comma-separated, each profiled in turn: {', '.join(ATTENTION)}",
    )
    parser.add_argument(
        "--kernels",
        default="",
        help="then once more with each of these layer kernels, comma-separated: liger (CUDA, the kernels "
        "extra), compiled (the first of its updates compiles)",
    )
    args = parser.parse_args(argv)
    if args.model is None or not args.model.exists():
        parser.error(f"--model {args.model}: no such checkpoint directory")
    names = args.attention.split(",")
    unknown = [name for name in names if name not in ATTENTION]
    if unknown:
        parser.error(f"--attention {', '.join(unknown)}: expected some of {', '.join(ATTENTION)}")
    from everyprompt.models import precision  # noqa: F401  (it registers every entry of the table)
    from everyprompt.models.kernels import KERNELS

    kernels = [name for name in args.kernels.split(",") if name]
    offered = [name for name in KERNELS if name != "torch"]  # torch's own kernels: the profile before them
    unknown = [name for name in kernels if name not in offered]
    if unknown:
        parser.error(f"--kernels {', '.join(unknown)}: expected some of {', '.join(offered)}")
    with tempfile.TemporaryDirectory() as run_dir:
        profiles = profile_updates(
            args.config,
            [f"model.path={args.model}", *args.set],
            args.updates,
            Path(run_dir),
            names,
            kernels,
        )
    result, table = profiles[names[0]]
    result["variants"] = {name: summary(profiles[name][0]) for name in profiles if name != names[0]}
    result.update(model=repo_path(args.model), config=repo_path(args.config), overrides=args.set)
    name = args.model.name.removesuffix(".gguf")
    out = write_results(args.out / f"learner_profile_{name}.json", result)
    out.with_suffix(".txt").write_text(table)
    print(table)
    for name in profiles:
        print(f"{name}: {summary(profiles[name][0])}")
    print(
        f"update {result['update_s']:.3f} s on {result['device']} ({result['sequences']} sequences, "
        f"{result['tokens']} tokens); host syncs {result['host_syncs']}; wrote {repo_path(out)}"
    )
    return 0


def summary(result: dict) -> dict:
    """A profile's headline figures: the update's seconds (the median, and each timed update's), its host
    syncs, its top operators by name (or why it was skipped)."""
    if "skipped" in result:
        return result
    top = {op["op"][:60]: round(op["self_ms"], 3) for op in result["top_ops"][:8]}
    figures = ("update_s", "update_s_all", "host_syncs", "timeline")  # the first update compiles, where asked
    return {**{key: result[key] for key in figures}, "top_self_ms": top}


if __name__ == "__main__":
    sys.exit(main())
