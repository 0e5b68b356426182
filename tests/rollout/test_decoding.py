"""How the native engine decodes is decided in one place (choices.decoding), and the config's check, the
factory, the engine and `RolloutConfig.sleeps` all ask it."""

from __future__ import annotations

import pytest
import torch

from everyprompt.choices import decoding
from everyprompt.config import RolloutConfig
from everyprompt.devices.fake_cuda import fake_cuda
from everyprompt.rollout import UnsupportedModelError, make_engine
from tests.conftest import make_tiny_model


@pytest.mark.parametrize(
    "compile,graphs,device,expected",
    [
        ("auto", "auto", "cuda", "graphs"),
        ("off", "auto", "cuda", "graphs"),
        ("on", "auto", "cuda", "compiled graphs"),  # Inductor's kernels inside the graph
        ("on", "on", "cuda", "compiled graphs"),
        ("auto", "on", "cuda", "graphs"),
        ("auto", "off", "cuda", "eager, compile auto"),
        ("on", "off", "cuda", "compiled"),
        ("auto", "auto", "cpu", "eager, compile auto"),
        ("off", "auto", "cpu", "eager"),
        ("on", "auto", "cpu", "compiled"),
        ("off", "static", "cpu", "static"),
        ("auto", "static", "cuda", "static"),  # the static step never compiles mid-run
        ("on", "static", "cpu", "compiled static"),
    ],
)
def test_the_decision_table(compile, graphs, device, expected):
    chosen = decoding(compile, graphs, device)
    assert chosen.name == expected
    assert chosen.static == ("graphs" in expected or "static" in expected)
    assert chosen.graphs == ("graphs" in expected) and (chosen.compile == "on") == expected.startswith(
        "compiled"
    )


@pytest.mark.parametrize(
    "compile,graphs,device,message",
    [
        ("auto", "on", "cpu", "rollout.cuda_graphs=on needs a CUDA device; rollout.device is cpu"),
        (
            "auto",
            "sometimes",
            "cuda",
            "rollout.cuda_graphs must be one of auto, on, off, static, got 'sometimes'",
        ),
        ("always", "auto", "cuda", "rollout.compile must be one of auto, on, off, got 'always'"),
    ],
)
def test_unknown_or_impossible_settings_are_refused_by_key(compile, graphs, device, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        decoding(compile, graphs, device)


def test_the_engine_sleeps_unless_it_keeps_graphs():
    cuda = torch.device("cuda:0")
    assert not RolloutConfig().sleeps(cuda)  # graphs: sleeping would drop them every step
    # graphs off: nothing to keep awake for; compile on with graphs: compiled graphs, kept
    assert RolloutConfig(cuda_graphs="off").sleeps(cuda) and not RolloutConfig(compile="on").sleeps(cuda)
    assert RolloutConfig(cuda_graphs="static").sleeps(cuda) and RolloutConfig().sleeps(torch.device("cpu"))
    assert not RolloutConfig(cuda_graphs="off", sleep_while_training=False).sleeps(cuda)


def test_the_config_refuses_what_the_decision_refuses():
    with pytest.raises(ValueError, match="rollout.cuda_graphs=on needs a CUDA device; rollout.device is cpu"):
        RolloutConfig(cuda_graphs="on", device="cpu")
    assert RolloutConfig(cuda_graphs="static", device="cpu").decoding().name == "static"
    assert (
        RolloutConfig(cuda_graphs="static", compile="on", device="cpu").decoding().name == "compiled static"
    )


def test_the_engine_decodes_as_its_config_says():
    model, tokenizer = make_tiny_model()
    for config in (RolloutConfig(device="cpu"), RolloutConfig(device="cpu", cuda_graphs="static")):
        engine = make_engine(
            "native", model, tokenizer, 4, compile=config.compile, cuda_graphs=config.cuda_graphs
        )
        assert engine.decoding == config.decoding() and engine.static == config.decoding().static
    with fake_cuda():
        engine = make_engine("native", model, tokenizer, 4, device="cuda:0", compile="on")
        assert engine.decoding.name == "compiled graphs" and engine.static and not engine.graphs.capture
        engine = make_engine("native", model, tokenizer, 4, device="cuda:0")
        assert (
            engine.decoding.name == "graphs" and engine.static
        )  # no real CUDA: the static step runs eagerly
    with pytest.raises(UnsupportedModelError, match=r"cuda_graphs=static .* the hf engine has none"):
        make_engine("hf", model, tokenizer, 4, cuda_graphs="static")
    with pytest.raises(UnsupportedModelError, match=r"needs a CUDA device.*\(the engine runs on cpu\)"):
        make_engine("native", model, tokenizer, 4, cuda_graphs="on")
