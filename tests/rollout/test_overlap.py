"""The overlapped decode loop (rollout/native/decode_loop.py): on a CUDA device the static step's forward
goes to the device before the host reads the step's tokens, fed to every active row. Checked on the fake
CUDA device (devices/fake_cuda.py), where the loop runs as on a GPU: the order of a step's parts, the same
completions as the CPU's loop (which reads first and feeds only the rows that go on) for episodes, stop
strings and a live source's mixed settings, and a row that finishes at the cache's last position."""

from __future__ import annotations

import pytest
import torch

from everyprompt.choices import decoding
from everyprompt.devices.fake_cuda import fake_cuda
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native import decode_loop as loop_module
from everyprompt.rollout.native.cache import WIDTH_STEP
from everyprompt.rollout.native.static_step import StaticStep
from tests.conftest import make_tiny_model
from tests.rollout.test_episodes import Scripted, _observation, _stop_string
from tests.rollout.test_static import PROMPTS, _assert_same, _by_id, _live, _requests


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


def test_only_the_static_step_on_a_cuda_device_overlaps():
    assert decoding("off", "auto", "cuda").overlap and decoding("on", "on", "cuda").overlap
    assert decoding("off", "static", "cuda").overlap  # no capture, the device still apart from the host
    assert not decoding("off", "static", "cpu").overlap and not decoding("off", "off", "cuda").overlap


def _logged(function, seen: list[str], called: str | None, read: str | None = None):
    """`function`, noting `called` in `seen` when it is called and, where it returns a reader (read_later,
    copy_later), `read` when that is called."""

    def wrapper(*args):
        if called is not None:
            seen.append(called)
        out = function(*args)
        if read is None:
            return out

        def reader():
            seen.append(read)
            return out()

        return reader

    return wrapper


def _order(monkeypatch) -> list[str]:
    """What each step does, in order: `sample`, `forward` (the static step's phases) and `read` (the host
    waiting for the step's tokens)."""
    seen: list[str] = []
    monkeypatch.setattr(StaticStep, "sample", _logged(StaticStep.sample, seen, "sample"))
    monkeypatch.setattr(StaticStep, "forward", _logged(StaticStep.forward, seen, "forward"))
    monkeypatch.setattr(loop_module, "read_later", _logged(loop_module.read_later, seen, None, "read"))
    return seen


def test_on_a_cuda_device_the_forward_is_sent_before_the_tokens_are_read(tiny, monkeypatch):
    model, tokenizer = tiny
    seen = _order(monkeypatch)
    params = SamplingParams(8)
    expected = _by_id(NativeEngine.from_model(model, tokenizer, 4, cuda_graphs="static").generate(
        _requests(tokenizer), params))  # fmt: skip
    assert seen[:3] == ["sample", "read", "forward"]  # the CPU: read first, then feed the rows that go on
    seen.clear()
    with fake_cuda():
        engine = NativeEngine.from_model(model, tokenizer, 4, device="cuda:0")
        got = _by_id(engine.generate(_requests(tokenizer), params))
    assert engine.stats["overlapped"] == 1.0
    steps = [seen[i : i + 3] for i in range(0, len(seen), 3)]
    assert len(steps) > 8 and all(step == ["sample", "forward", "read"] for step in steps), seen
    _assert_same(got, expected)


@pytest.mark.long  # 11 s on 2 cores: `make test-long`
def test_overlapped_episodes_stop_strings_and_live_settings_decode_as_the_cpu_does(tiny):
    """Observations fed in place of samples (known before the forward is sent), turns ended by a stop
    string while the forward of the turn's last token runs, rows finishing and refilled: the completions
    of the CPU's loop, token for token."""
    model, tokenizer = tiny
    params = SamplingParams(20, stop=(_stop_string(model, tokenizer, PROMPTS[2]),))

    def requests():
        episodes = [
            GenerationRequest(
                10 + i, tokenizer(p).input_ids, seed=i, episode=Scripted(_observation(tokenizer, "+1"))
            )
            for i, p in enumerate(PROMPTS[:4])
        ]
        return episodes + _requests(tokenizer, PROMPTS[:4])

    expected = _by_id(NativeEngine.from_model(model, tokenizer, 3).generate(requests(), params))
    live_expected = _by_id(
        NativeEngine.from_model(model, tokenizer, 3).generate(_live(tokenizer), SamplingParams(16))
    )
    with fake_cuda():
        engine = NativeEngine.from_model(model, tokenizer, 3, device="cuda:0")
        got = _by_id(engine.generate(requests(), params))
        live = _by_id(engine.generate(_live(tokenizer), SamplingParams(16)))
    assert engine.stats["overlapped"] == 1.0
    assert any(c.completion_mask is not None for c in got.values())  # an observation was fed
    _assert_same(got, expected)
    _assert_same(live, live_expected)


