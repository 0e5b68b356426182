"""Length-aware scheduling on hand-made examples."""

import pytest

from everyprompt.data.passrate import PassRateStore
from everyprompt.rollout.scheduler import LengthPredictor, admission_order, assign_lpt


def test_admission_order_fifo_and_longest_first():
    predicted = [10.0, 40.0, 5.0, 40.0, 20.0]
    assert admission_order(predicted, "fifo") == [0, 1, 2, 3, 4]
    assert admission_order(predicted, "longest_first") == [1, 3, 4, 0, 2]  # the tie 1/3 keeps its order
    with pytest.raises(ValueError, match="fifo, longest_first, got 'random'"):
        admission_order(predicted, "random")


def test_lpt_assignment_by_hand():
    # jobs by length: 7(8) 0(7) 3(6) 5(5) 1(4) 2(3) 6(2) 4(1), 3 workers
    # 7 -> w0 (load 8); 0 -> w1 (7); 3 -> w2 (6); 5 -> w2 (11); 1 -> w1 (11); 2 -> w0 (11);
    # 6 -> w0 (13, tie at 11 goes to the lowest index); 4 -> w1 (12)
    predicted = [7, 4, 3, 6, 1, 5, 2, 8]
    assert assign_lpt(predicted, 3) == [[7, 2, 6], [0, 1, 4], [3, 5]]
    loads = [sum(predicted[j] for j in jobs) for jobs in assign_lpt(predicted, 3)]
    assert loads == [13, 12, 11]
    assert assign_lpt(predicted, 1) == [[7, 0, 3, 5, 1, 2, 6, 4]]
    assert assign_lpt([], 2) == [[], []]
    with pytest.raises(ValueError, match="workers must be >= 1"):
        assign_lpt(predicted, 0)


def test_length_prediction_falls_back_from_prompt_to_bucket_to_cap():
    store = PassRateStore()
    store.record([("seen", 4, 2, 30.0)], step=0)  # 4 attempts, mean completion length 30
    predictor = LengthPredictor(store, default=64)
    assert predictor.predict("seen", "level1") == 30.0  # the prompt's own history
    assert predictor.predict("new", "level1") == 64.0  # nothing known: the cap
    predictor.observe("level1", [10, 20])
    predictor.observe("level1", [30])
    assert predictor.predict("new", "level1") == 20.0  # the bucket's mean: (10 + 20 + 30) / 3
    assert predictor.predict("new", "level2") == 64.0
    assert predictor.predict("new", None) == 64.0
    restored = LengthPredictor(store, default=64)
    restored.load_state_dict(predictor.state_dict())
    assert restored.predict("new", "level1") == 20.0
