"""Where a phase's wall time goes on a GPU: the device's kernels laid on a timeline under torch's profiler.

`timeline(prof, wall_s, device)` merges the profiled kernels' intervals into the time the device was busy,
and counts the gaps between them by size, and the host's waits on the device (stream, event and device
synchronisations). A phase whose device is busy for most of its wall time is bound by its kernels (fewer,
fused ones are the way down); one with long gaps waits on the host (launches, Python between steps, reads
back). Where the code marks its phases for the profiler (devices/phases.py: the native engine's prefill,
sample, forward and read), each gap's time is put to the phase the host was in meanwhile (`idle_by_phase`; the
rest of the loop, between the marked phases, is `unmarked`), beside each phase's host time
(`host_by_phase`). bench/learner/rl_step.py profiles one more rollout of the recipe after its steps
(`rollout_profile`), so a lent GPU says why its decode steps take longer in an RL step than in the decode
bench (an H200, 2026-11-28: about 3.5 ms a step in the RL step's generation against 2.2-2.4 ms in the bench
at batch 32-64).

On a machine without CUDA the profile has no kernels; the result says so (and still gives the host's
phases).
"""

from __future__ import annotations

from collections import Counter

from everyprompt.devices.phases import PREFIX

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
GAPS_US = (10, 100, 1000)  # a gap is counted under the first bound it is below (and "longer" above them)


def kernel_intervals(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device kernel and copy among a profile's events, by start."""
    from torch.autograd import DeviceType

    return sorted(
        (event.time_range.start, event.time_range.end)
        for event in events
        if event.device_type == DeviceType.CUDA and event.time_range.end > event.time_range.start
    )


def idle_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The gaps between the union's pieces of `intervals` (sorted by start)."""
    gaps, end = [], None
    for start, stop in intervals:
        if end is not None and start > end:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, Counter, float]:
    """The union's length of `intervals` (sorted by start), the gaps between its pieces counted by size
    (`GAPS_US`), and the gaps' sum; microseconds."""
    if not intervals:
        return 0.0, Counter(), 0.0
    gaps = idle_intervals(intervals)
    idle = sum(stop - start for start, stop in gaps)
    span = max(stop for _, stop in intervals) - intervals[0][0]
    sizes = Counter(next((f"<{b}us" for b in GAPS_US if stop - start < b), "longer") for start, stop in gaps)
    return float(span - idle), sizes, float(idle)


def marked_phases(events) -> list[tuple[str, float, float]]:
    """The profile's ranges marked by `devices.phases.phase`: (name without its prefix, start, end; us)."""
    return [
        (event.name[len(PREFIX) :], event.time_range.start, event.time_range.end)
        for event in events
        if event.name.startswith(PREFIX)
    ]


def idle_by_phase(
    gaps: list[tuple[float, float]], phases: list[tuple[str, float, float]]
) -> dict[str, float]:
    """Each gap's microseconds put to the marked phases (name, start, end) it overlaps, the rest to
    `unmarked`."""
    out: Counter = Counter()
    for start, stop in gaps:
        covered = 0.0
        for name, begin, end in phases:
            overlap = min(stop, end) - max(start, begin)
            if overlap > 0:
                out[name] += overlap
                covered += overlap
        out["unmarked"] += max(stop - start - covered, 0.0)
    return dict(out)


def timeline(prof, wall_s: float, device) -> dict:
    """A profiled phase's device timeline (see the module docstring)."""
    events = prof.events()
    syncs = Counter(event.name for event in events if event.name in SYNCS)
    phases = marked_phases(events)
    host: Counter = Counter()
    for name, start, end in phases:
        host[name] += (end - start) / 1e6
    result = {"wall_s": wall_s, "host_syncs": sum(syncs.values()), "host_by_phase": dict(host)}
    # CUDA graph replays (their kernels come as the graph's nodes, where CUPTI records them: a timeline whose
    # kernels are few beside its launches did not see inside the graphs)
    result["graph_launches"] = sum(1 for event in events if event.name == "cudaGraphLaunch")
    if device.type != "cuda":
        return {**result, "device_busy_s": None, "why": f"no CUDA device ({device}): no kernels to lay out"}
    intervals = kernel_intervals(events)
    if not intervals:
        return {**result, "device_busy_s": None, "why": "the profiler saw no CUDA kernels (no CUPTI here)"}
    busy, gaps, idle = busy_and_gaps(intervals)
    return {
        **result,
        "kernels": len(intervals),
        "device_busy_s": busy / 1e6,
        "device_span_s": (max(stop for _, stop in intervals) - intervals[0][0]) / 1e6,
        "busy_of_wall": busy / 1e6 / wall_s if wall_s else None,
        "gaps": dict(gaps),
        "gaps_s": idle / 1e6,
        "idle_by_phase": {
            name: value / 1e6 for name, value in idle_by_phase(idle_intervals(intervals), phases).items()
        },
    }


def describe_timeline(row: dict) -> str:
    host = {name: round(value, 4) for name, value in row.get("host_by_phase", {}).items()}
    if row.get("device_busy_s") is None:
        return f"{row['wall_s']:.3f} s, the host's phases {host}; {row['why']}"
    idle = {name: round(value, 4) for name, value in row["idle_by_phase"].items()}
    return (
        f"{row['wall_s']:.3f} s, the device busy {row['device_busy_s']:.3f} s ({row['busy_of_wall']:.0%}) over "
        f"{row['kernels']} kernels; gaps {row['gaps']} summing {row['gaps_s']:.3f} s, idle by the host's "
        f"phase {idle}; the host's phases {host}; {row['host_syncs']} host syncs"
    )
