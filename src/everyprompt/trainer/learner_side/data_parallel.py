"""The learner's data-parallel group: which micro-batches this rank runs, and what the ranks reduce.

Every rank holds the same `RolloutBatch` and computes the same advantages and the same mini-batch order;
rank r of W takes the r-th of W contiguous shares of each mini-batch's rows and cuts it into micro-batches.
Each micro-batch's loss is already divided by the whole mini-batch's token (or sequence) count, and every
loss is a sum over rows, so the sum of the ranks' gradients is the single-process gradient (up to the
order of floating-point sums):

- `ddp`: every rank holds the whole model; after its micro-batches the gradients are summed across ranks
  in one flat all-reduce (a gradient no rank produced stays None, as in one process, so AdamW skips it
  exactly as it would there).
- `fsdp2`: parameters, gradients and optimizer state are sharded with torch's `fully_shard`; each backward
  reduce-scatters (summing: the divide factor is 1). Its forwards are collective, so every rank runs the
  same number of passes: a rank with fewer micro-batches runs zero-weighted ones.

One process is rank 0 of a group of 1, and every method is then the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

SHARDINGS = ("ddp", "fsdp2")


class DataParallel:
    """This process's place in the learner's group (the default process group when one is initialised)."""

    def __init__(self, sharding: str = "ddp"):
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
        self.sharding = sharding
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1

    @property
    def sharded(self) -> bool:
        return self.distributed and self.sharding == "fsdp2"

    # ------------------------------------------------------------ the model
    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """`fsdp2`: `fully_shard` each decoder layer (transformers' `_no_split_modules`), then the root, in
        place. Call before the optimizer is built. `ddp` and one process: `model` as it is."""
        if not self.sharded:
            return model
        from torch.distributed.fsdp import fully_shard

        layers = set(getattr(model, "_no_split_modules", None) or ())
        for module in list(model.modules()):
            if module is not model and type(module).__name__ in layers:
                fully_shard(module)
        fully_shard(model)
        for module in model.modules():  # each micro-batch's loss is already a share of the whole: sum
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        return model

    # ------------------------------------------------------------ the work
    def micro_batches(
        self,
        rows: Sequence[int],
        size: int | None,
        tokens: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> list[tuple[tuple[int, int], list[int] | None]]:
        """This rank's micro-batches of `rows`: its contiguous share of them (ranks' shares differ by at most
        one row) cut into consecutive micro-batches of at most `size` rows (None: no cap) and, with `tokens`,
        at most that many tokens by `lengths` (each row's, parallel to `rows`; a longer row goes alone),
        each with its place `(rank, number)` in the whole (`in_order` puts the ranks' pieces back in `rows`
        order). Under `fsdp2`, padded with `(key, None)` to the same count on every rank: run those on any
        row with zero weight."""
        if tokens is not None and lengths is None:
            raise ValueError("a token cap needs each row's length")
        share, extra = divmod(len(rows), self.world)
        cuts = {}  # by rank: this one's, and under fsdp2 every rank's (each rank holds the same rows)
        for rank in range(self.world) if self.sharded else (self.rank,):
            begin = rank * share + min(rank, extra)
            cuts[rank] = _cut(range(begin, begin + share + (rank < extra)), size, tokens, lengths)
        mine = cuts[self.rank]
        chunks: list[tuple[tuple[int, int], list[int] | None]] = [
            ((self.rank, number), [rows[i] for i in piece]) for number, piece in enumerate(mine)
        ]
        if self.sharded:
            rounds = max(len(cut) for cut in cuts.values())  # as many passes as the busiest rank
            chunks += [((self.rank, len(chunks) + n), None) for n in range(rounds - len(chunks))]
        return chunks

    # ------------------------------------------------------------ reductions
    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """`ddp`: sum every trainable parameter's gradient across ranks (one flat all-reduce, with a flag
        per parameter of whether any rank produced one). `fsdp2` reduced them in its backward."""
        if not self.distributed or self.sharded:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        device = params[0].device  # NCCL reduces tensors on the GPU, gloo on the CPU
        present = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64).to(device)
        dist.all_reduce(present)
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
        )
        dist.all_reduce(flat)
        offset = 0
        for param, had in zip(params, present.tolist()):
            size = param.numel()
            if had:
                param.grad = flat[offset : offset + size].view_as(param).to(param.dtype)
            else:
                param.grad = None
            offset += size

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (every rank must call)."""
        if not self.distributed:
            return flag
        value = torch.tensor([float(flag)]).to(_group_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each key's sum over the ranks (keys missing on a rank count as 0)."""
        if not self.distributed:
            return values
        every = self.gather(values)
        keys = sorted({key for part in every for key in part})
        return {key: sum(part.get(key, 0.0) for part in every) for key in keys}

    def gather(self, item: Any) -> list[Any]:
        """Every rank's `item`, in rank order (every rank must call)."""
        if not self.distributed:
            return [item]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, item)
        return out

    def in_order(self, pieces: list[tuple[tuple[int, int], list]]) -> list:
        """The ranks' `(micro-batch key, values)` pieces, gathered and concatenated in the keys' order: the
        lists a single process would have built."""
        if self.distributed:  # host copies: gathered objects are pickled, and a GPU tensor's pickle copies
            pieces = [(key, [_host(value) for value in values]) for key, values in pieces]
        every = sorted((piece for part in self.gather(pieces) for piece in part), key=lambda p: p[0])
        return [value for _, values in every for value in values]


def _cut(
    indices: range, size: int | None, tokens: int | None, lengths: Sequence[int] | None
) -> list[list[int]]:
    """`indices` in consecutive pieces of at most `size` indices and `tokens` tokens (`lengths[i]` each)."""
    pieces: list[list[int]] = []
    held = 0
    for i in indices:
        length = lengths[i] if tokens is not None else 0
        full = pieces and (
            (size is not None and len(pieces[-1]) >= size) or (tokens is not None and held + length > tokens)
        )
        if not pieces or full:
            pieces.append([])
            held = 0
        pieces[-1].append(i)
        held += length
    return pieces


def _group_device() -> torch.device:
    """Where the group's collectives take their tensors: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _host(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value
