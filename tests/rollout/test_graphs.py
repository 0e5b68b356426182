"""The static step's CUDA graphs (graphs.py), checked on the CPU: replaying the closure a "graph" captured
(Python values frozen at capture, as a real graph freezes them) gives the same completions across calls and
weight loads, which keep every weight's address; bad settings are refused by name; a failed capture is
reported once and the step runs eagerly; a replay that disagrees is not trusted (trust.py's rule by hand:
test_trust.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from everyprompt.choices import check_buckets
from everyprompt.models.lora import merged_state_dict
from everyprompt.rollout import SamplingParams, UnsupportedModelError, make_engine
from everyprompt.rollout.native.graphs import StepGraphs
from everyprompt.rollout.native.trust import Output
from tests.conftest import make_tiny_model
from tests.rollout.capture_stand_in import stand_in_capture
from tests.rollout.test_static import _assert_same, _by_id, _engine, _requests


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


# ------------------------------------------------------------------ graphs: frozen closures, weight loads
class ReplayedClosure:
    """A stand-in for a CUDA graph: it keeps the body and size it was captured with and replays exactly
    those (a real graph freezes every Python value the body computed at capture)."""

    def __init__(self, body, size):
        self.body, self.size = body, size

    def replay(self):
        self.body(self.size)


@pytest.fixture
def replayed(monkeypatch):
    captured: list[tuple[str, int]] = []

    def capture(self, phase, size, body, outputs):
        body(size)  # the warm-up (its outputs are this step's, as the real capture's first replay writes)
        captured.append((phase, size))
        self._call["captures"] += 1
        return ReplayedClosure(body, size)

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    return captured


def test_replayed_captures_give_the_plain_engines_completions_across_calls_and_weight_loads(tiny, replayed):
    model, tokenizer = tiny
    params = SamplingParams(16, record_routes=True)
    expected = _by_id(_engine(model, tokenizer, "off").generate(_requests(tokenizer), params))
    engine = _engine(model, tokenizer, "static")
    engine.graphs.capture = True  # as on a GPU
    _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
    first = list(replayed)
    assert engine.stats["graph_replays"] > 0 and engine.stats["graph_captures"] == len(first)
    assert {size for _, size in first} <= {1, 2, 4} and {phase for phase, _ in first} == {"sample", "forward"}
    _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
    assert engine.stats["graph_captures"] == 0  # kept across calls

    # a weight sync copies into the held storage: the graphs stay valid and see the new weights
    other, _ = make_tiny_model()
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1.5)
    engine.load_weights(merged_state_dict(other))
    expected_other = _by_id(_engine(other, tokenizer, "off").generate(_requests(tokenizer), params))
    _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected_other)
    assert engine.stats["graph_captures"] == 0

    engine.sleep()  # drops the storage: the graphs go with it and are captured again
    engine.load_weights(merged_state_dict(model))
    _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
    assert engine.stats["graph_captures"] > 0


def _weights(engine) -> list[torch.Tensor]:
    from everyprompt.rollout.native.weights import _pair  # the walk copy_into makes

    pairs: list = []
    held = (engine.embed, engine.final_norm, engine.lm_head, engine.layers)
    assert _pair(held, held, pairs)
    return [tensor for tensor, _ in pairs]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_load_weights_keeps_every_weights_storage_and_takes_the_new_values(tiny, precision):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer, "static", precision=precision)
    list(engine.generate(_requests(tokenizer), SamplingParams(4)))  # fp8: the decode layers are made
    before = [t.data_ptr() for t in _weights(engine)]
    decode_before = engine._decode_layers
    other, _ = make_tiny_model()
    with torch.no_grad():
        other.model.embed_tokens.weight.add_(1.0)
    engine.load_weights(merged_state_dict(other))
    assert [t.data_ptr() for t in _weights(engine)] == before and len(before) > 10
    assert engine._decode_layers is decode_before
    expected = other.model.embed_tokens.weight.to(engine.dtype)
    torch.testing.assert_close(engine.embed, expected, atol=0, rtol=0)


def test_a_weight_load_reads_and_copies_one_layer_at_a_time(tiny, monkeypatch):
    """In place, each layer's new tensors are read and copied before the next is read: a sync needs one
    layer beside the held weights, not a second copy of every layer (a 30B model's engine would need
    61 GB more in bf16). Where a layer's shapes differ, every weight is replaced and takes the new values."""
    from everyprompt.rollout.native import engine as engine_module

    model, tokenizer = tiny
    engine = _engine(model, tokenizer, "static", precision="bf16")
    events: list[str] = []
    read, copy = engine_module.read_layer, engine_module.copy_into

    def reading(weights, family, attention, index):
        events.append(f"read {index}")
        return read(weights, family, attention, index)

    def copying(held, new):
        events.append("copy")
        return copy(held, new)

    monkeypatch.setattr(engine_module, "read_layer", reading)
    monkeypatch.setattr(engine_module, "copy_into", copying)
    engine.load_weights(merged_state_dict(model))
    layers = model.config.num_hidden_layers
    assert events == ["copy"] + [e for i in range(layers) for e in (f"read {i}", "copy")]  # ends, then layers
    events.clear()
    bigger = dict(merged_state_dict(model))
    name = "model.layers.1.post_attention_layernorm.weight"  # the last layer's shape differs: replaced
    bigger[name] = torch.cat([bigger[name], bigger[name]])
    before = engine.embed.data_ptr()
    engine.load_weights(bigger)
    assert events[-1] == f"read {layers - 1}" and engine.embed.data_ptr() != before
    assert engine.layers[1].post_norm.shape[0] == 2 * model.config.hidden_size


