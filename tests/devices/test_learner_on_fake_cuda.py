"""A learner step with the policy on a fake CUDA device (devices/fake_cuda.py): every loss in the
registry, LoRA on and off, router replay, the KL reference; each step's update must equal the CPU one, and
a CPU tensor planted in the learner's path is named."""

import sys

import pytest
import torch

from everyprompt.algorithms import registered_policy_losses
from everyprompt.devices.fake_cuda import DeviceMismatch, FakeCudaTensor, fake_cuda, real
from everyprompt.models.attention import CUDA_SDPA, cuda_attention_without_cudnn
from everyprompt.models.experts import use_sorted_experts
from everyprompt.models.lora import apply_lora
from everyprompt.trainer import Learner
from tests.conftest import tiny_config
from tests.trainer.test_sides import _forced_routes, _model, hand_batch

REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
CUDA = torch.device("cuda", 0)


def _record_gradients(learner) -> list[dict[str, torch.Tensor]]:
    """Each optimizer step's gradients, on the host (Adam's first steps divide a gradient by its own size,
    so tiny gradients, as a router's under replay, turn last-bit differences into visible weight
    differences: the gradients are what the two devices must agree on)."""
    seen: list[dict[str, torch.Tensor]] = []
    step = learner.optimization.optimizer.step

    def recording(*args, **kwargs):
        named = learner.model.named_parameters()
        seen.append({name: real(p.grad).clone() for name, p in named if p.grad is not None})
        return step(*args, **kwargs)

    learner.optimization.optimizer.step = recording
    return seen


def _step(config, device: str):
    """One update of a fresh policy on `device`: (each optimizer step's gradients, on the host; the
    metrics; the fake-CUDA check, when on cuda)."""
    model, tokenizer = _model(config)
    use_sorted_experts(model)  # transformers' own kernel takes CUDA-only branches on a (fake) cuda device
    if config.model.lora.enabled:
        torch.manual_seed(0)  # the adapters' random init, alike on both devices
        model = apply_lora(model, config.model.lora)
    batch = hand_batch(_model(config)[0], tokenizer, REWARDS)
    if config.rl.router_replay == "r3":
        batch.routed_experts = _forced_routes(batch, model.config.num_hidden_layers)
    if device == "cpu":
        learner = Learner(config, model, tokenizer.pad_token_id)
        gradients = _record_gradients(learner)
        return gradients, learner.update(batch), None
    with fake_cuda() as check:
        model.to(device)
        # on CUDA the learner attends without cuDNN's backend (models/attention.py: the pipeline's
        # `training_kernels` gives it): the update below goes through it and must equal the CPU's
        assert cuda_attention_without_cudnn(model)
        learner = Learner(config, model, tokenizer.pad_token_id)
        assert all(isinstance(p, FakeCudaTensor) for p in learner.model.parameters())
        assert learner.model.config._attn_implementation == CUDA_SDPA
        gradients = _record_gradients(learner)
        check.syncs.clear()
        metrics = learner.update(batch)
    return gradients, metrics, check


def _losses_the_demo_can_use():
    return sorted(registered_policy_losses())


@pytest.mark.long  # 55 s on 2 cores: `make test-long`
@pytest.mark.parametrize(
    "overrides",
    [[f"rl.loss={name}"] for name in _losses_the_demo_can_use()]
    + [
        ["model.lora.enabled=true", "model.lora.r=4"],
        ["rl.router_replay=r3"],
        ["rl.kl.estimator=k3", "rl.kl.coef=0.01", "rl.rollout_correction.mode=tis"],
        ["rl.rollout_correction.mode=icepop", "rl.off_policy_mask=0.5"],
    ],
    ids=lambda overrides: ",".join(o.split("=")[0].split(".")[-1] + "=" + o.split("=")[1] for o in overrides),
)
def test_a_learner_step_on_fake_cuda_equals_the_cpu_one(overrides):
    config = tiny_config("rl.old_logprobs=recompute", "rl.lr=1e-2", *overrides)
    _same_step_on_both_devices(config)


