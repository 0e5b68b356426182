"""Where a forward's tokens go in the native engine's KV cache (`Site`): the cache rows of the batch's rows,
each row's last position, the decode step's attention bias, and an extend's layout (`Extend`: an
environment's observation written after a row's cached tokens, extend.py). The engine's forward hands it
to every layer's attention (attention.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class Site(NamedTuple):
    """A prefill (`bias` and `extend` None: the tokens are the whole sequence), an extend (`extend`), or a
    decode step (`bias`: one token a row, attending over the cache's width)."""

    rows: torch.Tensor  # [B] the cache rows of the forward's rows
    positions: torch.Tensor  # [B] the forward's last position in each row (a decode step: its one token's)
    bias: torch.Tensor | None  # the decode step's additive attention bias, by row's length (attention.py)
    extend: Extend | None = None


@dataclass(frozen=True)
class Extend:
    """One row's extend forward: T new tokens at positions [start, start + T) of cache row `slot`, query t
    seeing the row's positions up to start + t (`mask` [T, start + T], True where visible)."""

    slot: int
    start: int
    mask: torch.Tensor

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def write(self, cache: torch.Tensor, values: torch.Tensor) -> None:
        """The new tokens' `values` [1, T, ...] into the row of a layer's `cache` [rows, heads, positions, dim]."""
        length = values.shape[1]
        per_head = values[0].reshape(length, cache.shape[1], cache.shape[3]).transpose(0, 1)
        cache[self.slot, :, self.start : self.start + length] = per_head

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """The row's positions up to the last new token's, [1, heads, width, dim] (a view)."""
        return cache[self.slot : self.slot + 1, :, : self.width]
