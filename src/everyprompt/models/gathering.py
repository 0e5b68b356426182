"""A sharded learner's weights for the engines, gathered one layer at a time.

Under `fsdp2` each decoder layer and the root (the embeddings, the final norm, the head) are a
`fully_shard` unit whose parameters every rank holds a shard of. For a weight sync the units are gathered
one at a time, as the forward gathers them (`unshard`), their weights read (a LoRA policy's adapted ones
merged as `MergedWeights` merges them, on the gathered layer), copied to rank 0's host, and the unit
resharded before the next. So no rank holds more than one unit whole beside its shards, and rank 0 needs
no unsharded copy of the policy to merge its adapters in (verl's `layered_summon` gathers a LoRA policy's
layers one at a time for the same reason).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from everyprompt.models.io import as_held
from everyprompt.models.lora import MergedWeights


def units(model: nn.Module) -> list[nn.Module]:
    """`model`'s `fully_shard` units: the root first, then the others in module order (a unit inside
    another after it)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise ValueError(f"{type(model).__name__} is not sharded (fully_shard): nothing to gather")
    return [model, *(m for m in model.modules() if isinstance(m, FSDPModule) and m is not model)]


def owners(found: list[nn.Module]) -> dict[int, int]:
    """Each module's unit, by the module's id: the index in `found` (`units`) of the innermost unit that
    holds it; a module absent from it is the root's (0)."""
    owner = {}
    for index, unit in enumerate(found[1:], start=1):  # an inner unit comes after the one holding it
        for module in unit.modules():
            owner[id(module)] = index
    return owner


def gathered_weights(
    model: nn.Module,
    keep: bool,
    wanted: Callable[[str], bool] | None = None,
    device: str = "cpu",
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The sharded `model`'s weights as an engine loads them (`MergedWeights`' names), whole, one unit at a
    time (the root's first), copied to `device` (each cast first to its dtype in `dtypes` where that is
    narrower: models/io.py's `as_held`); with `wanted`, only the names it accepts (a unit holding
    none is not gathered). Collective: every rank must iterate to the end; with `keep` the pairs are read
    and yielded (rank 0 for a sync; every rank for the learner's check slice), otherwise the rank only
    takes its part in the gathers."""
    weights = MergedWeights(model)
    found = units(model)
    owner = owners(found)
    by_unit: list[list[str]] = [[] for _ in found]
    for key in weights:
        if wanted is None or wanted(key):
            by_unit[owner.get(id(weights.place(key)[0]), 0)].append(key)
    for unit, keys in zip(found, by_unit, strict=True):
        if not keys:
            continue
        unit.unshard()
        try:
            if keep:
                with torch.no_grad():
                    for key in keys:  # read on the gathered unit: whole (merged, for LoRA)
                        value = weights[key]
                        held = as_held(value, dtypes.get(key) if dtypes else None)
                        # in storage of its own: the unit reshards (a cast made one already)
                        yield key, held.to(device, copy=held is value)
        finally:
            unit.reshard()
