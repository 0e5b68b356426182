"""The startup parity check: engine and trainer score the same completions before the first RL step."""

from __future__ import annotations

import json

import pytest
import torch

from everyprompt.cli import main
from everyprompt.pipeline import train
from everyprompt.rollout.native import attention as native_attention
from tests.conftest import TINY_OVERRIDES, tiny_config


def test_the_gap_is_logged_with_the_first_step(tmp_path):
    train(tiny_config("rl.steps=2"), run_dir=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= lines[0]["parity/logp_abs_diff"] < 1e-5 and lines[0]["parity/tokens"] > 0
    assert lines[0]["parity/layers"] == 2  # the whole model
    assert "parity/logp_abs_diff" not in lines[1]


def test_a_wrong_fast_path_stops_the_run_naming_the_gap_and_the_engine(tmp_path, capsys, monkeypatch):
    tables = native_attention.rope_tables

    def wrong_rope(config, head_dim):  # a fast path that gets the rotary frequencies slightly wrong
        inv_freq, scale = tables(config, head_dim)
        return inv_freq * 1.5, scale

    monkeypatch.setattr(native_attention, "rope_tables", wrong_rope)
    code = main(["train", *TINY_OVERRIDES, "rollout.engine=native", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in err[-1]
    assert "the native engine's log-probs of this qwen3_moe model differ from the trainer's by" in err[-1]
    assert "rollout.engine=hf" in err[-1]
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before the first RL step
    capsys.readouterr()
    code = main(
        [
            "train",
            *TINY_OVERRIDES,
            "rollout.engine=native",
            "rollout.parity_threshold=0",
            "--run-dir",
            str(tmp_path / "unchecked"),
        ]
    )
    assert code == 0  # the check turned off: the run goes on, wrong as it is
    first = json.loads((tmp_path / "unchecked" / "metrics.jsonl").read_text().splitlines()[0])
    assert "parity/logp_abs_diff" not in first


def test_how_many_layers_the_check_runs(monkeypatch):
    """auto: the whole of a model whose float32 copy fits WHOLE_MODEL_BYTES; past it, the first
    SLICE_LAYERS, or as many as hold every kind of layer; a number: that many (the whole model at or
    above its depth)."""
    from everyprompt.models import slices
    from tests.families import family_model

    model, _ = family_model("qwen3", num_hidden_layers=6)
    assert slices.checked_layers("auto", model) is None  # 4 x its parameters: far below 4 GiB
    assert slices.checked_layers(2, model) == 2 and slices.checked_layers(6, model) is None
    monkeypatch.setattr(slices, "WHOLE_MODEL_BYTES", 0)  # as if it were large
    model.config.layer_types = ["full_attention"] * 6
    assert slices.checked_layers("auto", model) == 4
    model.config.layer_types = ["full_attention"] * 4 + ["sliding_attention"] * 2  # a kind first at layer 5
    assert slices.checked_layers("auto", model) == 5
    model.config.layer_types = ["full_attention"] * 5 + ["sliding_attention"]
    assert slices.checked_layers("auto", model) is None  # every layer needed: the whole model


def test_a_slice_is_the_models_first_layers_with_its_norm_and_head():
    """The slice's logits are the whole model's hidden states after its first layers, through its final
    norm and head; a LoRA policy's slice has its adapters merged."""
    from types import SimpleNamespace

    from everyprompt.models.lora import apply_lora, plain_copy
    from everyprompt.models.slices import model_slice
    from tests.families import family_model

    model, tokenizer = family_model("qwen3_moe", num_hidden_layers=5)
    ids = torch.tensor([tokenizer("12+34=5").input_ids])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[2]
        by_hand = model.lm_head(model.model.norm(hidden))
        sliced = model_slice(model, 2)
        assert sliced.config.num_hidden_layers == 2 and len(sliced.model.layers) == 2
        torch.testing.assert_close(sliced(ids).logits, by_hand, atol=1e-5, rtol=0)
    settings = SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules=["q_proj"], target_parameters=[])
    policy = apply_lora(model, settings)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
        merged = plain_copy(policy)
        hidden = merged(ids, output_hidden_states=True).hidden_states[2]
        torch.testing.assert_close(
            model_slice(policy, 2)(ids).logits, merged.lm_head(merged.model.norm(hidden)), atol=1e-5, rtol=0
        )


def test_a_slice_finds_a_wrong_fast_path_and_logs_its_layers(tmp_path, capsys, monkeypatch):
    train(tiny_config("rl.steps=1", "rollout.parity_layers=1"), run_dir=tmp_path / "right")
    first = json.loads((tmp_path / "right" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["parity/layers"] == 1 and 0 <= first["parity/logp_abs_diff"] < 1e-5
    tables = native_attention.rope_tables
    monkeypatch.setattr(
        native_attention, "rope_tables", lambda c, d: (tables(c, d)[0] * 1.5, tables(c, d)[1])
    )
    overrides = [*TINY_OVERRIDES, "rollout.engine=native", "rollout.parity_layers=1"]
    code = main(["train", *overrides, "--run-dir", str(tmp_path / "wrong")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "qwen3_moe model (its first 1 layers, rollout.parity_layers) differ" in err[-1]


@pytest.mark.parametrize("bad", ["rollout.parity_layers=0", "rollout.parity_layers=some"])
def test_a_bad_layer_count_names_the_key(bad):
    from everyprompt.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.parity_layers"):
        tiny_config(bad)


def _sharded_model_checked_whole(rank: int, port: int) -> None:
    """In a process of its own (a process group and DTensors left in a test worker deadlock a later fork
    there)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from everyprompt.models import slices
    from tests.families import family_model

    model, _ = family_model("qwen3", num_hidden_layers=6)
    slices.WHOLE_MODEL_BYTES = 0  # as if it were large
    assert slices.checked_layers("auto", model) == 4
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        fully_shard(model)
        assert slices.checked_layers("auto", model, only_narrow=True) is None  # the learner's checks
    finally:
        dist.destroy_process_group()


@pytest.mark.long  # 16 s on 2 cores: `make test-long`
def test_a_sharded_model_is_checked_whole():
    """The learner checks fsdp2's float32 shards (DTensors) themselves: each rank holds a share, no copy is
    needed (a bf16 base's: tests/models/test_gathering.py)."""
    import torch.multiprocessing as mp

    from tests.trainer.test_data_parallel import _free_port

    mp.spawn(_sharded_model_checked_whole, args=(_free_port(),), nprocs=1, join=True)


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
@pytest.mark.parametrize(("base", "learner_layers"), [("bf16", 4), ("fp32", 5)])
def test_a_large_models_checks_copy_no_whole_model(tmp_path, monkeypatch, base, learner_layers):
    """A (pretend) large LoRA policy: the parity check always runs on a float32 slice of its first 4
    layers (its engine would be a whole float32 copy); the learner's packing and head checks on such a
    slice where the base is held in bf16 (widening it would copy it whole), on the policy itself, all 5
    layers with the learner's own kernels, where it is float32 already."""
    from everyprompt.models import slices
    from everyprompt.trainer.learner_side import forward
    from tests.models.test_lora import LORA

    monkeypatch.setattr(slices, "WHOLE_MODEL_BYTES", 0)
    seen = []
    for name in ("check_packing", "check_head"):
        real = getattr(forward, name)
        monkeypatch.setattr(
            forward,
            name,
            lambda model, *a, _real=real, **k: (
                seen.append((model.config.num_hidden_layers, {p.dtype for p in model.parameters()}))
                or _real(model, *a, **k)
            ),
        )
    held = ("model.dtype=bf16", f"model.frozen_dtype={base}", "model.num_layers=5")
    train(tiny_config(*LORA, *held, "sft.steps=0", "rl.steps=1"), run_dir=tmp_path)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["parity/layers"] == 4 and first["parity/logp_abs_diff"] < 1e-5
    assert seen == [(learner_layers, {torch.float32})] * 2
