"""How a CUDA graph's first replay is judged against the eager step (trust.py), checked by hand and, with the
capture machinery stood in for on the CPU, through the real `StepGraphs._capture` of a bf16 and an fp32
engine: a replay one bf16 unit off (what cuBLAS choosing another kernel inside a capture does; the H200's
RL step refused its graphs for 0.25 on a logit between 32 and 64) is trusted at bf16, refused at fp32; a
replay that writes another row's logits is refused at either."""

from __future__ import annotations

import logging

import pytest
import torch

from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.graphs import StepGraphs
from everyprompt.rollout.native.trust import FLOOR, UNITS, Output, judge
from tests.conftest import make_tiny_model
from tests.rollout.capture_stand_in import stand_in_capture

BF16_EPS = 2.0**-7  # torch.finfo(torch.bfloat16).eps


# ------------------------------------------------------------------ the rule, by hand
def test_one_bf16_unit_on_a_logit_near_40_is_trusted_at_bf16_and_refused_at_fp32():
    expected = torch.tensor([[40.0, 10.0, -3.0], [2.0, -0.5, 0.25]])
    got = expected.clone()
    got[0, 0] = 40.25  # one bf16 unit in [32, 64)
    why, eps = judge(0, got, expected, Output(got, torch.bfloat16))
    # the row's scale is 40: 0.25 / 40 / 2^-7 = 0.8 epsilons, under the 4 allowed (1.25)
    assert why is None and eps == pytest.approx(0.25 / 40 / BF16_EPS)
    why, _ = judge(0, got, expected, Output(got, torch.float32))
    assert why == (
        "output 0 (float32, [2, 3]): largest difference 0.25 where 0.04 was allowed "
        "(float32: 0.1% of the row's largest magnitude)"
    )


def test_the_bound_is_per_row_and_never_under_one():
    expected = torch.tensor([[40.0, 10.0], [0.5, 0.25]])
    bound_big, bound_small = UNITS * BF16_EPS * 40, UNITS * BF16_EPS * 1.0  # 1.25 and 0.03125
    inside = expected + torch.tensor([[bound_big * 0.99, 0.0], [0.0, bound_small * 0.99]])
    assert judge(0, inside, expected, Output(inside, torch.bfloat16))[0] is None
    # the same 1.2 that row 0 may differ by is far too much for row 1, whose scale is 1 (0.5 clamped up)
    outside = expected + torch.tensor([[0.0, 0.0], [1.2, 0.0]])
    why, eps = judge(0, outside, expected, Output(outside, torch.bfloat16))
    assert why is not None and "largest difference 1.2 where 0.0312 was allowed" in why
    assert eps == pytest.approx(1.2 / 1.0 / BF16_EPS)
    # fp32's floor: 1e-3 of the scale, not 4 float32 epsilons (5e-7)
    assert judge(0, expected + 0.9e-3, expected, Output(expected, torch.float32))[0] is None
    assert judge(0, expected + 1.1e-3 * 40, expected, Output(expected, torch.float32))[0] is not None
    assert FLOOR == 1e-3


def test_a_vectors_values_are_each_their_own_row():
    expected = torch.tensor([-2.0, -100.0])  # log-probs: the second's scale is 100, the first's 2
    got = torch.tensor([-2.0 - 1.9e-3, -100.09])
    assert judge(0, got, expected, Output(got))[0] is None
    assert judge(0, torch.tensor([-2.0 - 2.1e-3, -100.0]), expected, Output(got))[0] is not None


def test_integers_are_equal_save_a_bounded_share_of_flips():
    expected = torch.arange(100, dtype=torch.int16)
    got = expected.clone()
    got[:2] = 7
    assert judge(0, got, expected, Output(got))[0] == "output 0 (int16, [100]): 2 of 100 values differ"
    assert judge(0, got, expected, Output(got, flips=0.02))[0] is None
    got[2] = 9
    assert judge(0, got, expected, Output(got, flips=0.02))[0] == (
        "output 0 (int16, [100]): 3 of 100 values differ (at most 2 may)"
    )


