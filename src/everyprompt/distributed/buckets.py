"""Weights through Ray's object store in buckets: what a weight sync (and an actor's first model) is sent as.

The sender reads the weights one at a time (a LoRA policy's merged as they are read, a sharded learner's
gathered a layer at a time) and puts each bucket of about `cluster.sync_bucket_mib` into the store as soon
as it is full, then lets it go; a receiver reads them through `StreamedWeights`, a mapping that fetches a
bucket when a name in it is first read and keeps the last few. So the sender holds one bucket beside the
store and a receiver a few while it copies them into its engine, where a whole state dict had been put
and got at once (a second host copy of the model on each side: about 61 GB for Qwen3-30B-A3B in bf16).
verl sends its weights to the engines in buckets too (`update_weights_bucket_megabytes`, 512 MB unless set).

A synchronous run's sync is pipelined: the sender's buckets are handed on as each is put (`WeightStream`),
and a receiver's engine reads them through `ArrivingWeights`, which waits for a bucket that has not yet
arrived, so the engines load bucket k while the sender reads and puts bucket k + 1.

A bucket goes into the store as each tensor's bytes (a NumPy byte array, which Ray keeps out of band)
with its dtype and shape, not as pickled tensors: the put is one copy into the store, and a receiver's
tensors are views of the store's memory, read-only and copied by the engine as it loads them (no
deserialised copy of the bucket in between). Ray documents NumPy arrays as zero-copy on a node.

Ray is passed in (`put`, `get`): the buckets' logic is tested without it.
"""

from __future__ import annotations

import threading
import warnings
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

    @classmethod
    def of(cls, buckets: Iterable[Bucket]) -> BucketedWeights:
        """The handle to buckets in the store (`Bucket`s)."""
        buckets = list(buckets)
        return cls(tuple((ref, names) for ref, names, _ in buckets), sum(nbytes for *_, nbytes in buckets))


Bucket = tuple[object, tuple[str, ...], int]  # a bucket in the store: its reference, its names, its bytes


def packed(bucket: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """A bucket as the store keeps it: each tensor's bytes (a view where it is contiguous on the host), its
    dtype's name and its shape."""
    return {
        name: (host_bytes(t), str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for name, t in bucket.items()
    }


def host_bytes(tensor: torch.Tensor):
    """`tensor`'s bytes as a flat NumPy uint8 array (a view of a contiguous host tensor; a 0-d one too)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def unpacked(bucket: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """`packed`'s bucket as tensors viewing its bytes (read-only: the store's memory; never written)."""
    with warnings.catch_warnings():  # torch warns that a read-only array's tensor must not be written
        warnings.simplefilter("ignore", UserWarning)
        return {
            name: torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)
            if data.size
            else torch.empty(shape, dtype=getattr(torch, dtype))  # no bytes to view
            for name, (data, dtype, shape) in bucket.items()
        }


def packed_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple]:
    """`(name, tensor)` pairs, read one at a time, in buckets of at most `bucket_bytes` (a tensor larger
    than that goes alone), each yielded `packed` with its names and bytes as soon as it is full, before
    the next weight is read."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: dict[str, torch.Tensor] = {}
    filled = 0
    for name, tensor in weights:
        size = tensor.numel() * tensor.element_size()
        if bucket and filled + size > bucket_bytes:
            yield packed(bucket), tuple(bucket), filled
            bucket, filled = {}, 0
        bucket[name] = tensor.detach()
        filled += size
    if bucket:
        yield packed(bucket), tuple(bucket), filled


def put_in_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, put: Callable
) -> BucketedWeights:
    """`packed_buckets`' buckets, each put into the store with `put` as it is made and then let go, as one
    handle."""
    return BucketedWeights.of(
        (put(bucket), names, n) for bucket, names, n in packed_buckets(weights, bucket_bytes)
    )


