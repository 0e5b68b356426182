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
