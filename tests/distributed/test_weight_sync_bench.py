"""The weight-sync bench (bench/distributed/weight_sync.py) end to end, in a process of its own: it starts and ends its
own Ray instance."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import needs_ray, run_ray_bench


@needs_ray
@pytest.mark.slow  # ten set-ups of Ray actors: about three minutes on 2 cores
def test_the_weight_sync_bench_measures_each_setup_and_leaves_nothing(tmp_path):
    setups = run_ray_bench("bench.distributed.weight_sync", tmp_path / "weight_sync.json")["setups"]
    assert len(setups) == 10
    for name, row in setups.items():
        assert row["weights_mib"] > 0 and row["sync_s"] > 0, name
        assert all(isinstance(row[f"{side}_private_rise_mib"], float) for side in ("rank0", "worker")), name
        # --tiny sends buckets of 1 MiB: a model of a few MiB goes in several
        assert row["buckets"] == 1 if "one bucket" in name else row["buckets"] > 2, (name, row["buckets"])
    # the ratios sit beside the bucketed set-ups, against the one-bucket set-up of the same learner
    assert {"worker_private_vs_one_bucket", "sync_s_vs_one_bucket"} <= set(setups["1 rank, 1 MiB buckets"])
    assert "sync_s_vs_one_bucket" not in setups["1 rank, one bucket"]
    # pipelined against the same buckets sent one side after the other: the same bytes
    piped = setups["1 rank, 1 MiB buckets, pipelined"]
    assert piped["weights_mib_vs_one_after_the_other"] == 1.0 and piped["sync_s_vs_one_after_the_other"] > 0
    # bf16 engines sent bf16: a float32 learner's weights in half the bytes; a bf16 base's merges fewer
    narrowed = setups["1 rank, bf16 engine, engine dtype"]
    assert 0.45 < narrowed["weights_mib_vs_learner_dtype"] < 0.55
    lora = setups["2 ranks fsdp2 + LoRA on a bf16 base, bf16 engine, engine dtype"]
    assert lora["weights_mib_vs_learner_dtype"] < 1.0
    assert "weights_mib_vs_learner_dtype" not in setups["1 rank, bf16 engine, learner dtype"]
