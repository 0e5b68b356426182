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

from collections.abc import Callable, Iterator

import torch
from torch import nn

from everyprompt.models.lora import MergedWeights, is_lora


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`model`'s `fully_shard` units with their module paths in its base model (a LoRA policy's wrapped
    model), the root first (path ""), then the others in module order."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise ValueError(f"{type(model).__name__} is not sharded (fully_shard): nothing to gather")
    base = model.get_base_model() if is_lora(model) else model
    inner = [(name, m) for name, m in base.named_modules() if isinstance(m, FSDPModule) and m is not model]
    return [("", model), *inner]


def unit_of(key_path: str, paths: list[str]) -> int:
    """The index in `paths` of the innermost unit holding the module at `key_path` (the root, "", holds
    everything no other unit does)."""
    best, depth = 0, -1
    for index, path in enumerate(paths):
        if path and (key_path == path or key_path.startswith(path + ".")) and len(path) > depth:
            best, depth = index, len(path)
    return best


def gathered_weights(
    model: nn.Module, keep: bool, wanted: Callable[[str], bool] | None = None, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """The sharded `model`'s weights as an engine loads them (`MergedWeights`' names), whole, one unit at a
    time (the root's first), copied to `device`; with `wanted`, only the names it accepts (a unit holding
    none is not gathered). Collective: every rank must iterate to the end; with `keep` the pairs are
    yielded (rank 0 for a sync; every rank for the learner's check slice), otherwise the rank only takes
    its part in the gathers."""
    weights = MergedWeights(model)
    found = units(model)
    paths = [path for path, _ in found]
    base = model.get_base_model() if is_lora(model) else model
    path_of = {id(module): name for name, module in base.named_modules()}
    by_unit: list[list[str]] = [[] for _ in found]
    for key in weights:
        if wanted is not None and not wanted(key):
            continue
        module, _ = weights.place(key)
        by_unit[unit_of(path_of[id(module)], paths)].append(key)
    for (_, unit), keys in zip(found, by_unit, strict=True):
        if not keys:
            continue
        unit.unshard()
        try:
            with torch.no_grad():
                for key in keys:
                    value = weights[key]  # read on the gathered unit: whole (merged, for LoRA)
                    if keep:
                        yield key, value.to(device, copy=True)  # its own storage: the unit reshards
        finally:
            unit.reshard()