# ------------------------------------------------------------------ bad settings, failed captures
def test_buckets_must_be_increasing_positive_integers():
    assert check_buckets([1, 2, 8]) == (1, 2, 8)
    for bad in ([], [0, 2], [4, 2], [2, 2], [1.5], [True]):
        with pytest.raises(ValueError, match="expected"):
            check_buckets(bad)
    assert [StepGraphs((1, 2, 4, 8)).padded(n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 9]


def test_engine_settings_are_refused_by_name(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=r"graph_buckets \[4, 2\]: expected increasing"):
        _engine(model, tokenizer, "static", graph_buckets=[4, 2])
    with pytest.raises(ValueError, match="rollout.cuda_graphs must be one of auto, on, off, static"):
        _engine(model, tokenizer, "always")
    with pytest.raises(
        ValueError, match=r"cuda_graphs=on needs a CUDA device; .* \(the engine's device: cpu\)"
    ):
        _engine(model, tokenizer, "on")
    with pytest.raises(UnsupportedModelError, match="rollout.cuda_graphs=on needs a CUDA device"):
        make_engine("native", model, tokenizer, 4, cuda_graphs="on")
    with pytest.raises(UnsupportedModelError, match="the hf engine has none"):
        make_engine("hf", model, tokenizer, 4, cuda_graphs="on")


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.graph_buckets=[4,2]", "rollout.graph_buckets': expected increasing batch sizes"),
        ("rollout.graph_buckets=[0,8]", "rollout.graph_buckets': expected a list of positive integers"),
        ("rollout.cuda_graphs=maybe", "rollout.cuda_graphs"),
    ],
)
def test_bad_graph_settings_exit_2_naming_the_key(override, message, capsys):
    from everyprompt.cli import main

    assert main(["train", "configs/demo.yaml", override]) == 2
    assert message in capsys.readouterr().err


def test_graphs_on_a_cpu_device_exit_2_naming_the_key(capsys):
    from everyprompt.cli import main

    assert main(["train", "configs/demo.yaml", "rollout.cuda_graphs=on", "rollout.device=cpu"]) == 2
    assert "rollout.cuda_graphs=on needs a CUDA device" in capsys.readouterr().err


def test_a_capture_that_fails_is_reported_once_and_the_step_runs_eagerly(tiny, caplog):
    """Capturing needs CUDA, which this machine lacks: the failure here is a real one."""
    model, tokenizer = tiny
    params = SamplingParams(12)
    expected = _by_id(_engine(model, tokenizer, "off").generate(_requests(tokenizer), params))
    engine = _engine(model, tokenizer, "static")
    engine.graphs.capture = True
    with caplog.at_level(logging.WARNING, logger="everyprompt.rollout.native.graphs"):
        _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
        _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
    warnings = [r.getMessage() for r in caplog.records if "capturing" in r.getMessage()]
    assert len(warnings) == 1 and "decoding without CUDA graphs" in warnings[0]
    assert engine.stats["graph_failed"] == 1.0 and engine.stats["graph_replays"] == 0
    assert engine.stats["graph_eager_steps"] > 0