@pytest.mark.long  # 11 s on 2 cores: `make test-long`
def test_a_row_that_ends_at_the_caches_last_position_stays_inside_it_as_an_idle_row(tiny):
    """Overlapping, a row that reaches its token limit has its last token fed too, so its length is one
    past what the call's width allows; left idle inside the bucket (one bucket of two rows: no move to the
    front), it is fed the pad token at that length from then on. The cache holds one position more for it:
    without it, that write falls outside the storage."""
    model, tokenizer = tiny
    long_prompt = tokenizer("123+456+789+12=").input_ids
    limit = WIDTH_STEP - len(long_prompt)  # the call's width is exactly the storage's step
    short = tokenizer("1+2=").input_ids
    requests = [
        GenerationRequest(0, long_prompt, seed=0),  # row 0: to its limit, at the width's last position
        GenerationRequest(1, short, seed=1, max_new_tokens=2),  # row 1: soon done, refilled by ...
        GenerationRequest(2, short, seed=2),  # ... this one, which outlives row 0
    ]
    params = SamplingParams(limit, greedy=True)

    def run(device):
        engine = NativeEngine.from_model(
            model, tokenizer, 2, device=device, cuda_graphs="static", graph_buckets=[2]
        )
        engine.stop_ids = frozenset()  # no early end of sequence: each runs to its limit
        return engine, _by_id(engine.generate(requests, params))

    _, expected = run("cpu")
    with fake_cuda():
        engine, got = run("cuda:0")
    assert engine.stats["overlapped"] == 1.0 and engine.stats["pool_shrinks"] == 0
    assert [len(got[i].token_ids) for i in range(3)] == [limit, 2, limit]
    assert engine._static.caches[0][0].shape[2] > WIDTH_STEP
    _assert_same(got, expected)


def test_a_finished_rows_routes_are_read_after_the_next_step_is_sent(tiny, monkeypatch):
    """Recording routes (router replay), a finished row's routes are taken from the device when it finishes
    (their copy queued behind the forward just sent) and read a step later, once the next forward is sent
    too: reading them at once would keep the host waiting for that first forward with nothing queued
    after it. The completions, routes included, are the CPU's."""
    from everyprompt.rollout.native import rows as rows_module

    model, tokenizer = tiny
    seen = _order(monkeypatch)
    monkeypatch.setattr(rows_module, "copy_later", _logged(rows_module.copy_later, seen, "take", "routes"))
    params = SamplingParams(12, record_routes=True, record_router_logits=True)
    expected = _by_id(NativeEngine.from_model(model, tokenizer, 4).generate(_requests(tokenizer), params))
    seen.clear()
    with fake_cuda():
        engine = NativeEngine.from_model(model, tokenizer, 4, device="cuda:0")
        got = _by_id(engine.generate(_requests(tokenizer), params))
    assert engine.stats["overlapped"] == 1.0 and seen.count("take") == seen.count("routes") > 2
    takes = [at for at, what in enumerate(seen) if what == "take"]
    reads = [at for at, what in enumerate(seen) if what == "routes"]
    for took, read in zip(takes, reads):  # a forward sent in between, or none left to send
        assert "forward" in seen[took:read] or "forward" not in seen[read:], seen
    _assert_same(got, expected)


def test_a_rollout_sides_batch_from_the_overlapped_engine_is_the_cpu_engines():
    """One RL step's rollouts end to end (the rollout side: admission order, streaming to the reward pool,
    groups, the batch) with the engine overlapping on the fake CUDA device: the CPU engine's batch, its
    completions, the engine's log-probs and the routes router replay trains with."""
    from everyprompt.data.passrate import PassRateStore
    from everyprompt.rewards.pool import RewardPool
    from everyprompt.trainer import LocalRolloutSide
    from tests.conftest import tiny_config
    from tests.trainer.test_sides import _model

    config = tiny_config("rl.prompts_per_step=3", "rl.group_size=4", "rollout.max_new_tokens=10")
    model, tokenizer = _model(config)
    prompts = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": 1} for a in range(1, 8)]

    def batch(engine):
        reward = lambda completions, **_: [float(len(t) % 2) for t in completions]  # noqa: E731
        side = LocalRolloutSide(
            config, engine, tokenizer, prompts, RewardPool(reward, workers=0), PassRateStore()
        )
        try:
            return side.next_batch(0)
        finally:
            side.close()

    expected = batch(NativeEngine.from_model(model, tokenizer, 8))
    with fake_cuda():
        engine = NativeEngine.from_model(model, tokenizer, 8, device="cuda:0")
        got = batch(engine)
    assert engine.stats["overlapped"] == 1.0 and engine.can_record_routes
    assert got.completion_ids == expected.completion_ids and got.rewards.tolist() == expected.rewards.tolist()
    assert len({len(c) for c in got.completion_ids}) > 1  # rows finished at different steps
    for mine, theirs in zip(got.rollout_logprobs, expected.rollout_logprobs):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    for mine, theirs in zip(got.routed_experts, expected.routed_experts):
        assert torch.equal(mine, theirs)