class WeightStream:
    """A sync's buckets as the sender puts them: iterated once, by whoever hands them on (each bucket's
    reference and names, as it comes); `settled()` then, or instead, is the `BucketedWeights` of them all.
    `buckets` is anything that yields `Bucket`s (the Ray learner's: rank 0's stream, its failures mapped)."""

    def __init__(self, buckets: Iterable[Bucket]):
        self._source: Iterator[Bucket] | None = iter(buckets)
        self._seen: list[Bucket] = []
        self._handle: BucketedWeights | None = None

    def __iter__(self) -> Iterator[tuple[object, tuple[str, ...]]]:
        if self._source is None:
            raise RuntimeError("a weight stream is handed on once; its buckets since: settled()")
        source, self._source = self._source, None
        for bucket in source:
            self._seen.append(bucket)
            yield bucket[0], bucket[1]
        self._handle = BucketedWeights.of(self._seen)

    def settled(self) -> BucketedWeights:
        """Every bucket's handle, once they are all put (draining the stream if nobody has)."""
        if self._handle is None:
            for _ in self:
                pass
        assert self._handle is not None
        return self._handle


class StreamedWeights(Mapping):
    """The weights of a `BucketedWeights` as a read-only state dict: reading a name fetches its bucket with
    `get` (then kept among the last `keep` fetched), so a reader that takes the weights roughly in the
    order sent (an engine's `load_weights`, models/io.py's `load_one_by_one`) holds a few buckets at a
    time. Names and membership need no fetch."""

    def __init__(self, handle: BucketedWeights, get: Callable, keep: int = KEPT_BUCKETS):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._get, self.keep = get, keep
        self._refs = [ref for ref, _ in handle.buckets]
        self._where = {name: index for index, (_, names) in enumerate(handle.buckets) for name in names}
        self._names = tuple(self._where)  # what it holds (ArrivingWeights: before they arrive)
        self._known = frozenset(self._names)
        self._kept: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def _locate(self, name: str) -> int:
        return self._where[name]  # KeyError for a name not sent, as a dict's

    def __getitem__(self, name: str) -> torch.Tensor:
        index = self._locate(name)
        if index in self._kept:
            self._kept.move_to_end(index)
        else:
            self._kept[index] = unpacked(self._get(self._refs[index]))
            while len(self._kept) > self.keep:
                self._kept.popitem(last=False)
        return self._kept[index][name]

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class SyncAbandoned(RuntimeError):
    """The sender of a pipelined sync failed before every bucket arrived."""


class ArrivingWeights(StreamedWeights):
    """`StreamedWeights` over buckets that arrive while the engine reads (`arrive`, from another thread):
    the names are known from the start (the engine's own), and reading one that has not arrived yet waits
    for it. `end(count)` says how many buckets were sent (a name still missing then is a KeyError); `end()`
    without a count: the sender failed (`SyncAbandoned`)."""

    def __init__(self, names: Iterable[str], get: Callable, keep: int = KEPT_BUCKETS):
        super().__init__(BucketedWeights((), 0), get, keep)
        self._names = tuple(names)  # the engine's own: every sync sends them
        self._known = frozenset(self._names)
        self._sent: int | None = None  # buckets sent in all, once the sender has said
        self._abandoned = False
        self._arrived = threading.Condition()

    def arrive(self, ref: object, names: tuple[str, ...]) -> None:
        with self._arrived:
            self._refs.append(ref)
            self._where.update((name, len(self._refs) - 1) for name in names)
            self._arrived.notify_all()

    def end(self, count: int | None = None) -> None:
        with self._arrived:
            self._sent, self._abandoned = count, count is None
            self._arrived.notify_all()

    def complete(self) -> bool:
        return self._sent is not None and len(self._refs) >= self._sent

    def wait_complete(self) -> None:
        """Until every bucket sent has arrived (so none arrives after the sync is put away)."""
        with self._arrived:
            self._arrived.wait_for(lambda: self._abandoned or self.complete())

    def _locate(self, name: str) -> int:
        with self._arrived:
            self._arrived.wait_for(lambda: name in self._where or self._abandoned or self.complete())
            if name in self._where:
                return self._where[name]
            if self._abandoned:
                raise SyncAbandoned("the weight sync was abandoned: its sender failed before sending " + name)
            raise KeyError(f"weight {name!r} was not sent (every bucket of the sync has arrived)")


def names_of(handle: BucketedWeights) -> list[str]:
    """Every name a handle's buckets hold, in the order sent."""
    return [name for _, names in handle.buckets for name in names]


def readable(weights, get: Callable) -> Mapping[str, torch.Tensor]:
    """`weights` as a state dict to read: a `BucketedWeights` streamed, a state dict as it is."""
    return StreamedWeights(weights, get) if isinstance(weights, BucketedWeights) else weights