def test_a_phase_is_captured_for_a_bounded_number_of_keys(replayed):
    from everyprompt.rollout.native.graphs import MAX_KEYS

    graphs = StepGraphs((1, 2, 4), capture=True)
    ran: list[int] = []
    for key in range(MAX_KEYS + 3):
        graphs.run("sample", key, 3, ran.append, lambda size: [])
        graphs.run("sample", key, 3, ran.append, lambda size: [])  # a replay for the captured keys
    assert graphs.graphs == MAX_KEYS and len(replayed) == MAX_KEYS
    # a capture is followed by its first replay (which runs the step); the keys past the bound run eagerly
    assert graphs.stats()["graph_replays"] == 2 * MAX_KEYS and graphs.stats()["graph_eager_steps"] == 6
    assert set(ran) == {4}  # every step ran its bucket's rows


def test_a_steps_metrics_add_up_its_calls_graph_figures(tiny, replayed):
    from everyprompt.trainer.rollout_side.tally import StepTally

    model, tokenizer = tiny
    engine = _engine(model, tokenizer, "static")
    engine.graphs.capture = True
    tally = StepTally()
    for _ in range(2):  # the first call captures, the second replays only
        list(engine.generate(_requests(tokenizer), SamplingParams(8)))
        tally.engine_calls.append(dict(engine.stats))
    metrics = tally.metrics()
    assert metrics["rollout/graph_captures"] == len(replayed) > 0
    assert metrics["rollout/graph_replays"] == sum(c["graph_replays"] for c in tally.engine_calls) > 0
    assert metrics["rollout/graph_capture_s"] == sum(c["graph_capture_s"] for c in tally.engine_calls)
    assert metrics["rollout/graph_eager_steps"] == 0 and metrics["rollout/graph_failed"] == 0
    # two calls whose capture had failed: the step says so (a flag, not a count), and adds up how many of
    # their decode steps ran eagerly
    failed = {**tally.engine_calls[-1], "graph_failed": 1.0, "graph_eager_steps": 5.0}
    tally.engine_calls += [failed, failed]
    metrics = tally.metrics()
    assert metrics["rollout/graph_failed"] == 1.0 and metrics["rollout/graph_eager_steps"] == 10.0
    plain, engine = StepTally(), _engine(model, tokenizer, "off")
    list(engine.generate(_requests(tokenizer), SamplingParams(8)))
    plain.engine_calls.append(dict(engine.stats))
    assert not any(key.startswith("rollout/graph") for key in plain.metrics())  # no static step, no figures


def test_a_graph_whose_first_replay_disagrees_with_the_eager_step_is_not_trusted(monkeypatch, caplog):
    """The capture machinery stood in for on the CPU: the body really runs (warm-up, then inside the
    'capture'), and the graph's replay writes a wrong token: the engine must not keep that graph."""
    out = torch.zeros(4, dtype=torch.long)

    class WrongGraph:
        def replay(self):
            out[0] += 1  # not what the step computes

    stand_in_capture(monkeypatch, WrongGraph)

    def body(size):
        out[:size] = torch.arange(size)

    graphs = StepGraphs((1, 2, 4), capture=True)
    with caplog.at_level(logging.WARNING, logger="everyprompt.rollout.native.graphs"):
        graphs.run("sample", "key", 3, body, lambda size: [Output(out[:size])])
    assert graphs.failure is not None and "first replay wrote other values" in graphs.failure
    assert "output 0 (int64, [4]): 1 of 4 values differ" in graphs.failure  # the bucket of 4 rows
    assert graphs.graphs == 0 and torch.equal(out, torch.arange(4))  # the step ran eagerly after all
    assert graphs.stats()["graph_eager_steps"] == 1 and "decoding without CUDA graphs" in caplog.text

    class QuietGraph:  # its replay leaves what the step wrote: it agrees
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", QuietGraph)
    trusted = StepGraphs((1, 2, 4), capture=True)
    trusted.run("sample", "key", 3, body, lambda size: [Output(out[:size])])
    assert trusted.failure is None and trusted.graphs == 1 and trusted.stats()["graph_captures"] == 1
