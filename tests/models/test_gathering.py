"""A sharded (fsdp2) learner's weights for the engines, gathered a layer at a time on 2 gloo processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from everyprompt.models.gathering import gathered_weights, owners, units
from everyprompt.models.io import as_held
from everyprompt.models.lora import merged_state_dict
from everyprompt.trainer.learner_side.data_parallel import DataParallel
from tests.families import family_model
from tests.models.test_lora import adapted_policy
from tests.trainer.test_data_parallel import _free_port


def _gather(rank: int, port: int, out: str) -> None:
    """In processes of their own (a gloo group left in a test worker deadlocks a later forked child): a
    plain policy, then a LoRA one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for lora in (False, True):
            _gather_one(rank, lora, f"{out}.{'lora' if lora else 'plain'}")
        _gather_one(rank, True, f"{out}.lora-bf16", narrow=True)
        _check_slices(rank, f"{out}.slices")
    finally:
        dist.destroy_process_group()


def _gather_one(rank: int, lora: bool, out: str, narrow: bool = False) -> None:
    """`narrow`: sent to bf16 engines (`dtypes`), cast on the gathered layer before the host copy."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    policy = adapted_policy()[0] if lora else family_model("qwen3_moe")[0]
    expected = {key: value.detach().clone() for key, value in merged_state_dict(policy).items()}
    dtypes = {key: torch.bfloat16 for key in expected} if narrow else None
    expected = {key: as_held(value, dtypes and dtypes[key]) for key, value in expected.items()}
    sharded = DataParallel("fsdp2").shard(policy)
    owner = owners(units(sharded))
    whole_units = []  # at each weight: the units whose parameters are whole (gathered) then
    got = {}
    for key, value in gathered_weights(sharded, keep=rank == 0, dtypes=dtypes):
        whole = {
            owner.get(id(module), 0)
            for module in sharded.modules()
            for p in module.parameters(recurse=False)
            if not isinstance(p, DTensor)
        }
        whole_units.append(len(whole))
        got[key] = value
    resharded = all(isinstance(p, DTensor) for p in sharded.parameters())
    if rank == 0:
        torch.save(
            {"expected": expected, "got": got, "whole_units": whole_units, "resharded": resharded}, out
        )
    else:
        assert got == {} and resharded


def _check_slices(rank: int, out: str) -> None:
    """A sharded policy on a bf16 base is checked on a float32 copy, every rank gathering it: the whole
    model when small, else its first layers; equal to the unsharded policy's."""
    from everyprompt.models.slices import checked_layers, model_slice

    torch.manual_seed(0)
    policy = adapted_policy(torch.bfloat16)[0]
    expected = {key: value.clone() for key, value in model_slice(policy, 1).state_dict().items()}
    layers = policy.get_base_model().config.num_hidden_layers
    sharded = DataParallel("fsdp2").shard(policy)
    sliced = model_slice(sharded, 1).state_dict()
    result = {
        "auto": checked_layers("auto", sharded),
        "one": checked_layers(1, sharded),
        "many": checked_layers(layers + 5, sharded),
        "layers": layers,
        "equal": sliced.keys() == expected.keys()
        and all(torch.equal(sliced[k], expected[k]) for k in expected),
        "float32": {value.dtype for value in sliced.values() if value.is_floating_point()} == {torch.float32},
    }
    torch.save(result, f"{out}.{rank}")


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("gathering") / "gathered.pt")
    mp.spawn(_gather, args=(_free_port(), out), nprocs=2, join=True)
    return out


@pytest.mark.long  # 70 s on 2 cores: `make test-long`
@pytest.mark.parametrize("setup", ["plain", "lora", "lora-bf16"])
def test_a_sharded_policy_is_gathered_one_layer_at_a_time_to_its_merged_weights(gathered, setup):
    """Rank 0 gets every weight an engine loads, whole, on the host, equal to the unsharded policy's
    (a LoRA policy's adapters on attention, experts and router merged; for bf16 engines, cast to bf16
    as the unsharded ones would be); one unit is whole at a time, and every unit is sharded again after."""
    result = torch.load(f"{gathered}.{setup}", weights_only=True)
    expected, got = result["expected"], result["got"]
    assert list(got) != [] and set(got) == set(expected)
    assert all(
        got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]) for key in expected
    )
    if setup == "lora-bf16":
        assert {value.dtype for value in got.values()} == {torch.bfloat16}
    assert {value.device.type for value in got.values()} == {"cpu"}
    assert max(result["whole_units"]) == 1 and result["resharded"]
    # the root's own weights first (the ends an engine reads first), then each layer's
    assert list(got)[:2] == ["model.embed_tokens.weight", "model.norm.weight"]


def test_a_module_belongs_to_the_innermost_unit_holding_it():
    inner = torch.nn.Linear(2, 2)
    layer = torch.nn.Sequential(torch.nn.Linear(2, 2), inner)
    other = torch.nn.Linear(2, 2)
    root = torch.nn.Sequential(torch.nn.Embedding(3, 2), layer, other)
    owner = owners([root, layer, inner])  # a unit inside another after it, as `units` lists them
    assert owner[id(layer[0])] == 1 and owner[id(inner)] == 2 and owner[id(layer)] == 1
    assert owner.get(id(root[0]), 0) == 0 and owner.get(id(other), 0) == 0  # the root's


def test_a_sharded_policy_on_a_bf16_base_is_checked_on_a_float32_copy_gathered_on_every_rank(gathered):
    for rank in (0, 1):
        result = torch.load(f"{gathered}.slices.{rank}", weights_only=True)
        assert result["auto"] == result["layers"]  # small: all its layers, in float32
        assert result["one"] == 1 and result["many"] == result["layers"]
        assert result["equal"] and result["float32"], rank


def test_an_unsharded_model_has_nothing_to_gather():
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM is not sharded"):
        next(gathered_weights(family_model("qwen3_moe")[0], keep=True))
