"""A run that puts bf16 matmuls on a CPU where they are slow says so (devices/bf16.py)."""

from __future__ import annotations

import torch

from everyprompt.devices.bf16 import cpu_bf16_slowdown, slow_bf16_note
from everyprompt.pipeline.process import bf16_on_cpu
from tests.conftest import tiny_config


def test_the_note_names_the_settings_and_the_fix_only_when_bf16_is_slow():
    note = slow_bf16_note(["model.dtype=bf16", "rollout.precision=bf16"], slowdown=31.0)
    assert note.startswith("model.dtype=bf16 and rollout.precision=bf16: a bf16 matmul takes 31x an fp32 one")
    assert "set model.dtype=fp32 rollout.precision=fp32 here" in note
    assert slow_bf16_note(["model.dtype=bf16"], slowdown=1.2) is None  # AVX-512: nothing to say
    assert slow_bf16_note([], slowdown=31.0) is None
    assert cpu_bf16_slowdown() > 0 and cpu_bf16_slowdown() is cpu_bf16_slowdown()  # measured once


def test_the_settings_that_put_bf16_on_the_cpu():
    cpu = torch.device("cpu")
    assert bf16_on_cpu(tiny_config(), cpu) == []  # auto: fp32 on the CPU
    both = ("model.dtype=bf16", "rollout.precision=bf16", "rl.old_logprobs=recompute")
    native = tiny_config(*both, "model.cpu_bf16=native")
    assert bf16_on_cpu(native, cpu) == ["model.dtype=bf16", "rollout.precision=bf16"]
    # the learner's products on float32 kernels: only the engine's bf16 is left to warn of
    assert bf16_on_cpu(tiny_config(*both, "model.cpu_bf16=emulated"), cpu) == ["rollout.precision=bf16"]
    assert bf16_on_cpu(tiny_config("model.dtype=bf16"), torch.device("meta")) == []  # not on the CPU


def test_the_slowdown_is_measured_on_torchs_own_kernels_wherever_it_is_first_asked():
    """Asked first under bf16 autocast and the learner's emulation (as a training forward may ask it),
    the measurement still multiplies an fp32 pair and a bf16 pair on torch's kernels."""
    from everyprompt.models.emulated_bf16 import EmulatedBf16
    from tests.conftest import ProductDtypes

    with ProductDtypes() as products, torch.autocast("cpu", dtype=torch.bfloat16), EmulatedBf16():
        slowdown = cpu_bf16_slowdown.__wrapped__()
    assert set(products.dtypes) == {torch.float32, torch.bfloat16} and slowdown > 0
