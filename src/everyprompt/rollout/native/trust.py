"""Whether a CUDA graph's first replay may stand for the eager step it was captured from.

A graph replays the kernels its capture recorded, and the capture need not record the ones the eager
warm-up ran: cuBLAS picks a matrix product's algorithm by the stream's workspace and the call's context, so
a bf16 step's replay may round a logit one bf16 unit away from the eager step's (0.25 for a logit between
32 and 64). Two eager steps of different batch sizes differ the same way, so that difference says nothing
against the graph. What a broken graph does (a stale buffer read, a row fed another row's token, a cache
position never written) moves values by a share of their size, not by units of the last place.

So a replay is judged by what the run uses, at the precision the step computes in:
- integer outputs (sampled tokens) are equal, except an output chosen from rounded values (the experts a
  MoE router picks) whose entries may differ in a bounded share (`Output.flips`): a near-tie between two
  experts' scores goes either way under one unit of rounding;
- floating outputs are within `UNITS` machine epsilons of the computing dtype, times each row's largest
  magnitude (never finer than `FLOOR` of it: the fp32 step's rule). Within that bound a row's greedy token
  can change only where the eager step's two best logits were within twice the bound of each other: a tie
  under rounding, which is what sampling at the engine's precision already allows.
The largest difference seen, in epsilons of the row's scale, is reported (`StepGraphs.stats`:
`graph_replay_eps`), so a run shows how close its trusted graphs came to the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# tolerance of a floating output: UNITS epsilons of its computing dtype times the row's largest magnitude
# (bf16: 4 * 2^-7, about 3% of the row's largest logit; between 2 and 4 units in the last place of it)
UNITS = 4
# the finest tolerance, as a share of the row's scale: the rule an fp32 step was always held to (1e-3)
FLOOR = 1e-3


@dataclass(frozen=True)
class Output:
    """A buffer a step writes, and how its replay is judged. `precision`: the dtype a floating output was
    computed in (bf16 logits are widened to float32 in the buffer; they are judged at bf16's precision);
    `flips`: for an integer output picked from rounded values, the share of entries that may differ."""

    tensor: torch.Tensor
    precision: torch.dtype = torch.float32
    flips: float = 0.0


def row_scale(expected: torch.Tensor) -> torch.Tensor:
    """Each row's largest finite magnitude, at least 1 (broadcastable to `expected`): a row is the last
    dimension of a tensor of two or more; each value of a vector is its own row."""
    magnitude = expected.detach().double().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    scale = magnitude.amax(dim=-1, keepdim=True) if expected.dim() >= 2 else magnitude
    return scale.clamp(min=1.0)


def share(precision: torch.dtype) -> float:
    """The allowed difference as a share of a row's scale: `UNITS` epsilons of `precision`, at least `FLOOR`."""
    return max(UNITS * torch.finfo(precision).eps, FLOOR)


def judge(index: int, got: torch.Tensor, expected: torch.Tensor, output: Output) -> tuple[str | None, float]:
    """(why replay `got` of output `index` may not stand for the eager `expected`, or None; the largest
    difference in epsilons of the output's precision times its row scale, 0 for integers)."""
    where = f"output {index} ({str(got.dtype).removeprefix('torch.')}, {list(got.shape)})"
    if got.shape != expected.shape:
        return f"{where}: shape differs from the eager step's {list(expected.shape)}", 0.0
    if not got.is_floating_point():
        differ = int((got != expected).sum())
        if differ > output.flips * got.numel():
            allowed = f" (at most {int(output.flips * got.numel())} may)" if output.flips else ""
            return f"{where}: {differ} of {got.numel()} values differ{allowed}", 0.0
        return None, 0.0
    a, b = got.double(), expected.double()
    if bool((a.isnan() != b.isnan()).any()):
        return f"{where}: NaN where the eager step has a number, or the reverse", 0.0
    gap = torch.where(a == b, 0.0, (a - b).abs()).nan_to_num(nan=0.0)  # equal infinities: no gap
    allowed = share(output.precision) * row_scale(expected)
    ratio = (gap / allowed).flatten()  # 1 at the bound
    if not ratio.numel():
        return None, 0.0
    worst = int(ratio.argmax())
    units = float(ratio[worst]) * share(output.precision) / torch.finfo(output.precision).eps
    if ratio[worst] > 1:
        name = str(output.precision).removeprefix("torch.")
        return (
            f"{where}: largest difference {float(gap.flatten()[worst]):.3g} where "
            f"{float(allowed.expand_as(gap).flatten()[worst]):.3g} was allowed ({name}: "
            f"{100 * share(output.precision):.2g}% of the row's largest magnitude)",
            units,
        )
    return None, units
