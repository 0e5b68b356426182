"""RewardPool: worker processes, streaming submission, and a time limit per call."""

import time

import pytest

from everyprompt.rewards import RewardError
from everyprompt.rewards.pool import RewardPool

HERE = "tests.rewards.slow_rewards"


@pytest.mark.parametrize("workers", [0, 2])
def test_rewards_come_back_in_the_order_asked(workers):
    with RewardPool(f"{HERE}:echo_answer", workers=workers) as pool:
        for key, (text, answer) in enumerate([("4", "4"), ("5", "6"), ("7", "7")]):
            pool.submit(key, text, {"answer": answer, "level": 1})
        assert pool.wait([2, 0, 1]) == [1.0, 1.0, 0.0]
        assert pool.stats.submitted == pool.stats.scored == 3 and pool.stats.errors == 0


def test_a_hanging_reward_is_cut_at_the_timeout_and_the_pool_goes_on():
    with RewardPool(f"{HERE}:hang_on_x", workers=1, timeout_s=0.5) as pool:
        started = time.perf_counter()
        pool.submit("a", "ab", {})
        pool.submit("hang", "xyz", {})
        pool.submit("b", "abcd", {})
        assert pool.wait(["a", "hang", "b"]) == [2.0, None, 4.0]
        assert time.perf_counter() - started < 5  # not the 600 s the call would take
        assert pool.stats.timeouts == 1 and pool.stats.errors == 1 and pool.stats.restarts == 1


def test_a_crashing_worker_is_replaced_and_counted():
    with RewardPool(f"{HERE}:crash_on_x", workers=1, timeout_s=5) as pool:
        for key, text in enumerate(["a", "x", "bb", "x", "ccc"]):
            pool.submit(key, text, {})
        assert pool.wait(list(range(5))) == [1.0, None, 2.0, None, 3.0]
        # each 'x' is sent once more to the new worker (a crash may not be its fault), crashes it again
        assert pool.stats.crashes == 4 and pool.stats.errors == 2


def test_a_worker_killed_mid_step_has_its_completions_scored_by_its_replacement(tmp_path):
    marker = str(tmp_path / "died")
    with RewardPool(f"{HERE}:die_once", workers=1, timeout_s=5) as pool:
        for key, text in enumerate(["a", "bb", "ccc"]):
            pool.submit(key, text, {"marker": marker})
        assert pool.wait([0, 1, 2]) == [1.0, 2.0, 3.0]  # nothing lost to the death
        assert pool.stats.crashes == 1 and pool.stats.restarts == 1 and pool.stats.errors == 0


def test_a_raising_reward_scores_none_and_counts():
    with RewardPool(f"{HERE}:raise_on_x", workers=1) as pool:
        pool.submit(0, "x", {})
        pool.submit(1, "ab", {})
        assert pool.wait([0, 1]) == [None, 2.0]
        assert pool.stats.errors == 1 and pool.stats.crashes == 0


def test_a_wrong_number_of_values_scores_none_and_the_failure_comes_back():
    with RewardPool(f"{HERE}:wrong_count", workers=1) as pool:
        pool.submit(0, "a", {})
        assert pool.wait([0]) == [None] and pool.stats.errors == 1
        (failure,) = pool.take_failures()
        assert "returned 2 values for 1 completions" in failure.summary and "Traceback" in failure.traceback
        assert pool.take_failures() == []


def test_workers_score_before_the_caller_asks():
    """Submitted calls are scored in the background: they all come in while the caller never calls
    wait() (a pool that scored inside wait() would leave `scored` at 0 here)."""
    with RewardPool(f"{HERE}:sleepy", workers=2, timeout_s=5) as pool:
        for key in range(8):
            pool.submit(key, "a", {"delay": 0.01})
        deadline = time.perf_counter() + 10
        while pool.stats.scored < 8 and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert pool.stats.scored == 8
        assert pool.wait(list(range(8))) == [1.0] * 8


def test_a_raising_reward_with_components_costs_its_row():
    from tests.rewards.slow_rewards import ComponentsRaiseOnX

    with RewardPool(ComponentsRaiseOnX(), workers=1) as pool:
        pool.submit(0, "x", {})
        pool.submit(1, "ab", {})
        assert pool.wait([0, 1]) == [None, 2.0]
        assert pool.last_components == [None, {"length": 2.0}]
        assert pool.stats.errors == 1 and pool.stats.crashes == 0


