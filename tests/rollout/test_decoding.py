"""How the native engine decodes is decided in one place (choices.decoding), and the config's check, the
factory, the engine and `RolloutConfig.sleeps` all ask it."""

from __future__ import annotations

import pytest
import torch

from everyprompt.choices import Decoding, decoding
from everyprompt.config import RolloutConfig
from everyprompt.devices.fake_cuda import fake_cuda
from everyprompt.rollout import UnsupportedModelError, make_engine
from tests.conftest import make_tiny_model

G, S, C, E = Decoding.GRAPHS, Decoding.STATIC, Decoding.COMPILED, Decoding.EAGER


@pytest.mark.parametrize(
    "compile,graphs,device,expected",
    [
        ("auto", "auto", "cuda", G),
        ("off", "auto", "cuda", G),
        ("on", "auto", "cuda", C),  # compile on turns auto's graphs off
        ("auto", "on", "cuda", G),
        ("auto", "off", "cuda", E),
        ("on", "off", "cuda", C),
        ("auto", "auto", "cpu", E),
        ("on", "auto", "cpu", C),
        ("off", "static", "cpu", S),
        ("auto", "static", "cuda", S),
    ],
)
def test_the_decision_table(compile, graphs, device, expected):
    assert decoding(compile, graphs, device) is expected
    assert expected.static == (expected in (G, S))


@pytest.mark.parametrize(
    "compile,graphs,device,message",
    [
        ("auto", "on", "cpu", "rollout.cuda_graphs=on needs a CUDA device; rollout.device is cpu"),
        ("on", "on", "cuda", "rollout.cuda_graphs=on and rollout.compile=on"),
        ("on", "static", "cpu", "rollout.cuda_graphs=static and rollout.compile=on"),
        (
            "auto",
            "sometimes",
            "cuda",
            "rollout.cuda_graphs must be one of auto, on, off, static, got 'sometimes'",
        ),
        ("always", "auto", "cuda", "rollout.compile must be one of auto, on, off, got 'always'"),
    ],
)
def test_conflicting_or_unknown_settings_are_refused_by_key(compile, graphs, device, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        decoding(compile, graphs, device)


def test_the_engine_sleeps_unless_it_keeps_graphs():
    cuda = torch.device("cuda:0")
    assert not RolloutConfig().sleeps(cuda)  # graphs: sleeping would drop them every step
    # compile on: no graphs, so nothing to keep awake for (it used to stay awake: cuda_graphs was not off)
    assert RolloutConfig(compile="on").sleeps(cuda)
    assert RolloutConfig(cuda_graphs="static").sleeps(cuda) and RolloutConfig().sleeps(torch.device("cpu"))
    assert not RolloutConfig(compile="on", sleep_while_training=False).sleeps(cuda)


def test_the_config_refuses_what_the_decision_refuses():
    with pytest.raises(ValueError, match="rollout.cuda_graphs=on needs a CUDA device; rollout.device is cpu"):
        RolloutConfig(cuda_graphs="on", device="cpu")
    with pytest.raises(ValueError, match="rollout.cuda_graphs=static and rollout.compile=on"):
        RolloutConfig(cuda_graphs="static", compile="on")
    assert RolloutConfig(cuda_graphs="static", device="cpu").decoding() is S


def test_the_engine_decodes_as_its_config_says():
    model, tokenizer = make_tiny_model()
    for config in (RolloutConfig(device="cpu"), RolloutConfig(device="cpu", cuda_graphs="static")):
        engine = make_engine(
            "native", model, tokenizer, 4, compile=config.compile, cuda_graphs=config.cuda_graphs
        )
        assert engine.decoding is config.decoding() and engine.static == config.decoding().static
    with fake_cuda():
        engine = make_engine("native", model, tokenizer, 4, device="cuda:0", compile="on")
        assert engine.decoding is C and not engine.static and not engine.graphs.capture
        engine = make_engine("native", model, tokenizer, 4, device="cuda:0")
        assert engine.decoding is G and engine.static  # no real CUDA: the static step runs eagerly
    with pytest.raises(UnsupportedModelError, match=r"cuda_graphs=static .* the hf engine has none"):
        make_engine("hf", model, tokenizer, 4, cuda_graphs="static")
    with pytest.raises(UnsupportedModelError, match=r"needs a CUDA device.*\(the engine runs on cpu\)"):
        make_engine("native", model, tokenizer, 4, cuda_graphs="on")
