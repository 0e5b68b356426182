"""The pass-rate store: statistics, retirement and deferral, persistence across a kill, checkpoints."""

from __future__ import annotations

import sqlite3

import pytest

from everyprompt.data.passrate import DEFERRED, RETIRED, PassRateStore, prompt_key


def test_statistics_hand_computed():
    store = PassRateStore(ema_decay=0.5)
    store.record([("1+1=", 4, 1, 10.0)], step=0)  # first visit: ema = 1/4
    store.record([("1+1=", 4, 3, 20.0)], step=1)  # ema = 0.5 * 0.25 + 0.5 * 0.75 = 0.5
    stats = store.get("1+1=")
    assert (stats.attempts, stats.successes) == (8, 4)
    assert stats.ema == pytest.approx(0.5)
    assert stats.pass_rate == pytest.approx(0.5)
    assert stats.mean_length == pytest.approx(15.0)  # (10 * 4 + 20 * 4) / 8
    assert store.pass_rate("never seen", default=-1.0) == -1.0


def test_retire_after_consecutive_all_correct_groups_and_defer_all_wrong():
    store = PassRateStore()
    rules = {"retire_after": 2, "defer_after": 2, "defer_steps": 3}
    first = store.record([("easy", 4, 4, 5.0), ("hard", 4, 0, 9.0), ("mixed", 4, 2, 7.0)], step=0, **rules)
    assert first.retired == first.deferred == 0
    second = store.record([("easy", 4, 4, 5.0), ("hard", 4, 0, 9.0), ("mixed", 4, 4, 7.0)], step=1, **rules)
    assert (second.retired, second.deferred) == (1, 1)
    assert second.changes == {"easy": RETIRED, "hard": DEFERRED}
    assert store.get("mixed").correct_streak == 1  # a streak counts only consecutive all-correct visits
    assert not store.is_available("easy", step=100)
    assert not store.is_available("hard", step=4) and store.is_available("hard", step=5)  # 1 + 1 + 3
    back = store.record([("hard", 4, 0, 9.0)], step=5, **rules)
    assert back.returned == 1 and store.get("hard").status == "active"  # its streak restarted at 1
    assert store.counts() == {"active": 2, "retired": 1, "deferred": 0}


def test_bad_visit_is_rejected():
    with pytest.raises(ValueError, match="5 successes of 4 attempts"):
        PassRateStore().record([("p", 4, 5, 1.0)], step=0)


def test_every_recorded_step_is_on_disk_without_close(tmp_path):
    """A run killed after `record` returns loses nothing: each call is one committed transaction."""
    path = tmp_path / "passrates.sqlite"
    store = PassRateStore(path)
    store.record([("a", 8, 2, 4.0), ("b", 8, 8, 3.0)], step=0)
    # read with an independent connection while the writer is still open (as after a kill)
    rows = dict(sqlite3.connect(path).execute("SELECT key, successes FROM prompts").fetchall())
    assert rows == {prompt_key("a"): 2, prompt_key("b"): 8}
    reopened = PassRateStore(path)
    assert reopened.get("a").attempts == 8 and reopened.get("b").ema == 1.0


def test_state_dict_round_trip_and_snapshot(tmp_path):
    store = PassRateStore(tmp_path / "live.sqlite")
    store.record([("a", 8, 2, 4.0)], step=0)
    state = store.state_dict()
    store.record([("a", 8, 8, 4.0), ("b", 2, 1, 1.0)], step=1)
    store.snapshot(tmp_path / "snap.sqlite")
    assert PassRateStore(tmp_path / "snap.sqlite").get("b").attempts == 2
    store.load_state_dict(state)  # back to the checkpoint: "b" never happened
    assert store.get("b") is None and store.get("a").attempts == 8
    assert PassRateStore(tmp_path / "live.sqlite").get("b") is None  # the file follows


def test_a_file_that_is_not_a_store_is_a_clear_error(tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_text("not a database, just text " * 20)
    with pytest.raises(ValueError, match="notes.sqlite: not a pass-rate store"):
        PassRateStore(path)
