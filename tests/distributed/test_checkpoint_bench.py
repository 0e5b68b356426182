"""The Ray checkpoint bench (bench/distributed/ray_checkpoint.py) end to end, in a process of its own: it starts and
ends its own Ray instance."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import needs_ray, run_ray_bench


@needs_ray
@pytest.mark.slow  # two set-ups of two Ray learner ranks: under a minute on 2 cores
def test_the_checkpoint_bench_measures_both_ways_and_leaves_nothing(tmp_path):
    setups = run_ray_bench("bench.distributed.ray_checkpoint", tmp_path / "ray_checkpoint.json")["setups"]
    assert set(setups) == {"2 ranks ddp", "2 ranks fsdp2"}
    for name, row in setups.items():
        gathered, mine = row["gathered into the driver"], row["written by the ranks"]
        # the weights and AdamW's two moments came through Ray before; nothing does now
        assert gathered["to_driver_mib"] == pytest.approx(3 * row["weights_mib"], rel=0.05), name
        assert mine["to_driver_mib"] < 0.1 and mine["checkpoint_s"] > 0, name
        assert {"driver_private_vs_gathered", "checkpoint_s_vs_gathered"} <= set(mine), name
        # the driver let its copy of the weights go: about their size came back
        assert row["driver_released_mib"] > 0.5 * row["weights_mib"], name
