"""What a Ray run's checkpoint brings from its learner ranks: everything once, then only what trains."""

from __future__ import annotations

import pytest
import torch

from everyprompt.distributed.learner import RankedLearner
from everyprompt.models.lora import apply_lora, weights_nbytes
from tests.conftest import tiny_config
from tests.distributed.test_ray_training import LORA, SETTINGS
from tests.trainer.test_sides import _model, hand_batch


@pytest.mark.long  # two Ray learners start: tens of seconds
@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_a_lora_checkpoint_brings_the_frozen_base_once_then_only_the_adapters(ray_instance, sharding):
    config = tiny_config(
        *SETTINGS,
        *LORA,
        "cluster.backend=ray",
        "cluster.trainer_ranks=2",
        f"cluster.trainer_sharding={sharding}",
    )
    model, tokenizer = _model(config)
    policy = apply_lora(model, config.model.lora)
    learner = RankedLearner(config, policy, tokenizer.pad_token_id)
    try:
        driver = apply_lora(_model(config)[0], config.model.lora)  # the driver's copy, as a run keeps it
        learner.sync_model(driver)
        whole = learner.last_checkpoint_bytes
        assert whole == weights_nbytes(policy.state_dict())
        learner.update(hand_batch(_model(config)[0], tokenizer, [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]))
        learner.sync_model(driver)
        frozen = {name for name, p in policy.named_parameters() if not p.requires_grad}
        trained = weights_nbytes({k: v for k, v in policy.state_dict().items() if k not in frozen})
        assert learner.last_checkpoint_bytes == trained < whole / 4  # the adapters (and any saved buffers)
        ranks = learner._all([r.model_weights.remote() for r in learner.ranks], "checkpoint")[0]
        mine = driver.state_dict()
        assert mine.keys() == ranks.keys()
        moved = [
            key for key in ranks if "lora_" in key and not torch.equal(ranks[key], policy.state_dict()[key])
        ]
        assert moved  # the update moved the adapters: what the second sync brought is not the first's
        assert all(torch.equal(mine[key], ranks[key].to(mine[key].dtype)) for key in ranks)
    finally:
        learner.close()
