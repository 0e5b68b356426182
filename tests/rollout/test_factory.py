"""The engine registry: `build_engine` is the one way to an engine, and a model it cannot run is refused
when the model is loaded, by name."""

from __future__ import annotations

import pytest
import torch

from everyprompt.cli import main
from everyprompt.config import ConfigError, RolloutConfig
from everyprompt.rollout import (
    GenerationRequest,
    SamplingParams,
    UnsupportedModelError,
    build_engine,
    engines_for,
    register_engine,
    registered_engines,
    resolve_engine,
)
from everyprompt.rollout.native import NativeEngine
from tests.conftest import TINY_OVERRIDES, tiny_config


def test_build_engine_makes_the_configured_engine(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(RolloutConfig(batch_size=3, precision="bf16"), model, tokenizer)
    assert isinstance(engine, NativeEngine) and engine.batch_size == 3 and engine.precision == "bf16"
    assert engine.can_record_routes and engine.stats == {}
    assert registered_engines() == ["hf", "native"] and engines_for(model.config) == ["native", "hf"]


def test_an_unknown_engine_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout.engine.*expected one of auto, hf, native.*got 'vllm'"):
        tiny_config("rollout.engine=vllm")


def test_an_engine_name_registers_once():
    for taken in ("native", "auto"):
        with pytest.raises(ValueError, match="already registered"):
            register_engine(taken)(object)


def test_a_model_the_engine_cannot_run_is_named_with_the_engines_that_could(tiny_model):
    model, tokenizer = tiny_model
    model.config.model_type = "gpt2"
    with pytest.raises(
        UnsupportedModelError,
        match=r"rollout.engine=native cannot run this gpt2 model: .*not 'gpt2'; set rollout.engine=hf \(or auto\)",
    ):
        resolve_engine("native", model.config)
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        build_engine(RolloutConfig(engine="native"), model, tokenizer)
    assert resolve_engine("auto", model.config) == "hf"


def test_train_refuses_an_unsupported_model_before_any_sft_step(tmp_path, tiny_model, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tokenizer = tiny_model
    checkpoint = tmp_path / "gpt2"
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, **ids)
    ).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    capsys.readouterr()
    run = tmp_path / "run"
    code = main(
        ["train", *TINY_OVERRIDES, f"model.path={checkpoint}", "rollout.engine=native", "--run-dir", str(run)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert "rollout.engine=native cannot run this gpt2 model" in err[0]
    assert not (run / "sft").exists() and not (run / "checkpoints").exists()  # refused before SFT


@pytest.mark.parametrize("name", ["native", "hf"])
def test_rollout_device_places_each_engine(name):
    from everyprompt.devices.fake_cuda import fake_cuda
    from everyprompt.models.experts import use_sorted_experts
    from tests.conftest import make_tiny_model

    model, tokenizer = make_tiny_model()
    use_sorted_experts(model)
    with fake_cuda(), pytest.MonkeyPatch.context() as patch:
        # resolve_device asks torch whether CUDA is there; the fake device answers for the call
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "device_count", lambda: 1)
        engine = build_engine(RolloutConfig(engine=name, device="cuda:0"), model, tokenizer)
        patch.undo()
        assert engine.device == torch.device("cuda", 0)
        completion = next(iter(engine.generate([GenerationRequest(0, [5, 6, 7])], SamplingParams(3))))
    assert len(completion.token_ids) == 3


def test_an_engine_that_does_not_place_itself_refuses_another_device(tiny_model, monkeypatch):
    from everyprompt.rollout import registry

    model, tokenizer = tiny_model

    class HostOnly:
        @classmethod
        def from_model(cls, *args, **kwargs):
            return cls()

    monkeypatch.setitem(registry._ENGINES, "host_only", registry.EngineSpec(HostOnly, (), 100))
    assert isinstance(registry.make_engine("host_only", model, tokenizer, 2), HostOnly)
    with pytest.raises(
        UnsupportedModelError, match=r"rollout.device=cuda:0: the host_only engine runs on the CPU only"
    ):
        registry.make_engine("host_only", model, tokenizer, 2, device="cuda:0")
