"""The native engine's KV cache: per layer, one tensor [slots, heads, width, dim] per entry of the
attention's `cache_layout` (keys and values; latent attention: one latent vector), on the engine's device.
Storage is kept between generate calls and grown as calls need; a call gets views of it."""

from __future__ import annotations

import torch

# the static step's cache width grows in steps of this many positions: calls whose prompts differ a little in
# length share one storage (and its graphs), at the price of attending over up to this many masked positions
WIDTH_STEP = 128


class KVCache:
    """Cache storage for `layers` decoder layers of an attention variant (`layout`: its `cache_layout`)."""

    def __init__(self, layout: list[tuple[int, int]], layers: int, dtype: torch.dtype, device: torch.device):
        self.layout, self.layers, self.dtype, self.device = layout, layers, dtype, device
        self._storage: list[tuple[torch.Tensor, ...]] = []

    def allocate(self, rows: int, columns: int) -> list[tuple[torch.Tensor, ...]]:
        return [
            tuple(
                torch.zeros(rows, heads, columns, dim, dtype=self.dtype, device=self.device)
                for heads, dim in self.layout
            )
            for _ in range(self.layers)
        ]

    def views(
        self, slots: int, width: int, shared: bool = True, exact: bool = False
    ) -> list[tuple[torch.Tensor, ...]]:
        """Per-layer cache views of `slots` rows and `width` positions (`shared=False`: storage of its
        own, for a call made while another call's iterator is still open; `exact`: storage exactly
        `width` wide, so the views are contiguous)."""
        if not shared:
            return self.allocate(slots, width)
        have = self._storage[0][0] if self._storage else None
        if (
            have is None
            or have.dtype != self.dtype
            or have.shape[0] < slots
            or have.shape[2] < width
            or (exact and have.shape[2] != width)
        ):
            rows, columns = (
                (slots, width)
                if have is None or exact
                else (max(slots, have.shape[0]), max(width, have.shape[2]))
            )
            self._storage = self.allocate(rows, columns)
        return [tuple(t[:slots, :, :width] for t in entry) for entry in self._storage]

    def whole(self, rows: int, width: int) -> list[tuple[torch.Tensor, ...]]:
        """The whole storage, at least `rows` rows and `width` positions (grown to a multiple of
        `WIDTH_STEP` positions when it must grow): the static step's cache, which keeps its address from
        call to call while calls fit it (a graph captured over it stays valid)."""
        have = self._storage[0][0] if self._storage else None
        if have is None or have.dtype != self.dtype or have.shape[0] < rows or have.shape[2] < width:
            columns = -(-width // WIDTH_STEP) * WIDTH_STEP
            if have is not None:
                rows, columns = max(rows, have.shape[0]), max(columns, have.shape[2])
            self._storage = self.allocate(rows, columns)
        return self._storage

    def release(self) -> None:
        self._storage = []


def compact(caches: list[tuple[torch.Tensor, ...]], running: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Move cache rows `running` (a device index) to rows [0, n) and return views of those n rows."""
    n = len(running)
    out = []
    for entry in caches:
        for tensor in entry:
            tensor[:n] = tensor[running]
        out.append(tuple(tensor[:n] for tensor in entry))
    return out


def readable(
    caches: list[tuple[torch.Tensor, ...]], width: int, rows: int | None = None
) -> list[tuple[torch.Tensor, ...]]:
    """The first `width` positions (of the first `rows` rows) of every cache view: what an eager decode
    step reads."""
    return [tuple(entry[:rows, :, :width] for entry in layer) for layer in caches]


def copy_rows(caches: list[tuple[torch.Tensor, ...]], source: torch.Tensor, target: torch.Tensor, width: int):
    """Copy the first `width` positions of cache rows `source` into rows `target` (device indices)."""
    for entry in caches:
        for tensor in entry:
            tensor[target, :, :width] = tensor[source, :, :width]