def _same_step_on_both_devices(config) -> tuple[dict, dict, object]:
    """The update on the CPU and on fake CUDA: the same gradients at every optimizer step, the same loss;
    the two metrics dicts and the fake-CUDA check (its host syncs)."""
    expected, expected_metrics, _ = _step(config, "cpu")
    got, metrics, check = _step(config, "cuda:0")
    assert len(got) == len(expected) > 0
    for step, (mine, reference) in enumerate(zip(got, expected)):
        assert mine.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(mine[name], value, atol=1e-6, rtol=1e-4, msg=f"step {step}: {name}")
    assert metrics["loss/policy"] == pytest.approx(expected_metrics["loss/policy"], rel=1e-5, abs=1e-7)
    print(f"{check.total_syncs} host syncs in the update")
    return expected_metrics, metrics, check


@pytest.mark.long  # 10 s on 2 cores: `make test-long`
@pytest.mark.parametrize("several", [False, True], ids=["one-teacher", "teachers-by-column"])
def test_a_distillation_step_on_fake_cuda_equals_the_cpu_one(tmp_path, several):
    """The teacher is loaded onto the learner's (fake) device and scores there; with several teachers each
    scores its own rows (here: every other row, by a column the batch carries)."""
    from everyprompt.models.io import save_pretrained

    # the teacher float32 on both devices: under `auto` a CUDA learner holds it in bf16 (model.frozen_dtype)
    base = ("rl.old_logprobs=recompute", "rl.lr=1e-2", "model.frozen_dtype=fp32")
    teacher, tokenizer = _model(tiny_config(*base))
    with torch.no_grad():
        teacher.lm_head.weight.mul_(1.5)
    save_pretrained(teacher, tokenizer, tmp_path / "teacher")
    named = (  # several: one micro-batch of every row, so that one teacher scores some of its rows
        ["rl.teacher.by=kind", f"rl.teacher.models={{a: {tmp_path / 'teacher'}}}", "rl.mini_batches=1"]
        + ["rl.micro_batch_size=6"]
        if several
        else [f"rl.teacher.model={tmp_path / 'teacher'}"]
    )
    config = tiny_config(*base, *named)
    keys = ["a", "b"] * (len(REWARDS) // 2) if several else None
    hand = hand_batch

    def keyed(*args, **kwargs):
        batch = hand(*args, **kwargs)
        batch.teacher_keys = keys
        return batch

    sys.modules[__name__].hand_batch = keyed
    try:
        expected, metrics, check = _same_step_on_both_devices(config)
    finally:
        sys.modules[__name__].hand_batch = hand
    for key in ("distill/reverse_kl", "distill/token_share", "distill/advantage_share"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert expected["distill/reverse_kl"] != 0.0
    # the teacher's term adds no host sync of its own (its forward passes make transformers' packed-mask
    # check's, as every forward does: docs/gpu.md)
    assert not [where for where in check.syncs if "distill.py" in where], dict(check.syncs)
    assert 0.0 < expected["distill/token_share"] < 1.0 if several else expected["distill/token_share"] == 1.0


def test_a_cpu_tensor_planted_in_the_learner_is_named(monkeypatch):
    from everyprompt import batch as batch_module

    padded = batch_module.RolloutBatch.padded

    def advantages_left_on_the_host(self, rows, pad_id, device="cpu"):
        data = padded(self, rows, pad_id, device)
        data["mask"] = real(data["mask"]).clone()  # the planted CPU tensor
        return data

    monkeypatch.setattr(batch_module.RolloutBatch, "padded", advantages_left_on_the_host)
    config = tiny_config("rl.old_logprobs=recompute")
    with pytest.raises(DeviceMismatch) as raised:
        _step(config, "cuda:0")
    assert "cpu tensor" in str(raised.value) and "src/everyprompt/" in str(raised.value)


def test_an_sft_step_on_fake_cuda_equals_the_cpu_one():
    from everyprompt.trainer.sft import _sft_loss

    config = tiny_config()
    rows = [{"prompt": "1+2=", "solution": "3"}, {"prompt": "12+30=", "solution": "42"}]
    model, tokenizer = _model(config)
    use_sorted_experts(model)
    expected = _sft_loss(model, tokenizer, rows, True, None)
    expected.backward()
    with fake_cuda():
        on_device, _ = _model(config)
        use_sorted_experts(on_device)
        on_device.to("cuda:0")
        loss = _sft_loss(on_device, tokenizer, rows, True, None)
        loss.backward()
        assert loss.device == CUDA
        grads = {name: real(p.grad) for name, p in on_device.named_parameters() if p.grad is not None}
    assert float(real(loss)) == pytest.approx(float(expected), rel=1e-6)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_engine_routes_out_of_range_are_refused_on_the_device_too(monkeypatch):
    """Replay's value check reads the routes on the host once per update (no device sync per forward):
    an expert id out of range still stops the update, naming the values."""
    from everyprompt.models.replay import ReplayError

    config = tiny_config("rl.old_logprobs=recompute", "rl.router_replay=r3")
    forced = _forced_routes

    def out_of_range(batch, layers):
        routes = forced(batch, layers)
        routes[0][0, 0, 0] = 99
        return routes

    monkeypatch.setattr(sys.modules[__name__], "_forced_routes", out_of_range)
    with pytest.raises(ReplayError, match=r"expert ids in \[0, 4\) or -1, got values .*\.\.99"):
        _step(config, "cuda:0")


def test_the_startup_parity_check_runs_with_the_policy_on_the_device():
    """The first run on a real GPU (an H100) stopped here: the check made its token ids on the host."""
    from everyprompt.trainer.parity import parity_gap

    config = tiny_config()
    model, tokenizer = _model(config)
    use_sorted_experts(model)  # as the run selects it (model.moe_kernel)
    prompts = [tokenizer(p).input_ids for p in ("1+2=", "37+48=", "9=")]
    options = dict(temperature=1.0, max_new_tokens=8, seed=0)
    expected = parity_gap(model, tokenizer, "native", prompts, **options)
    with fake_cuda():
        model.to(CUDA)
        got = parity_gap(model, tokenizer, "native", prompts, **options)
    assert expected["parity/tokens"] > 0 and got["parity/tokens"] == expected["parity/tokens"]
    # the gaps are float32 round-off (a few 1e-6), whose size moves with the kernels' order of sums: a
    # fresh clone's run read 3.3e-6 where this machine's had read 1.9e-6
    assert got == pytest.approx(expected, abs=1e-5)


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
def test_an_update_reads_the_device_back_once_a_mini_batch(monkeypatch):
    """A second update (the once-a-run checks done): the old policy's pass reads back once (its mismatch
    figures), each mini-batch's step once (its finite flag, gradient norm, figures together; it used to be
    three reads, four with the mismatch). A forward whose packed rows hold several sequences reads nothing
    back: its attention mask is made on the host (trainer/learner_side/logprobs.py: `packed_mask`), so
    transformers' own search for packed segments does not run; where every row holds one sequence,
    transformers attends causally without a mask (SDPA's fastest path, and the same numbers as before)
    after its one check, which is the only other read. No upload waits for the device either."""
    from everyprompt.trainer.learner_side import logprobs as logprobs_module

    made = logprobs_module.packed_mask
    unmasked: list[bool] = []  # per packed forward: whether transformers was left to decide (one read)

    def counted(model, positions, device):
        mask = made(model, positions, device)
        unmasked.append(mask is None)
        return mask

    monkeypatch.setattr(logprobs_module, "packed_mask", counted)
    config = tiny_config("rl.old_logprobs=recompute", "rl.mini_batches=2")
    model, tokenizer = _model(config)
    use_sorted_experts(model)
    batch = hand_batch(_model(config)[0], tokenizer, REWARDS)
    with fake_cuda() as check:
        model.to(CUDA)
        learner = Learner(config, model, tokenizer.pad_token_id)
        learner.update(batch)
        check.syncs.clear()
        check.uploads.clear()
        unmasked.clear()
        metrics = learner.update(hand_batch(_model(config)[0], tokenizer, REWARDS))
    # and it uploads without waiting: copied row by row, the engine's log-probs of a 64-row update made
    # most of the 74 stream syncs an H200 counted
    assert not check.uploads, dict(check.uploads)
    assert metrics["actor/skipped_updates"] == 0.0 and "mismatch/logp_abs_diff" in metrics
    assert unmasked  # the update's forwards were packed
    masking = sum(n for where, n in check.syncs.items() if "masking_utils" in where)
    assert masking == sum(unmasked), dict(check.syncs)  # none from a forward with a host-made mask
    assert check.total_syncs - masking == 1 + 2, dict(check.syncs)  # the old policy's pass, one a mini-batch


def test_a_packed_forward_of_several_sequences_a_row_reads_nothing_back():
    """Rows that hold several sequences get their mask from the host: the forward makes no host read."""
    from everyprompt.trainer.learner_side.logprobs import pack_layout, token_logprobs
    from tests.conftest import make_tiny_model

    model, tokenizer = make_tiny_model()
    use_sorted_experts(model)  # transformers' own kernel takes CUDA-only branches on a (fake) cuda device
    tokens = [tokenizer(t).input_ids for t in ("100+200+300=600", "1+2=3", "4=4", "5+6=11")]
    ids = torch.full((len(tokens), max(map(len, tokens))), tokenizer.pad_token_id)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = torch.tensor(t)
    lengths = [len(t) for t in tokens]
    assert pack_layout(lengths, ids.shape[1]).num_rows < len(tokens)  # some row holds two or more
    with torch.no_grad():
        expected, _ = token_logprobs(model, ids, lengths=lengths, pad_id=tokenizer.pad_token_id)
    with fake_cuda() as check:
        model.to(CUDA)
        with torch.no_grad():
            got, _ = token_logprobs(model, ids.to(CUDA), lengths=lengths, pad_id=tokenizer.pad_token_id)
        syncs = dict(check.syncs)
    assert syncs == {}, syncs
    torch.testing.assert_close(real(got), expected, atol=1e-6, rtol=0)


def test_auto_micro_batches_on_a_gpu_take_the_mini_batch_in_one_pass_and_the_same_gradients(monkeypatch):
    """`rl.micro_batch_size=auto` on CUDA cuts micro-batches by tokens (8192 by default: the hand batch's
    six rows in one pass), where the CPU run here takes them two at a time: the gradients agree."""
    from everyprompt.trainer.learner_side.data_parallel import DataParallel

    passes: list[list[int]] = []
    cut = DataParallel.micro_batches

    def counted(self, *args, **kwargs):
        chunks = cut(self, *args, **kwargs)
        passes.extend(chunk for _, chunk in chunks)
        return chunks

    monkeypatch.setattr(DataParallel, "micro_batches", counted)
    base = ("rl.old_logprobs=recompute", "rl.lr=1e-2", "rl.mini_batches=1")
    expected, expected_metrics, _ = _step(tiny_config(*base, "rl.micro_batch_size=2"), "cpu")
    assert [len(rows) for rows in passes] == [2, 2, 2]
    passes.clear()
    got, metrics, _ = _step(tiny_config(*base, "rl.micro_batch_size=auto"), "cuda:0")
    assert [len(rows) for rows in passes] == [len(REWARDS)]
    for mine, reference in zip(got, expected, strict=True):
        for name, value in reference.items():
            torch.testing.assert_close(mine[name], value, atol=1e-6, rtol=1e-4, msg=name)
    assert metrics["loss/policy"] == pytest.approx(expected_metrics["loss/policy"], rel=1e-5, abs=1e-7)


def test_an_upload_of_host_parts_is_one_copy_that_does_not_wait():
    from everyprompt.batch import upload

    parts = [torch.arange(3.0), torch.arange(2.0)]
    with fake_cuda() as check:
        on_device = torch.ones(2, device=CUDA)
        joined = upload(parts, CUDA)
        mixed = upload([parts[0], on_device], CUDA)
        kept = upload([on_device, on_device], CUDA)
    assert isinstance(joined, FakeCudaTensor) and real(joined).tolist() == [0.0, 1.0, 2.0, 0.0, 1.0]
    assert real(mixed).tolist() == [0.0, 1.0, 2.0, 1.0, 1.0] and real(kept).tolist() == [1.0] * 4
    assert not check.uploads, dict(check.uploads)
    assert upload(parts, torch.device("cpu")).tolist() == [0.0, 1.0, 2.0, 0.0, 1.0]
