"""Both rollout sides (the run's own and the served one a user's loop drives) and both learner sides
implement the loop's interfaces (trainer/interface.py) whole, with the interface's parameters."""

from __future__ import annotations

import inspect

import pytest

from everyprompt.serve.driven import DrivenRolloutSide
from everyprompt.trainer.interface import LearnerSide, RolloutSide
from everyprompt.trainer.learner_side.learner import Learner
from everyprompt.trainer.rollout_side import LocalRolloutSide


def _learner_sides() -> list[type]:
    sides = [Learner]
    try:
        from everyprompt.distributed.learner import RankedLearner
    except ImportError:  # the ray extra is not installed
        return sides
    return [*sides, RankedLearner]


SIDES = [(RolloutSide, LocalRolloutSide), (RolloutSide, DrivenRolloutSide)] + [
    (LearnerSide, side) for side in _learner_sides()
]


@pytest.mark.parametrize(("interface", "side"), SIDES, ids=lambda value: value.__name__)
def test_each_side_implements_every_method_of_its_interface_with_its_parameters(interface, side):
    assert issubclass(side, interface)
    assert not side.__abstractmethods__, f"{side.__name__} lacks {sorted(side.__abstractmethods__)}"
    for name in interface.__abstractmethods__:
        wanted, given = getattr(interface, name), getattr(side, name)
        if isinstance(wanted, property):
            assert isinstance(given, property), f"{side.__name__}.{name} is not a property"
            continue
        expected = list(inspect.signature(wanted).parameters)
        assert list(inspect.signature(given).parameters)[: len(expected)] == expected, (side.__name__, name)


def test_a_rollout_side_that_lacks_a_method_cannot_be_made():
    methods = {name: (lambda self, *args: None) for name in RolloutSide.__abstractmethods__ - {"engine"}}
    methods["engine"] = property(lambda self: None)
    whole = type("Whole", (RolloutSide,), methods)
    whole()  # every method given: it is made
    for missing in sorted(RolloutSide.__abstractmethods__):
        lacking = type("Lacking", (RolloutSide,), {k: v for k, v in methods.items() if k != missing})
        with pytest.raises(TypeError, match=missing):
            lacking()


def test_the_loop_takes_the_interfaces():
    from everyprompt.trainer.loop import RLTrainer

    hints = inspect.signature(RLTrainer.__init__).parameters
    assert hints["rollout"].annotation in ("RolloutSide", RolloutSide)
    assert hints["learner"].annotation in ("LearnerSide", LearnerSide)