def test_bad_settings_and_unknown_rewards_are_clear_errors():
    with pytest.raises(ValueError, match="rewards.workers must be >= 0, got -1"):
        RewardPool("math", workers=-1)
    with pytest.raises(ValueError, match="rewards.timeout_s must be > 0"):
        RewardPool("math", timeout_s=0)
    with pytest.raises(RewardError, match="unknown reward 'nope'"):
        RewardPool("nope")


def test_a_pool_nobody_holds_stops_its_workers():
    import gc

    pool = RewardPool(f"{HERE}:length", workers=2)
    processes = [w.process for w in pool._state.workers]
    pool.submit(0, "abc", {})
    assert pool.wait([0]) == [3.0]
    del pool
    gc.collect()
    for process in processes:
        process.join(timeout=5)
        assert not process.is_alive()


def test_closing_after_the_dispatcher_has_ended_still_stops_the_workers():
    """The race the test above lost once under load: the dispatcher thread saw the stop and ended
    (closing its end of the wake-up pipe) before close() wrote its wake-up byte. That write then failed
    on a closed descriptor (or one reused by another file by then) and left the workers running. The
    dispatcher's end is made to finish first here; close() must still stop every worker."""
    import os

    pool = RewardPool(f"{HERE}:length", workers=2)
    processes = [w.process for w in pool._state.workers]
    pool.submit(0, "abc", {})
    assert pool.wait([0]) == [3.0]
    state = pool._state
    state.tasks.put(None)  # the stop the dispatcher sees first
    os.write(state.wake_write, b"x")
    pool._thread.join(timeout=10)
    assert not pool._thread.is_alive()
    pool.close()
    for process in processes:
        process.join(timeout=5)
        assert not process.is_alive()
    assert state.wake_write == -1


def test_torch_rewards_run_in_forked_workers():
    """torch's thread pool does not survive fork (a parallel op in the child hangs); workers use one
    thread, so a reward model in torch scores instead of timing out."""
    import torch

    a = torch.randn(512, 512)
    (a @ a).sum()  # the parent has used its intra-op threads
    with RewardPool(f"{HERE}:torch_matmul", workers=1, timeout_s=10) as pool:
        pool.submit(0, "a", {})
        assert pool.wait([0]) == [1.0]
        assert pool.stats.timeouts == 0


def test_a_callable_can_stand_for_the_spec():
    from tests.rewards.slow_rewards import length

    with RewardPool(length, workers=1) as pool:
        pool.submit(0, "abcd", {})
        assert pool.wait([0]) == [4.0]


def test_a_worker_is_sent_up_to_batch_size_completions_per_call():
    from tests.rewards.slow_rewards import SlowLoading

    with RewardPool(SlowLoading(load_s=0.5, batch_size=4), workers=1, timeout_s=5) as pool:
        for key in range(10):  # all waiting by the time the worker has loaded
            pool.submit(key, "c", {})
        assert pool.wait(list(range(10))) == [4.0] * 8 + [2.0] * 2
    with RewardPool(SlowLoading(load_s=0.5, batch_size=4), workers=1, timeout_s=5, batch_size=1) as pool:
        for key in range(3):
            pool.submit(key, "c", {})
        assert pool.wait([0, 1, 2]) == [1.0] * 3  # the pool's own batch_size wins over the reward's


def test_a_slow_load_is_not_counted_against_the_call_timeout():
    from tests.rewards.slow_rewards import SlowLoading

    with RewardPool(SlowLoading(load_s=1.5), workers=2, timeout_s=0.5) as pool:
        for key in range(6):
            pool.submit(key, "c", {})
        assert pool.wait(list(range(6))) == [1.0] * 6
        assert pool.stats.timeouts == 0 and pool.stats.restarts == 0 and pool.stats.errors == 0


@pytest.mark.parametrize(
    "reward, match",
    [
        ({"load_s": 0.0, "fail": True}, r"failed to load: OSError: judge weights not found"),
        ({"load_s": 30.0}, r"did not finish loading within rewards.load_timeout_s=0.5 s"),
    ],
)
def test_a_reward_that_cannot_load_stops_the_run(reward, match):
    from tests.rewards.slow_rewards import SlowLoading

    with RewardPool(SlowLoading(**reward), workers=1, timeout_s=5, load_timeout_s=0.5) as pool:
        pool.submit(0, "c", {})
        with pytest.raises(RewardError, match=match):
            pool.wait([0])
