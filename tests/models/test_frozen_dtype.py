"""Weights no update touches held in the training precision (`model.frozen_dtype`): a LoRA policy's base
and a distillation teacher in bf16 under bf16 training, the adapters float32; adapted weights merged in
float32 (exact for a float32 engine); the startup checks compare in float32 by widening the base exactly;
a run trains, checks and resumes exactly on such a base; the Ray recipe rebuilds it as it was."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from everyprompt.config import ModelConfig
from everyprompt.models.lora import apply_lora, merged_state_dict, plain_copy, weights_nbytes
from everyprompt.models.precision import frozen_dtype, hold_parameters_in, parameters_in_float32
from everyprompt.pipeline import train
from everyprompt.trainer.parity import parity_gap
from tests.conftest import tiny_config
from tests.families import family_model
from tests.models.test_lora import ADAPTERS, LORA, adapted_policy

BF16, FP32 = torch.bfloat16, torch.float32
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("dtype", "frozen", "device", "held"),
    [
        ("auto", "auto", CUDA, BF16),  # auto trains bf16 on CUDA
        ("bf16", "auto", CUDA, BF16),
        ("auto", "auto", CPU, FP32),  # and fp32 on the CPU
        ("bf16", "auto", CPU, FP32),  # a CPU's bf16 elementwise work is slow: auto keeps fp32 there
        ("fp32", "auto", CUDA, FP32),
        ("bf16", "fp32", CUDA, FP32),  # asked for
        ("fp32", "bf16", CPU, BF16),  # asked for
    ],
)
def test_frozen_weights_follow_the_training_precision(dtype, frozen, device, held):
    assert frozen_dtype(ModelConfig(dtype=dtype, frozen_dtype=frozen), device) is held


def test_widening_to_float32_is_exact_and_undone():
    model, _ = family_model("qwen3_moe")
    hold_parameters_in(model, BF16)
    norm = model.model.norm.weight
    norm.data = norm.data.float()  # one float32 parameter among bf16 ones: not touched
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    identity = {name: id(p) for name, p in model.named_parameters()}
    norm_storage = norm.data_ptr()
    with parameters_in_float32(model):
        assert {p.dtype for p in model.parameters()} == {FP32}
        assert all(torch.equal(p, before[name].float()) for name, p in model.named_parameters())
    assert all(p.dtype == before[name].dtype for name, p in model.named_parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert {name: id(p) for name, p in model.named_parameters()} == identity  # what an optimizer holds
    assert norm.data_ptr() == norm_storage
    assert {b.dtype for b in model.buffers()} == {FP32}  # rotary frequencies are never cast


def test_a_bf16_base_merges_its_adapted_weights_in_float32():
    policy, tokenizer = adapted_policy(BF16)
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {FP32}  # the adapters
    assert {p.dtype for p in policy.parameters() if not p.requires_grad} == {BF16}  # the base
    merged = merged_state_dict(policy)
    key = "model.layers.0.self_attn.q_proj.weight"
    q_proj = policy.get_base_model().model.layers[0].self_attn.q_proj
    a, b = q_proj.lora_A["default"].weight, q_proj.lora_B["default"].weight
    by_hand = q_proj.base_layer.weight.float() + (b @ a) * (8 / 4)  # W widened + alpha / r * B A
    assert merged[key].dtype is FP32
    torch.testing.assert_close(merged[key], by_hand, atol=1e-6, rtol=0)
    assert merged["model.norm.weight"].dtype is BF16  # not adapted: as held
    assert merged["model.layers.0.mlp.experts.gate_up_proj"].dtype is FP32
    whole = dict(merged)
    assert weights_nbytes(merged) == sum(t.numel() * t.element_size() for t in whole.values())
    plain = plain_copy(policy).state_dict()
    assert plain.keys() == whole.keys()
    assert all(plain[k].dtype == whole[k].dtype and torch.equal(plain[k], whole[k]) for k in whole)
    shipped = pickle.loads(pickle.dumps(merged))
    assert all(torch.equal(shipped[k], whole[k]) for k in whole)
    # the startup parity check on this policy (adapters far from zero, experts' and router's included):
    # its float32 engine, of either kind, merges from the widened base and decodes exactly the network the
    # widened policy computes (made before the widening, the experts' deltas rounded to bf16: 1e-3 apart)
    ids = [tokenizer(text).input_ids for text in ("12+34=", "7+8=")]
    for engine in ("native", "hf"):
        gap = parity_gap(policy, tokenizer, engine, ids, temperature=1.0, max_new_tokens=8, seed=3)
        assert gap["parity/logp_abs_diff_max"] < 1e-5, engine
    assert {p.dtype for p in policy.parameters() if not p.requires_grad} == {BF16}  # and after, as held


@pytest.mark.parametrize(
    ("settings", "held"),
    [
        (
            ("cluster.backend=ray", "cluster.num_gpus=1"),
            BF16,
        ),  # the driver's CPU copy as the GPU ranks hold it
        (("cluster.backend=ray", "cluster.num_gpus=0"), FP32),  # CPU ranks hold float32 under auto
        ((), FP32),  # the local backend on a CPU
    ],
)
def test_a_ray_drivers_lora_base_is_held_as_its_learner_ranks_hold_theirs(settings, held):
    from everyprompt.models.lora import lora_base_dtype

    config = tiny_config("model.dtype=bf16", *settings)
    assert lora_base_dtype(config, torch.device("cpu")) is held
    assert lora_base_dtype(config, CUDA) is BF16  # a rank on a GPU, whatever the backend


def test_the_ray_recipe_rebuilds_a_bf16_base_as_it_was():
    from everyprompt.distributed.recipes import ModelRecipe

    policy, _ = adapted_policy(BF16)
    rebuilt = ModelRecipe.of(policy, ADAPTERS).build()
    mine, theirs = policy.state_dict(), rebuilt.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    plain = ModelRecipe.plain(policy)
    assert plain.dtype is FP32  # the widest of its weights: the float32 merges are not rounded
    engine_side = plain.build().state_dict()
    merged = dict(merged_state_dict(policy))
    assert all(torch.equal(engine_side[k], merged[k].float()) for k in merged)


def _lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long  # 11 s on 2 cores: `make test-long`
def test_a_lora_run_on_a_bf16_base_trains_checks_in_float32_and_resumes_exactly(tmp_path):
    """bf16 training on the CPU with the base held in bf16 (asked for: auto keeps fp32 on a CPU), the adapters train in float32; the
    startup parity check and the learner's packing check compare in float32 (without the widening the
    packing check fails this model at 5.6e-4 and parity reads 4.7e-4); a resumed run reloads the base in
    bf16 and ends where the uncut one does."""
    bf16 = [*LORA, "sft.steps=0", "model.dtype=bf16", "model.frozen_dtype=bf16", "rl.kl.estimator=k3"]
    straight = train(tiny_config(*bf16, "rl.steps=3"), run_dir=tmp_path / "straight")
    assert {p.dtype for p in straight.model.parameters() if not p.requires_grad} == {BF16}
    assert {p.dtype for p in straight.model.parameters() if p.requires_grad} == {FP32}
    assert _lines(tmp_path / "straight")[0]["parity/logp_abs_diff"] < 1e-6
    train(tiny_config(*bf16, "rl.steps=1"), run_dir=tmp_path / "cut")
    resumed = train(tiny_config(*bf16, "rl.steps=3"), run_dir=tmp_path / "cut", resume=True)
    assert {p.dtype for p in resumed.model.parameters() if not p.requires_grad} == {BF16}
    mine = {n: p for n, p in straight.model.named_parameters() if p.requires_grad}
    theirs = dict(resumed.model.named_parameters())
    assert any(float(p.detach().abs().max()) > 0 for n, p in mine.items() if "lora_B" in n)  # they moved
    # the resumed run's parity check ran on moved adapters (experts' and router's included): still exact
    assert [x["parity/logp_abs_diff"] < 1e-6 for x in _lines(tmp_path / "cut") if "parity/tokens" in x] == [
        True,
        True,
    ]
    assert all(torch.equal(p, theirs[n]) for n, p in mine.items())
    assert [x["loss/policy"] for x in _lines(tmp_path / "straight")] == [
        x["loss/policy"] for x in _lines(tmp_path / "cut")
    ]
    # under auto a CPU keeps the base in float32
    kept = train(tiny_config(*bf16, "rl.steps=1", "model.frozen_dtype=auto"), run_dir=tmp_path / "auto")
    assert {p.dtype for p in kept.model.parameters()} == {FP32}


def test_a_teacher_is_held_in_the_training_precision(tmp_path):
    from everyprompt.models.io import save_pretrained
    from everyprompt.trainer.learner_side.distill import Distillation
    from tests.conftest import make_tiny_model

    model, tokenizer = make_tiny_model()
    save_pretrained(model, tokenizer, tmp_path / "teacher")
    teacher = f"rl.teacher.model={tmp_path / 'teacher'}"
    for dtype, frozen, held in (("bf16", "bf16", BF16), ("fp32", "auto", FP32), ("bf16", "auto", FP32)):
        term = Distillation(tiny_config(teacher, f"model.dtype={dtype}", f"model.frozen_dtype={frozen}"), CPU)
        assert {p.dtype for p in term.teachers[""].parameters()} == {held}


def _rank_holds_the_base_in_bf16(rank: int, port: int) -> None:
    """In a process of its own: the rank's process group must not outlive it in a test worker."""
    import torch.distributed as dist

    from everyprompt.distributed.learner import LearnerRank
    from everyprompt.distributed.recipes import ModelRecipe
    from everyprompt.models.io import load_model_and_tokenizer

    config = tiny_config(*LORA, "model.dtype=bf16", "model.frozen_dtype=bf16")
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    policy = apply_lora(model, config.model.lora)  # as the driver holds it
    assert {p.dtype for p in policy.parameters()} == {FP32}
    learner_rank = LearnerRank(rank, 1, 1)
    recipe = ModelRecipe.of(policy, config.model.lora)
    try:
        learner_rank.start("127.0.0.1", port, config, recipe, tokenizer.pad_token_id, None)
        held = learner_rank.learner.model
        assert {p.dtype for p in held.parameters() if not p.requires_grad} == {BF16}
        assert {p.dtype for p in held.parameters() if p.requires_grad} == {FP32}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.long  # 30 s on 2 cores: `make test-long`