def test_nan_infinities_and_shapes():
    expected = torch.tensor([1.0, float("-inf"), float("nan")])
    assert judge(0, expected.clone(), expected, Output(expected))[0] is None  # -inf == -inf, NaN == NaN
    why = judge(0, torch.tensor([1.0, float("-inf"), 2.0]), expected, Output(expected))[0]
    assert why is not None and "NaN where the eager step has a number" in why
    assert judge(0, torch.tensor([1.0, 0.0, float("nan")]), expected, Output(expected))[0] is not None
    assert "shape differs" in judge(0, torch.zeros(2), expected, Output(expected))[0]


# ------------------------------------------------------------------ through the capture, stood in for
@pytest.fixture(scope="module")
def tiny():  # made before any test patches torch.cuda (transformers reads it as it imports)
    return make_tiny_model()


@pytest.fixture
def replaying(monkeypatch):
    """The real `StepGraphs._capture` over a stand-in CUDA graph: the body runs at the warm-up and inside
    the 'capture' (eagerly); the graph keeps that body and replays it, then applies `state["replay"]` to
    the forward phase's logits (what a graph of other kernels would write)."""
    state: dict = {"replay": None, "capturing": None}
    original = StepGraphs._capture

    def capture(self, phase, size, body, outputs):
        state["capturing"] = (phase, size, body, outputs)
        return original(self, phase, size, body, outputs)

    class Graph:
        def __init__(self):
            self.phase, self.size, self.body, self.outputs = state["capturing"]

        def replay(self):
            self.body(self.size)
            if self.phase == "forward" and state["replay"] is not None:
                state["replay"](self.outputs(self.size)[0].tensor)

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    stand_in_capture(monkeypatch, Graph)
    return state


def one_bf16_unit_off(logits: torch.Tensor) -> None:
    """Each row's largest logit moved by one bf16 unit of its magnitude."""
    top = logits.abs().argmax(dim=-1, keepdim=True)
    value = logits.gather(-1, top)
    unit = 2.0 ** torch.floor(torch.log2(value.abs().clamp(min=2.0**-126))) * BF16_EPS
    logits.scatter_(-1, top, value + unit)


def rows_swapped(logits: torch.Tensor) -> None:
    """Row 0 given row 1's logits (a graph that read another row's state)."""
    logits[0] = logits[1]


@pytest.mark.parametrize(
    "precision,replay,trusted",
    [("bf16", one_bf16_unit_off, True), ("fp32", one_bf16_unit_off, False), ("bf16", rows_swapped, False)],
    ids=["bf16-one-unit", "fp32-one-bf16-unit", "bf16-rows-swapped"],
)
def test_an_engines_graphs_are_trusted_at_its_own_precision(
    tiny, replaying, caplog, precision, replay, trusted
):
    model, tokenizer = tiny
    engine = NativeEngine.from_model(model, tokenizer, 4, precision, cuda_graphs="static")
    engine.graphs.capture = True  # as on a GPU
    replaying["replay"] = replay
    requests = [
        GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(["1+2=", "37+48="])
    ]
    with caplog.at_level(logging.WARNING, logger="everyprompt.rollout.native.graphs"):
        list(engine.generate(requests, SamplingParams(6)))
    stats = engine.stats
    if trusted:
        assert engine.graphs.failure is None and stats["graph_failed"] == 0.0
        assert stats["graph_captures"] > 0 and stats["graph_replays"] > 0
        # the forward graphs' first replays were up to one unit off: reported, in bf16 epsilons of the scale
        assert 0.4 < stats["graph_replay_eps"] <= 1.0
    else:
        assert stats["graph_failed"] == 1.0 and stats["graph_eager_steps"] > 0
        assert "first replay wrote other values" in engine.graphs.failure
        assert "output 0 (float32" in engine.graphs.failure and "was allowed" in caplog.text
