"""A user reward function that fails on every other completion (for the error-isolation test)."""

_calls = {"n": 0}


def flaky(completions, answer, **_):
    out = []
    for completion in completions:
        _calls["n"] += 1
        if _calls["n"] % 2 == 0:
            raise RuntimeError("judge unavailable")
        out.append(float(completion.strip() == answer))
    return out


def parity(completions, **columns):
    """Reward 1 for an even-length completion: varies within groups, so every step updates the model."""
    return [float(len(text) % 2 == 0) for text in completions]


def always(completions, **columns):
    """Reward 1 for everything: every group is all-correct (zero-variance)."""
    return [1.0 for _ in completions]


def by_level(completions, level, **columns):
    """Level-4 prompts always right, level-5 prompts always wrong: zero-variance groups of both kinds."""
    return [1.0 if lvl == 4 else 0.0 for lvl in level]


def wrong_signature(completions):
    """Takes no columns: every call raises TypeError (a user's typo)."""
    return [1.0 for _ in completions]


def hashed(completions, **columns):
    """Reward 1 for completions whose CRC-32 is even: a signal no policy learns, so every step updates."""
    import zlib

    return [float(zlib.crc32(text.encode()) % 2 == 0) for text in completions]


def scattered(completions, **columns):
    """A reward in [0, 1) from each completion's CRC-32: two different completions (nearly) always score
    differently, so every group of a sampled batch carries signal and every step updates the model."""
    import zlib

    return [zlib.crc32(text.encode()) / 2**32 for text in completions]


def slow_scattered(completions, **columns):
    """`scattered`, taking 50 ms a completion: a step spends a while with rewards in flight (a signal then
    lands while completions are still being sent to and scored by the workers)."""
    import time

    time.sleep(0.05 * len(completions))
    return scattered(completions, **columns)
