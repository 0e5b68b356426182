"""Reward functions that misbehave on purpose, for the RewardPool tests (imported by path)."""

import os
import time


def length(completions, **_):
    return [float(len(c)) for c in completions]


def hang_on_x(completions, **_):
    """Hangs (far past any test's timeout) on a completion containing 'x'; else the length."""
    if any("x" in c for c in completions):
        time.sleep(600)
    return [float(len(c)) for c in completions]


def crash_on_x(completions, **_):
    """Kills its own process on a completion containing 'x', as a segfault in a native verifier would."""
    if any("x" in c for c in completions):
        os._exit(3)
    return [float(len(c)) for c in completions]


def die_once(completions, marker, **_):
    """Kills its own process the first time it runs (marker file absent), as the OOM killer would."""
    if not os.path.exists(marker[0]):
        open(marker[0], "w").close()
        os._exit(9)
    return [float(len(c)) for c in completions]


def raise_on_x(completions, **_):
    if any("x" in c for c in completions):
        raise ValueError("cannot score this")
    return [float(len(c)) for c in completions]


def wrong_count(completions, **_):
    return [1.0, 2.0]


def sleepy(completions, delay=(0.0,), **_):
    time.sleep(float(delay[0]))
    return [1.0 for _ in completions]


def echo_answer(completions, answer, **_):
    return [float(c == a) for c, a in zip(completions, answer)]


def hang_on_odd(completions, **_):
    """Never returns (within a test) on an odd-length completion; else reward 1."""
    if any(len(c) % 2 for c in completions):
        time.sleep(600)
    return [1.0 for _ in completions]


def torch_matmul(completions, **_):
    """Runs a multi-threaded-sized torch op, as a reward model would."""
    import torch

    a = torch.ones(256, 256)
    return [float((a @ a)[0, 0]) / 256 for _ in completions]


class ComponentsRaiseOnX:
    """A reward that reports components and raises on a completion containing 'x'."""

    def score_with_components(self, completions, **_):
        if any("x" in c for c in completions):
            raise ValueError("cannot score this")
        values = [float(len(c)) for c in completions]
        return values, [{"length": v} for v in values], []

    def __call__(self, completions, **columns):
        return self.score_with_components(completions, **columns)[0]


class SlowLoading:
    """A reward that sets itself up slowly (as a judge loads its weights) and then scores each row with
    the size of the call it came in (so a test sees how the pool batched)."""

    def __init__(self, load_s: float = 0.0, batch_size: int = 1, fail: bool = False):
        self.load_s, self.batch_size, self.fail = load_s, batch_size, fail
        self.loaded = False

    def prepare(self) -> None:
        time.sleep(self.load_s)
        if self.fail:
            raise OSError("judge weights not found")
        self.loaded = True

    def __call__(self, completions, **_):
        if not self.loaded:
            raise RuntimeError("called before prepare()")
        return [float(len(completions))] * len(completions)
