"""LoRA through peft: only adapters train, the engine runs the merged weights, the KL reference is the
base with adapters off, checkpoints hold the adapter (and the merged model on request), resume is exact."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from everyprompt.models.io import ModelError, load_pretrained
from everyprompt.models.lora import apply_lora, merged_state_dict, plain_copy, reference_forward
from everyprompt.pipeline import train
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.trainer.learner_side.logprobs import token_logprobs
from tests.conftest import tiny_config
from tests.families import family_model, save_family_checkpoint

MOE_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
LORA = [
    "model.lora.enabled=true",
    "model.lora.r=4",
    f"model.lora.target_parameters={json.dumps(MOE_TARGETS)}",
    "rl.lr=1e-2",
    "rewards.function=tests.trainer.flaky_reward:scattered",  # every group has variance: every step updates
]


# adapters on attention, experts and router (a model.lora section's fields)
ADAPTERS = SimpleNamespace(
    r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "o_proj"], target_parameters=MOE_TARGETS
)


def adapted_policy(base_dtype: torch.dtype = torch.float32):
    """A Qwen3-MoE policy with `ADAPTERS`, their B nonzero (zero at init: something to merge), its base
    held in `base_dtype`; and its tokenizer."""
    model, tokenizer = family_model("qwen3_moe")
    policy = apply_lora(model, ADAPTERS, base_dtype)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    return policy, tokenizer


def test_merged_weights_equal_peft_merge_and_the_adapted_forward():
    policy, tokenizer = adapted_policy()
    merged = merged_state_dict(policy)
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()  # peft's own merge, in place
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[key], reference[key]) for key in reference)
    assert all(torch.equal(value, reference[key]) for key, value in plain_copy(policy).state_dict().items())
    ids = torch.tensor([tokenizer("12+34=").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(policy(ids).logits, plain_copy(policy)(ids).logits, atol=1e-5, rtol=0)
    # both engines build from the policy itself and decode the adapted network
    from everyprompt.rollout import make_engine

    request = [GenerationRequest(0, tokenizer("12+34=").input_ids, seed=3)]
    for engine in ("native", "hf"):
        [completion] = make_engine(engine, policy, tokenizer, 1).generate(request, SamplingParams(8))
        full = torch.tensor([completion.prompt_ids + completion.token_ids])
        with torch.no_grad():
            logp, _ = token_logprobs(policy, full)
        start = len(completion.prompt_ids) - 1
        torch.testing.assert_close(completion.logprobs, logp[0, start:], atol=1e-4, rtol=0, msg=engine)


def test_merged_weights_merge_each_weight_when_read(monkeypatch):
    """Nothing is merged until a weight is read, and reading one merges its own adapters only: a reader
    that takes the weights one at a time holds one merged copy at a time. Their size needs no merge;
    read later they are the policy's weights then (as a plain state dict's tensors are), and own_copy
    takes them now; pickled (Ray's object store) they are a plain dict of the same tensors."""
    import pickle

    from peft.tuners.lora import LoraLayer

    from everyprompt.models.lora import MergedWeights, weights_nbytes
    from everyprompt.trainer.asynchrony import own_copy

    policy, _ = adapted_policy()
    plain = plain_copy(policy).state_dict()
    merged = merged_state_dict(policy)
    assert isinstance(merged, MergedWeights)
    deltas: list[object] = []  # each adapter delta computed
    for module in policy.modules():
        if isinstance(module, LoraLayer):
            original = module.get_delta_weight
            monkeypatch.setattr(
                module, "get_delta_weight", lambda a, f=original, m=module: deltas.append(m) or f(a)
            )
    assert weights_nbytes(merged) == sum(t.numel() * t.element_size() for t in plain.values()) and not deltas
    key = "model.layers.0.self_attn.q_proj.weight"
    assert key in merged and "lm_head.bias" not in merged and not deltas  # asking merges nothing
    assert torch.equal(merged[key], plain[key]) and len(deltas) == 1
    assert torch.equal(merged["model.norm.weight"], plain["model.norm.weight"]) and len(deltas) == 1
    copied = own_copy(merged)
    assert isinstance(copied, dict) and copied.keys() == plain.keys()
    with torch.no_grad():  # the policy moves on: the copy does not, the mapping does
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.add_(1.0)
    assert torch.equal(copied[key], plain[key]) and not torch.equal(merged[key], plain[key])
    shipped = pickle.loads(pickle.dumps(merged))
    assert type(shipped) is dict and torch.equal(shipped[key], merged[key])


def _adapter(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"step_{step}" / "adapter_model.safetensors")


def test_only_adapters_train_and_the_engine_runs_the_merged_policy(tmp_path):
    trainer = train(
        tiny_config(
            *LORA,
            "sft.steps=0",
            "rl.steps=2",
            "rl.kl.estimator=k3",
            "model.lora.save_merged=true",
            "rl.router_replay=r3",
            "rl.old_logprobs=recompute",
            "model.gradient_checkpointing=true",
        ),
        run_dir=tmp_path,
    )
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(line["mismatch/routing_agreement"] == 1.0 for line in lines)  # r3 through the adapters
    policy = trainer.model
    base = load_pretrained(tmp_path / "checkpoints" / "step_2" / "merged")[0]  # saved merged model
    with pytest.raises(ModelError, match="save_merged"):  # the preset's adapter names no base on disk
        load_pretrained(tmp_path / "checkpoints" / "step_2")
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    assert any(float(p.detach().abs().max()) > 0 for n, p in trained.items() if "lora_B" in n)  # they moved
    # the base weights are the starting policy's, bit for bit (frozen, never merged in place)
    from everyprompt.models.io import load_model_and_tokenizer

    fresh, _ = load_model_and_tokenizer(trainer.config.model, trainer.config.seed)
    base_state = {k.replace(".base_layer", ""): v for k, v in policy.get_base_model().state_dict().items()}
    assert all(torch.equal(base_state[k].cpu(), v.cpu()) for k, v in fresh.state_dict().items())
    assert trainer.learner.reference is None and trainer.learner.forward.base_as_reference  # no second copy
    # the engine decodes with the merged weights: its log-probs are the adapted policy's
    tokenizer = trainer.tokenizer
    requests = [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(["1+2=", "34+5="])]
    for completion in trainer.engine.generate(requests, SamplingParams(8)):
        ids = torch.tensor([completion.prompt_ids + completion.token_ids])
        with torch.no_grad():
            logp, _ = token_logprobs(policy, ids)
        start_at = len(completion.prompt_ids) - 1
        torch.testing.assert_close(completion.logprobs, logp[0, start_at:], atol=1e-4, rtol=0)
        with torch.no_grad():
            merged_logp, _ = token_logprobs(base, ids)
            with reference_forward(policy):
                reference_logp, _ = token_logprobs(policy, ids)
            fresh_logp, _ = token_logprobs(fresh, ids)
        torch.testing.assert_close(merged_logp, logp, atol=1e-5, rtol=0)  # merged/ is the trained policy
        torch.testing.assert_close(reference_logp, fresh_logp, atol=1e-6, rtol=0)  # adapters off: the base
        assert float((reference_logp - logp).abs().max()) > 1e-4  # and the adapters did change it


def test_resume_with_lora_is_exact(tmp_path):
    settings = [*LORA, "sft.steps=0", "rl.steps=4"]
    train(tiny_config(*settings), run_dir=tmp_path / "straight")
    train(tiny_config(*LORA, "sft.steps=0", "rl.steps=2"), run_dir=tmp_path / "cut")
    train(tiny_config(*settings), run_dir=tmp_path / "cut", resume=True)
    straight, resumed = _adapter(tmp_path / "straight", 4), _adapter(tmp_path / "cut", 4)
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    lines = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss/policy"] for x in lines] == [x["loss/policy"] for x in again]


def test_an_adapter_checkpoint_loads_merged_for_evaluation(tmp_path):
    checkpoint = save_family_checkpoint("qwen3_moe", tmp_path / "base")
    trainer = train(
        tiny_config(
            *LORA, f"model.path={checkpoint}", "sft.steps=0", "rl.steps=1", "model.lora.save_merged=true"
        ),
        run_dir=tmp_path / "run",
    )
    step = tmp_path / "run" / "checkpoints" / "step_1"
    assert (step / "adapter_config.json").is_file() and not (step / "config.json").exists()
    from_adapter, _ = load_pretrained(step)  # base named in the adapter config + the adapter, merged
    from_merged, _ = load_pretrained(step / "merged")
    ids = torch.tensor([trainer.tokenizer("7+8=").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(from_adapter(ids).logits, from_merged(ids).logits, atol=1e-5, rtol=0)


def test_a_target_that_matches_nothing_is_a_clear_error(tmp_path, capsys):
    from everyprompt.cli import main
    from tests.conftest import TINY_OVERRIDES

    code = main(
        [
            "train",
            *TINY_OVERRIDES,
            "sft.steps=0",
            "model.lora.enabled=true",
            'model.lora.target_modules=["no_such_proj"]',
            "--run-dir",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in err[-1]
    assert "model.lora" in err[-1] and "no_such_proj" in err[-1]


@pytest.mark.parametrize("bad", ["model.lora.r=0", "model.lora.dropout=1.5"])
def test_bad_lora_settings_name_the_key(bad):
    from everyprompt.config import ConfigError

    with pytest.raises(ConfigError, match=f"config key '{bad.split('=')[0]}'"):
        tiny_config(bad)
