"""Where an RL step's resident memory goes: the process's resident set against the bytes glibc's malloc has
handed out (in use) and holds free, sampled every 50 ms and read by phase (the rollout, the update before
its first micro-batch, each micro-batch's forward and backward, the weight sync after the update), for one or more `kept_block_mib`
settings (devices/host.py), each in a process of its own.

A resident set well above the bytes in use is the heap's fragmentation: free blocks the next tensors do
not fit. The figures answer which setting keeps the peak nearest to what is in use, and at what time; each
phase's seconds and page faults say what fresh pages cost (a `+thp` setting asks for huge pages; `+trim`
hands the heap's free pages back before each micro-batch; `+jemalloc` and `+tcmalloc` replace glibc's
malloc with that allocator, preloaded, where glibc's in-use figures no longer apply).

    python -m bench.learner.heap_trace --model models/smollm2-135m-instruct --kept 1024,4 --steps 3     # ~5 min
    python -m bench.learner.heap_trace --model models/smollm2-135m-instruct --kept 1024,4 --steps 3 \
        --set rl.group_size=16 --tag group16                                                     # ~8 min
    python -m bench.learner.heap_trace --model models/smollm2-135m-instruct --kept 4,4+thp --steps 2 --tag thp
    python -m bench.learner.heap_trace --model models/smollm2-135m-instruct --kept 1024,1024+trim --steps 2 \
        --set rl.group_size=16 --tag trim
    python -m bench.learner.heap_trace --model models/smollm2-135m-instruct --kept 1024,1024+jemalloc --steps 2 \
        --set rl.group_size=16 --tag jemalloc      # needs libjemalloc.so.2 (Debian: libjemalloc2)

Writes bench/results/heap_trace_<model>[_<tag>].json (Linux with glibc 2.33 or later for the malloc figures).
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import parse_probing, recipe_parser, repo_path, run_probe, write_results
from bench.learner.rl_step import bench_overrides, matched_precision
from everyprompt.devices.malloc import MALLOCS, preloaded_environment, running_malloc, wanted_malloc
from everyprompt.devices.memory import peak_resident_bytes
from everyprompt.errors import InputError

GIB = 2**30
# a --kept setting's suffixes: transparent huge pages for torch's large CPU blocks and malloc_trim (the
# heap's free pages handed back) before each micro-batch of the update, each a variable its process starts
# with; and the malloc it runs on (the config's `malloc`, preloaded as the everyprompt command would:
# devices/malloc.py), glibc's where the setting names none, whatever the recipe says
ENVIRONMENT = {"thp": {"THP_MEM_ALLOC_ENABLE": "1"}, "trim": {"HEAP_TRACE_TRIM": "1"}}
ALLOCATORS = tuple(MALLOCS)
FLAGS = (*ENVIRONMENT, *ALLOCATORS)


class Sampler:
    """(phase, resident bytes, malloc's in-use and free bytes, time, page faults so far) samples: at each
    phase's start, and every `period` from a daemon thread once started."""

    def __init__(self, period: float = 0.05):
        self.phase, self.samples, self.period = "load", [], period
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.glibc = running_malloc() == "glibc"  # glibc's counts say nothing of another malloc's heap

    def start(self) -> Sampler:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def resident(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def enter(self, phase: str) -> None:
        """A new phase, sampled as it starts (a phase shorter than the period still shows)."""
        self.phase = phase
        self.sample()

    def sample(self) -> None:
        from everyprompt.devices import heap_usage

        in_use, free = (heap_usage() if self.glibc else None) or (None, None)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.samples.append((self.phase, self.resident(), in_use, free, time.perf_counter(), faults))

    def _run(self) -> None:
        while True:
            self.sample()
            time.sleep(self.period)

    def by_phase(self) -> dict[str, dict]:
        """Per phase: the highest resident set, malloc's in-use and free bytes at that moment, the highest
        in-use bytes, and the seconds and page faults (minor: a page mapped in, zero-filled) spent in it,
        each interval between two samples counted to the first one's phase (a phase starts with a
        sample)."""
        out: dict[str, dict] = {}
        samples = sorted(self.samples, key=lambda sample: sample[4])  # two threads append them
        for (phase, resident, in_use, free, at, faults), after in zip(samples, [*samples[1:], None]):
            row = out.setdefault(
                phase, {"peak_rss_gib": 0.0, "max_in_use_gib": None, "seconds": 0.0, "page_faults": 0}
            )
            if after is not None:
                row["seconds"] += after[4] - at
                row["page_faults"] += after[5] - faults
            if resident / GIB > row["peak_rss_gib"]:
                row["peak_rss_gib"] = resident / GIB
                row["in_use_at_peak_gib"] = None if in_use is None else in_use / GIB
                row["free_at_peak_gib"] = None if free is None else free / GIB
            if in_use is not None:
                row["max_in_use_gib"] = max(row["max_in_use_gib"] or 0.0, in_use / GIB)
        return out


def _phases(sampler: Sampler) -> list[int]:
    """Name the sampler's phase after the loop's: the update, each micro-batch of it, the weight sync that
    follows (the engine loading the new weights), and the rollout (everything else). With `+trim` in the
    environment, the heap is trimmed before each micro-batch; the count of trims done, as a one-item list."""
    from everyprompt.trainer.learner_side.learner import Learner
    from everyprompt.trainer.learner_side.step import MiniBatchStep
    from everyprompt.trainer.rollout_side import LocalRolloutSide

    update, micro_batch, load_weights = (
        Learner.update,
        MiniBatchStep._micro_batch,
        LocalRolloutSide.load_weights,
    )
    count, trims = [0], [0]

    def traced_update(self, batch):
        count[0] = 0
        sampler.enter("update")
        try:
            return update(self, batch)
        finally:
            sampler.enter("rollout")

    trim = os.environ.get("HEAP_TRACE_TRIM") == "1"

    def traced_micro_batch(self, *args, **kwargs):
        count[0] += 1
        if trim:
            from everyprompt.devices import release_freed_memory

            trims[0] += release_freed_memory()
        sampler.enter(f"micro_batch_{count[0]}")
        return micro_batch(self, *args, **kwargs)

    def traced_load_weights(self, *args, **kwargs):
        sampler.enter("weight_sync")
        try:
            return load_weights(self, *args, **kwargs)
        finally:
            sampler.enter("rollout")

    Learner.update, MiniBatchStep._micro_batch = traced_update, traced_micro_batch
    LocalRolloutSide.load_weights = traced_load_weights
    return trims


def probe(config: str, overrides: list[str], steps: int) -> dict:
    """`steps` RL steps in this process, traced."""
    from bench.throughput.rl import everyprompt_steps

    sampler = Sampler().start()
    trims = _phases(sampler)
    with tempfile.TemporaryDirectory() as run_dir:
        result = everyprompt_steps(overrides, steps, Path(run_dir), Path(config))
    phases = sampler.by_phase()
    return {
        **result,
        "peak_rss_bytes": peak_resident_bytes(),
        "phases": phases,
        "peak_phase": max(phases, key=lambda name: phases[name]["peak_rss_gib"]),
        "huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",  # as torch read it at its start
        "allocator": running_malloc(),
        "trims": trims[0],  # malloc_trim calls that handed pages back (0 unless the setting asked for them)
    }


def _setting(value: str) -> tuple[str, int, list[str]]:
    """`1024`, `4+thp`, `1024+trim`: (the setting's name, its size in MiB, its flags); ValueError if bad."""
    value = value.strip()
    size, *flags = value.split("+")
    bad = any(flag not in FLAGS for flag in flags) or len(set(flags)) < len(flags)
    if not size.isdigit() or bad or len(set(flags) & set(ALLOCATORS)) > 1:
        raise ValueError(value)
    return value, int(size), flags


def _malloc_of(flags: list[str]) -> str:
    """The malloc a setting's flags name; glibc's where none does."""
    return next((flag for flag in flags if flag in ALLOCATORS), "glibc")


def main(argv: list[str] | None = None) -> int:
    parser = recipe_parser(__doc__)
    parser.add_argument("--steps", type=int, default=2, help="RL steps per setting (the first is dropped)")
    parser.add_argument(
        "--kept",
        default="1024,4",
        help="kept_block_mib settings, comma-separated; a `+thp` suffix (e.g. 4+thp) also has torch's CPU "
        "allocator ask for transparent huge pages for blocks of 2 MiB or more (THP_MEM_ALLOC_ENABLE=1); "
        "`+trim` hands the heap's free pages back (malloc_trim) before each micro-batch of the update; "
        "`+jemalloc` or `+tcmalloc` preloads that malloc in place of glibc's (the default, whatever the recipe's "
        "`malloc`)",
    )
    parser.add_argument(
        "--tag", default="", help="appended to the results' file name (heap_trace_<model>_<tag>)"
    )
    args = parse_probing(parser, argv, probe)
    if args is None:
        return 0
    try:
        settings = [_setting(value) for value in args.kept.split(",")]
    except ValueError:
        parser.error(
            f"--kept {args.kept}: expected sizes in MiB, comma-separated, each optionally with +thp, +trim "
            "and one of +glibc, +jemalloc and +tcmalloc"
        )
    try:
        for _, _, flags in settings:
            wanted_malloc(_malloc_of(flags))
    except InputError as err:
        parser.error(f"--kept {args.kept}: {err}")
    overrides = bench_overrides(args.model, args.set)
    overrides += matched_precision(args.config, overrides)
    results: dict = {"benchmark": "heap_trace", "model": repo_path(args.model), "overrides": args.set}
    results["settings"] = {}
    for name, kept, flags in settings:
        print(f"kept_block_mib={name}: {args.steps} steps ...")
        # torch reads its variable once, at its first allocation, and a malloc is preloaded: both must be
        # there when the process starts
        malloc = _malloc_of(flags)
        env = preloaded_environment(malloc)
        env.update(value for flag in flags for value in ENVIRONMENT.get(flag, {}).items())
        arguments = [str(args.config), [*overrides, f"kept_block_mib={kept}", f"malloc={malloc}"], args.steps]
        row = run_probe(__file__, "--probe", arguments, env=env)
        if row["allocator"] != malloc:  # the loader refused the library, with only a warning
            print(f"error: {name}: the probe ran on {row['allocator']}'s malloc, not {malloc}'s")
            return 1
        results["settings"][name] = row
        peak = row["phases"][row["peak_phase"]]
        in_use = peak["max_in_use_gib"]
        print(
            f"  peak {row['peak_rss_bytes'] / GIB:.2f} GiB resident (in {row['peak_phase']}; at most "
            f"{'?' if in_use is None else f'{in_use:.2f}'} GiB in use there), {row['step_s']:.1f} s a step, "
            f"{row['train_s']:.1f} s of it the update"
        )
    name = args.model.name.removesuffix(".gguf")
    out = write_results(args.out / f"heap_trace_{name}{'_' + args.tag if args.tag else ''}.json", results)
    print(f"wrote {repo_path(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
