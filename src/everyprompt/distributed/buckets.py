"""Weights through Ray's object store in buckets: what a weight sync (and an actor's first model) is sent as.

The sender reads the weights one at a time (a LoRA policy's merged as they are read, a sharded learner's
gathered a layer at a time) and puts each bucket of about `cluster.sync_bucket_mib` into the store as soon
as it is full, then lets it go; a receiver reads them through `StreamedWeights`, a mapping that fetches a
bucket when a name in it is first read and keeps the last few. So the sender holds one bucket beside the
store and a receiver a few while it copies them into its engine, where a whole state dict had been put
and got at once (a second host copy of the model on each side: about 61 GB for Qwen3-30B-A3B in bf16).
verl sends its weights to the engines in buckets too (`update_weights_bucket_megabytes`, 512 MB unless set).

Ray is passed in (`put`, `get`): the buckets' logic is tested without it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

KEPT_BUCKETS = 2  # buckets a receiver holds: an engine that reads its ends first comes back to the first


@dataclass(frozen=True)
class BucketedWeights:
    """A handle to weights in the object store: each bucket's reference and the names it holds, in the
    order sent. Small to pickle; Ray does not resolve the references inside it, so each receiver fetches
    the buckets itself. Immutable, as a reference is (the asynchronous pipeline keeps it as it is)."""

    buckets: tuple[tuple[object, tuple[str, ...]], ...]
    nbytes: int  # the weights' size


def put_in_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, put: Callable
) -> BucketedWeights:
    """Put `(name, tensor)` pairs, read one at a time, into the store with `put` in buckets of at most
    `bucket_bytes` (a tensor larger than that goes alone); each bucket is let go once put."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[tuple[object, tuple[str, ...]]] = []
    bucket: dict[str, torch.Tensor] = {}
    filled = total = 0

    def flush() -> None:
        nonlocal bucket, filled
        if bucket:
            buckets.append((put(bucket), tuple(bucket)))
            bucket, filled = {}, 0

    for name, tensor in weights:
        size = tensor.numel() * tensor.element_size()
        if bucket and filled + size > bucket_bytes:
            flush()
        bucket[name] = tensor.detach()
        filled += size
        total += size
    flush()
    return BucketedWeights(tuple(buckets), total)


class StreamedWeights(Mapping):
    """The weights of a `BucketedWeights` as a read-only state dict: reading a name fetches its bucket with
    `get` (then kept among the last `keep` fetched), so a reader that takes the weights roughly in the
    order sent (an engine's `load_weights`, models/io.py's `load_one_by_one`) holds a few buckets at a
    time. Names and membership need no fetch."""

    def __init__(self, handle: BucketedWeights, get: Callable, keep: int = KEPT_BUCKETS):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.handle, self._get, self.keep = handle, get, keep
        self._where = {name: index for index, (_, names) in enumerate(handle.buckets) for name in names}
        self._kept: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def __getitem__(self, name: str) -> torch.Tensor:
        index = self._where[name]  # KeyError for a name not sent, as a dict's
        if index in self._kept:
            self._kept.move_to_end(index)
        else:
            self._kept[index] = self._get(self.handle.buckets[index][0])
            while len(self._kept) > self.keep:
                self._kept.popitem(last=False)
        return self._kept[index][name]

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def readable(weights, get: Callable) -> Mapping[str, torch.Tensor]:
    """`weights` as a state dict to read: a `BucketedWeights` streamed, a state dict as it is."""
    return StreamedWeights(weights, get) if isinstance(weights, BucketedWeights) else weights
