"""The optimizer: AdamW fused where every parameter is on a real CUDA device, torch's default elsewhere."""

from __future__ import annotations

import torch

from everyprompt.devices.fake_cuda import fake_cuda
from everyprompt.trainer.learner_side.optim import build_optimizer, fused_on


def test_adamw_is_fused_only_with_every_parameter_on_real_cuda(monkeypatch):
    cpu = torch.nn.Linear(3, 2)
    assert not fused_on(list(cpu.parameters())) and not fused_on([])
    assert build_optimizer(cpu, 1e-3, 0.0).defaults["fused"] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, CPU parameters
    assert not fused_on(list(cpu.parameters()))
    with fake_cuda():
        on_device = torch.nn.Linear(3, 2).to("cuda:0")
        assert not fused_on(list(on_device.parameters()))  # fake CUDA: no CUDA kernel exists
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert fused_on(list(on_device.parameters()))
        assert not fused_on([*on_device.parameters(), torch.zeros(1)])  # one left on the host
