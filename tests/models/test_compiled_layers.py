"""`model.kernels=compiled` (models/compiled_layers.py): each decoder layer through torch.compile, the same
log-probs and gradients as the eager layers, one graph for every packed width, and a compiler that fails
puts the layers back to eager with one warning instead of ending the run."""

from __future__ import annotations

import copy
import logging
import typing

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from everyprompt.cli import main
from everyprompt.config import ConfigError, load_config
from everyprompt.config.model import ModelConfig
from everyprompt.models import (
    compiled_layers,
    precision,  # noqa: F401  (registers every entry)
)
from everyprompt.models.compiled_layers import compile_layers, compiled_layer_count, compiled_parts
from everyprompt.models.kernels import KERNELS, KernelsError
from everyprompt.models.lora import apply_lora
from everyprompt.models.precision import training_kernels
from everyprompt.trainer import Learner
from everyprompt.trainer.learner_side.logprobs import token_logprobs
from tests.conftest import TINY_OVERRIDES, tiny_config
from tests.devices.test_learner_on_fake_cuda import _record_gradients
from tests.trainer.test_sides import _forced_routes, _model, hand_batch


def _llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_the_layer_kernels_the_config_accepts_are_the_registrys():
    assert set(typing.get_args(ModelConfig.model_fields["kernels"].annotation)) == set(KERNELS)


def test_a_layer_with_a_router_compiles_its_parts_without_one(tiny_model):
    model, _ = tiny_model
    layer = model.model.layers[0]
    parts = compiled_parts(layer)
    assert layer.mlp not in parts and layer.self_attn in parts  # the router's block stays eager
    assert set(parts) == {child for child in layer.children() if child is not layer.mlp}
    dense = _llama().model.layers[0]
    assert compiled_parts(dense) == [dense]


def test_a_model_without_decoder_layers_is_refused_naming_the_key():
    with pytest.raises(KernelsError, match=r"model\.kernels.*Sequential has none"):
        compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_compiled_layers_are_refused_with_fsdp2_naming_both_keys():
    with pytest.raises(ConfigError, match=r"model\.kernels=compiled.*cluster\.trainer_sharding=ddp"):
        load_config(None, ["model.kernels=compiled", "cluster.trainer_sharding=fsdp2"])


def test_a_failing_compiler_puts_every_layer_back_to_eager_with_one_warning(monkeypatch, caplog):
    calls = []

    def failing_compile(function, **kwargs):
        def compiled(*args, **kw):
            calls.append(function)
            raise torch._dynamo.exc.TorchDynamoException("the backend could not lower an operator")

        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    model, reference = _llama(), _llama()
    compile_layers(model)
    assert compiled_layer_count(model) == 2
    tokens = torch.randint(1, 64, (2, 9))
    with caplog.at_level(logging.WARNING, logger=compiled_layers.__name__):
        for _ in range(2):
            got, _ = token_logprobs(model, tokens, lengths=[9, 5])
            torch.testing.assert_close(got, token_logprobs(reference, tokens, lengths=[9, 5])[0])
    assert len(calls) == 1  # the first layer's first call; every layer eager from then on
    assert compiled_layer_count(model) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not lower" in warnings[0] and "compiled_layers 0" in warnings[0]


def test_an_error_after_compiled_calls_have_run_is_not_hidden(monkeypatch):
    """Once compiled calls return, an error that is not the compiler's (a shape bug, memory) is raised."""
    state = {"calls": 0}

    def flaky_compile(function, **kwargs):
        def compiled(*args, **kw):
            state["calls"] += 1
            if state["calls"] > 2:
                raise RuntimeError("out of memory")
            return function(*args, **kw)

        return compiled

    monkeypatch.setattr(torch, "compile", flaky_compile)
    model = _llama()
    compile_layers(model)
    tokens = torch.randint(1, 64, (1, 6))
    token_logprobs(model, tokens)  # two layers, two calls: proven
    with pytest.raises(RuntimeError, match="out of memory"):
        token_logprobs(model, tokens)
    assert compiled_layer_count(model) == 2