def test_a_learner_rank_holds_the_base_as_its_own_device_decides():
    """Under Ray the driver's copy lives on its CPU (a float32 base under `auto`); the learner rank casts
    the base it rebuilds by its own settings and device (here asked for bf16), the adapters float32."""
    pytest.importorskip("ray", reason="the ray extra is not installed (it is part of dev)")
    import torch.multiprocessing as mp

    from tests.trainer.test_data_parallel import _free_port

    mp.spawn(_rank_holds_the_base_in_bf16, args=(_free_port(),), nprocs=1, join=True)


def test_an_actor_rebuilds_a_model_whose_config_names_a_devices_attention(monkeypatch):
    """Trained in bf16 on a CPU, the policy's config names everyprompt's float32 attention; a Ray actor (a
    process where nothing registered it, on any device) rebuilt the model from that config and failed
    ("Specified attn_implementation=everyprompt_sdpa_fp32_cpu is not supported"). It is built with SDPA's
    attention, and a learner rank's kernels choose for its own device again."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from everyprompt.distributed.recipes import ModelRecipe
    from everyprompt.models.precision import FP32_CPU_SDPA, cpu_attention_in_fp32, training_kernels

    model, _ = family_model("qwen3_moe")
    assert cpu_attention_in_fp32(model, "bf16")
    recipe = ModelRecipe.plain(model)
    for interface in (AttentionInterface, AttentionMaskInterface):  # as in a fresh process
        monkeypatch.delitem(interface._global_mapping, FP32_CPU_SDPA)
    rebuilt = recipe.build()
    assert rebuilt.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == FP32_CPU_SDPA  # the sender's own config untouched
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in model.state_dict().items())
    training_kernels(rebuilt, ModelConfig(dtype="bf16"))  # a CPU learner rank under bf16
    assert rebuilt.config._attn_implementation == FP32_CPU_SDPA


def test_weights_held_in_bf16_are_read_as_bf16(tmp_path):
    """A checkpoint directory and a GGUF file read straight into bf16 parameters (no whole float32 copy):
    each the float32 reading rounded, the buffers float32 as transformers makes them."""
    from everyprompt.models.io import load_pretrained
    from tests.families import save_family_checkpoint
    from tests.models.gguf_files import bpe_tokenizer, llama_model, write_llama_gguf

    tokenizer = bpe_tokenizer()
    paths = [
        save_family_checkpoint("qwen3_moe", tmp_path / "checkpoint"),
        write_llama_gguf(tmp_path / "model.gguf", llama_model(tokenizer.get_vocab_size()), tokenizer),
    ]
    for path in paths:
        wide, _ = load_pretrained(path)
        narrow, _ = load_pretrained(path, dtype=BF16)
        assert {p.dtype for p in narrow.parameters()} == {BF16}, path
        assert all(b.dtype == FP32 for b in narrow.buffers()), path
        mine, theirs = narrow.state_dict(), wide.state_dict()
        assert all(torch.equal(mine[k], theirs[k].to(mine[k].dtype)) for k in theirs), path
