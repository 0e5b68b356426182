"""What the operations of one native `generate` call share (decode_loop.py makes it): the engine, the
call's decode layers, its cache views, its rows (rows.py), its record of routes, its requests and its
sampling settings. The admission, the step, the extend and the finish each take it, not its pieces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from everyprompt.rollout.base import GenerationRequest, SamplingParams
from everyprompt.rollout.native.rows import Record, Rows


@dataclass
class Call:
    engine: Any  # the NativeEngine, untyped: engine.py imports the loop, which imports this module
    layers: list  # the call's decode layers (fp8's dequantised)
    caches: list  # per layer, the call's cache views (replaced when the pool compacts)
    rows: Rows
    record: Record | None  # the routes and router logits recorded per fed position, when the call asks
    requests: list[GenerationRequest]
    params: SamplingParams