def test_compiled_kernels_without_a_working_compiler_exit_2_before_any_work(monkeypatch, tmp_path, capsys):
    def no_compiler(function, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return compiled

    monkeypatch.setattr(torch, "compile", no_compiler)
    run_dir = tmp_path / "run"
    assert main(["train", *TINY_OVERRIDES, "model.kernels=compiled", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "config key 'model.kernels'" in err and "C++ compiler" in err and "Traceback" not in err
    assert not run_dir.exists() or not any(run_dir.iterdir())


@pytest.mark.long  # 23 s on 2 cores: `make test-long`
def test_compiled_layers_take_every_packed_width_with_one_graph_and_equal_the_eager_ones():
    """A dense Llama's packed forwards at four widths: log-probs and gradients equal the eager layers', and
    the layers compile two graphs in all (dynamic shapes; both layers share each): one for rows of one
    sequence each (causal attention, no mask) and one for rows holding several (a mask); no width after
    its first of each kind compiles again."""
    model = _llama()
    reference = copy.deepcopy(model)
    compile_layers(model)
    generator = torch.Generator().manual_seed(1)
    graphs = []
    # rows of one sequence each, then rows holding two (17: 11 + 6; 21: 13 + 8), then each kind again
    for width, lengths in ((12, [12, 7, 9]), (17, [17, 3, 11, 6]), (9, [9, 9]), (21, [8, 13, 21, 5])):
        tokens = torch.randint(1, 64, (len(lengths), width), generator=generator)
        for m in (model, reference):
            m.zero_grad()
            logp, _ = token_logprobs(m, tokens, lengths=lengths)
            logp.sum().backward()
        torch.testing.assert_close(
            token_logprobs(model, tokens, lengths=lengths)[0],
            token_logprobs(reference, tokens, lengths=lengths)[0],
        )
        for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-6, rtol=1e-5, msg=name)
        graphs.append(_graphs())
    assert graphs == [graphs[0], graphs[0] + 1, graphs[0] + 1, graphs[0] + 1], graphs
    assert compiled_layer_count(model) == 2


@pytest.mark.long  # 90 s on 2 cores: `make test-long`
@pytest.mark.parametrize(
    "settings",
    [
        ("rl.router_replay=r3", "model.gradient_checkpointing=true"),
        # LoRA's adapters put in after the layers are compiled (as a run does), and the KL reference the
        # policy's own base with its adapters off: a second graph of the same layers
        ("model.lora.enabled=true", "model.lora.r=4", "rl.kl.estimator=k3", "rl.kl.coef=0.01"),
    ],
    ids=["replay-checkpointing", "lora-kl"],
)
def test_an_update_with_compiled_layers_equals_the_eager_one(settings, caplog):
    """The tiny MoE policy (its layers' attention and norms compiled, the routed block eager) through
    `training_kernels` as a run gets it: every optimizer step's gradients equal the eager policy's, and
    the metrics say how many parts ran compiled."""
    base = ("rl.old_logprobs=recompute", "rl.lr=1e-2", *settings)
    compiled_config = tiny_config(*base, "model.kernels=compiled")
    eager_config = tiny_config(*base)
    model, tokenizer = _model(eager_config)
    reference = copy.deepcopy(model)
    training_kernels(model, compiled_config.model)
    training_kernels(reference, eager_config.model)
    if eager_config.model.lora.enabled:  # the same random adapters on both
        torch.manual_seed(0)
        model = apply_lora(model, compiled_config.model.lora)
        torch.manual_seed(0)
        reference = apply_lora(reference, eager_config.model.lora)
    learners = [Learner(compiled_config, model, tokenizer.pad_token_id)]
    learners.append(Learner(eager_config, reference, tokenizer.pad_token_id))
    seen = [_record_gradients(learner) for learner in learners]
    for _ in range(2):
        batch = hand_batch(reference, tokenizer, [1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
        if eager_config.rl.router_replay == "r3":
            batch.routed_experts = _forced_routes(batch, model.config.num_hidden_layers)
        metrics = [learner.update(copy.deepcopy(batch)) for learner in learners]
        assert metrics[0]["loss/policy"] == pytest.approx(metrics[1]["loss/policy"], rel=1e-5, abs=1e-7)
    assert len(seen[0]) == len(seen[1]) >= 2  # each update one optimizer step a mini-batch
    for mine, theirs in zip(*seen):
        for name, value in theirs.items():
            torch.testing.assert_close(mine[name], value, atol=1e-6, rtol=1e-4, msg=name)
    layers = model.config.num_hidden_layers
    assert metrics[0]["actor/compiled_layers"] == 3 * layers  # attention and two norms a layer
    # no part ran eagerly for want of graphs (torch's default limit, 8, was reached in this test's passes)
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()], caplog.text
    assert "actor/compiled_layers" not in metrics[1]


def test_a_copy_of_a_compiled_model_computes_with_its_own_weights(monkeypatch):
    """The KL reference is a deep copy of the policy: it must run on its own (frozen) weights, not call the
    policy's compiled layers (whose weights move with every update)."""
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: function)  # a pass-through "graph"
    policy = _llama()
    compile_layers(policy)
    reference = copy.deepcopy(policy)
    tokens = torch.randint(1, 64, (2, 7))
    before = token_logprobs(reference, tokens)[0]
    with torch.no_grad():
        for param in policy.parameters():
            param.mul_(1.5)  # an update of the policy alone
    torch.testing.assert_close(token_logprobs(reference, tokens)[0], before)
    assert compiled_layer_count(reference) is None and compiled_layer_count(policy) == 2
    assert all(layer._compiled_call_impl is None for layer in reference.model.layers)
