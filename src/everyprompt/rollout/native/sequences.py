"""What a decode step's sampled tokens do to each sequence, on the host: append, stop, or, for a multi-turn
episode (rollout.base.Episode), end the model's turn. The episode's `turn_ended` (its environment's step)
then runs in a thread of its own while the other rows decode; the row sits out, its cache kept, until the
answer comes (`Turns`). The environment's observation then continues the same sequence in one forward
(extend.py), masked out of the completion. An episode whose `time_limit` (seconds) passes first ends with
an error."""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from everyprompt.rollout.base import end_episode, past_time_limit
from everyprompt.rollout.native.call import Call
from everyprompt.rollout.native.rows import Rows


def take_tokens(call: Call, sampled, active: list[int], stops, turns: Turns) -> list[int]:
    """Append the step's `sampled` (tokens, log-probs, entropies: lists over the `active` slots, in order)
    to their sequences; returns the slots that finished. A slot whose episode's turn ended is handed to
    `turns` (it decodes this step's token, then waits)."""
    finished, state, stop_ids = [], call.rows, call.engine.stop_ids
    for slot, token, logprob, entropy in zip(active, *sampled):
        state.append(slot, token, logprob, entropy)
        if len(state.tokens[slot]) >= state.limit[slot]:
            finished.append(slot)
        elif token in stop_ids or stops.hit(state.tokens[slot]):
            episode = call.requests[state.request[slot]].episode
            if episode is None:
                finished.append(slot)
            else:
                turns.start(slot, episode, state)
    return finished


class Turns:
    """The episodes whose model turn ended, waiting for their environment (slot -> its answer's future
    and deadline). A waiting slot is paused (`Rows.pause`): it is neither sampled nor fed."""

    def __init__(self):
        self.pending: dict[int, tuple[Future, float | None, float | None]] = {}

    def start(self, slot: int, episode, state: Rows) -> None:
        future: Future = Future()
        token_ids = list(state.tokens[slot])

        def step():
            try:
                future.set_result(episode.turn_ended(token_ids))
            except BaseException as err:  # noqa: BLE001 (the engine's thread reports it as the episode's)
                future.set_exception(err)

        # a daemon thread: an environment that never returns cannot hold the process at exit
        threading.Thread(target=step, name="everyprompt-env-step", daemon=True).start()
        limit = getattr(episode, "time_limit", None)
        self.pending[slot] = (future, None if limit is None else time.monotonic() + limit, limit)
        state.pause(slot)

    def resolve(self, state: Rows, requests) -> tuple[list[int], dict[int, list[int]]]:
        """Resume the slots whose environment answered; returns the slots whose episode ended (no
        observation, a failure, or past its time limit) and the others' observations (slot -> tokens),
        to be fed (extend.py)."""
        finished, answered, now = [], {}, time.monotonic()
        for slot, (future, deadline, limit) in list(self.pending.items()):
            episode = requests[state.request[slot]].episode
            if future.done():
                error = future.exception()
                observation = None if error else future.result()
                if error is not None:
                    end_episode(
                        episode, type(error).__name__, f"turn_ended raised {type(error).__name__}: {error}"
                    )
            elif deadline is not None and now >= deadline:
                past_time_limit(episode, limit)
                observation = None
            else:
                continue
            del self.pending[slot]
            state.resume(slot)
            if observation:
                answered[slot] = list(observation)
            else:
                finished.append(slot)
        return finished, answered

    def wait(self) -> None:
        """Nothing decodes: sleep until an environment answers or the nearest time limit passes."""
        if not self.pending:
            return
        deadlines = [deadline for _, deadline, _ in self.pending.values() if deadline is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        wait([future for future, _, _ in self.pending.values()], timeout, FIRST_COMPLETED)


def ending(token_ids: list[int], observed: list[int], stop_ids, stops) -> tuple[str, torch.Tensor | None]:
    """A finished sequence's finish reason and completion mask (None when every token is the model's)."""
    count = len(token_ids)
    if observed and observed[-1] == count - 1:  # the cap fell inside an observation
        reason = "length"
    else:
        reason = "eos" if token_ids[-1] in stop_ids else "stop" if stops.hit(token_ids) else "length"
    if not observed:
        return reason, None
    mask = torch.ones(count, dtype=torch.bool)
    mask[observed] = False
    return reason, mask
