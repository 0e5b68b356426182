"""Where a phase's wall time goes on a GPU: the device's kernels laid on a timeline under torch's profiler.

`timeline(prof, wall_s, device)` merges the profiled kernels' intervals into the time the device was busy,
and counts the gaps between them by size, and the host's waits on the device (stream, event and device
synchronisations). A phase whose device is busy for most of its wall time is bound by its kernels (fewer,
fused ones are the way down); one with long gaps waits on the host (launches, Python between steps, reads
back). bench/rl_step.py profiles one more rollout of the recipe after its steps (`rollout_profile`), so a
lent GPU says why its decode steps take longer in an RL step than in the decode bench (an H200, 2026-11-28:
about 3.5 ms a step in the RL step's generation against 2.2-2.4 ms in the bench at batch 32-64).

On a machine without CUDA the profile has no kernels; the result says so.
"""

from __future__ import annotations

from collections import Counter

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
GAPS_US = (10, 100, 1000)  # a gap is counted under the first bound it is below (and "longer" above them)


def kernel_intervals(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device kernel and copy among a profile's events."""
    from torch.autograd import DeviceType

    return sorted(
        (event.time_range.start, event.time_range.end)
        for event in events
        if event.device_type == DeviceType.CUDA and event.time_range.end > event.time_range.start
    )


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, Counter, float]:
    """The union's length of `intervals` (sorted) in microseconds, the gaps between its pieces counted by
    size (`GAPS_US`), and the gaps' sum."""
    busy, gaps, idle = 0.0, Counter(), 0.0
    end = None
    for start, stop in intervals:
        if end is None or start > end:
            if end is not None:
                gap = start - end
                idle += gap
                gaps[next((f"<{bound}us" for bound in GAPS_US if gap < bound), "longer")] += 1
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, gaps, idle


def timeline(prof, wall_s: float, device) -> dict:
    """A profiled phase's device timeline (see the module docstring)."""
    events = prof.events()
    syncs = Counter(event.name for event in events if event.name in SYNCS)
    result = {"wall_s": wall_s, "host_syncs": sum(syncs.values())}
    if device.type != "cuda":
        return {**result, "device_busy_s": None, "why": f"no CUDA device ({device}): no kernels to lay out"}
    intervals = kernel_intervals(events)
    if not intervals:
        return {**result, "device_busy_s": None, "why": "the profiler saw no CUDA kernels (no CUPTI here)"}
    busy, gaps, idle = busy_and_gaps(intervals)
    span = (intervals[-1][1] - intervals[0][0]) / 1e6
    return {
        **result,
        "kernels": len(intervals),
        "device_busy_s": busy / 1e6,
        "device_span_s": span,  # the first kernel's start to the last one's end
        "busy_of_wall": busy / 1e6 / wall_s if wall_s else None,
        "gaps": dict(gaps),
        "gaps_s": idle / 1e6,
    }


def describe_timeline(row: dict) -> str:
    if row.get("device_busy_s") is None:
        return f"{row['wall_s']:.3f} s; {row['why']}"
    return (
        f"{row['wall_s']:.3f} s, the device busy {row['device_busy_s']:.3f} s ({row['busy_of_wall']:.0%}) over "
        f"{row['kernels']} kernels; gaps {row['gaps']} summing {row['gaps_s']:.3f} s; {row['host_syncs']} host syncs"
    )
