"""One mini-batch step of the update: its micro-batches' forward and backward passes (this rank's share),
the loss of each through `policy_loss` on a typed `LossBatch`, the gradients' reduction across ranks,
then the optimizer step, or its skip when a loss or the gradient norm is not finite. The step's figures
stay on the device until one read back, with the finite flag and the gradient norm that decide it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from everyprompt.algorithms import (
    LossBatch,
    LossSettings,
    RolloutCorrection,
    host_floats,
    policy_loss,
    zvp_token_advantages,
)
from everyprompt.batch import RolloutBatch
from everyprompt.config import Config
from everyprompt.trainer.learner_side.distill import AdvantageTerm
from everyprompt.trainer.learner_side.mismatch import batch_mismatch_values, fed_tokens, finish_mismatch
from everyprompt.trainer.learner_side.optim import Optimization
from everyprompt.trainer.learner_side.passes import Passes

# which routes the update passes replay, per rl.router_replay (a `RolloutBatch.padded` key; off: none)
REPLAYED_ROUTES = {"off": None, "r2": "old_routes", "r3": "routes"}


def loss_settings(config: Config, vocab_size: int) -> LossSettings:
    """The run's `rl.*` keys as the loss's settings (fixed for the run)."""
    rl, correction = config.rl, config.rl.rollout_correction
    return LossSettings(
        agg=rl.loss_agg,
        max_length=config.rollout.max_new_tokens,
        kl=rl.kl.estimator,
        kl_coef=rl.kl.coef,
        correction=RolloutCorrection(correction.mode, correction.level, correction.cap, correction.band),
        off_policy_mask=rl.off_policy_mask,
        vocab_size=vocab_size,
    )


@dataclass
class MiniBatch:
    """One optimizer step's rows of the batch and what its micro-batches share."""

    rows: list[int]
    data: dict[str, torch.Tensor]  # the rows padded, on the model's device
    advantages: torch.Tensor  # [n] one per row
    num_tokens: float  # the rows' trained tokens: the loss's denominator (the mask's sum)
    measure: bool  # this forward is the old policy's: measure its mismatch against the engine
    held: list | None  # replay kept in force through the backward (gradient checkpointing re-runs routers)


class MiniBatchStep:
    def __init__(self, passes: Passes, optimization: Optimization, term: AdvantageTerm, config: Config):
        self.passes, self.optimization, self.term = passes, optimization, term
        self.rl, self.zvp_alpha = config.rl, config.zve.zvp.alpha
        self.recompute = config.rl.old_logprobs == "recompute"
        self.checkpointed = config.model.gradient_checkpointing
        self.routes_key = REPLAYED_ROUTES[config.rl.router_replay]
        self.settings = loss_settings(config, passes.forward.model.config.vocab_size)
        self.loss_options = config.rl.loss_kwargs()

    def __call__(self, batch: RolloutBatch, rows: list[int], own_old: bool, version: int) -> dict[str, float]:
        """One optimizer step over `rows`. `own_old`: the policy has not moved since the batch was handed
        over, so this forward is the old policy: it stands for the old values (unless the engine's do:
        `rl.old_logprobs=rollout`) and gives the old policy's mismatch on these rows."""
        data = self.passes.padded(batch, rows)
        if own_old and self.recompute:  # the old values of these rows are this forward's own
            for key in ("old_logp", "old_entropy", "old_routes"):
                data.pop(key, None)
        mini = MiniBatch(
            rows,
            data,
            batch.advantages[rows].to(self.passes.device, non_blocking=True),
            float(max(batch.trained_tokens(rows), 1)),
            measure=own_old,
            held=[] if self.checkpointed else None,
        )
        self.optimization.zero_grad()
        try:
            return self._accumulate(batch, mini, version)
        finally:
            for release in mini.held or []:
                release()

    def _accumulate(self, batch: RolloutBatch, mini: MiniBatch, version: int) -> dict[str, float]:
        device, parallel, rows = self.passes.device, self.passes.parallel, mini.rows
        zero = torch.zeros((), device=device)
        sums: dict[str, torch.Tensor] = {"loss/policy": zero, "entropy_sum": zero}
        measured: list[tuple[tuple[int, int], list]] = []
        used: list[tuple[tuple[int, int], list]] = []
        finite = torch.ones((), dtype=torch.bool, device=device)
        for key, chunk in self.passes.micro_batches(range(len(rows)), batch.token_counts(rows)):
            padding = chunk is None  # fsdp2: a zero-weighted pass that keeps the collectives in step
            part = slice(0, 1) if padding else slice(chunk[0], chunk[-1] + 1)
            used_routes = [] if mini.measure else None
            loss, logp, entropy, metrics = self._micro_batch(batch, mini, part, used_routes)
            if padding:
                loss = loss * 0.0
            else:
                finite = finite & torch.isfinite(loss.detach())
            loss.backward()
            while mini.held:  # this micro-batch's replay, kept through its backward's recomputation
                mini.held.pop()()
            if padding:
                continue
            if mini.measure:
                measured.append((key, batch.completion_values(rows[part], logp)))
                used.append((key, fed_tokens(batch, rows[part], used_routes)))
            weight = batch.trained_tokens(rows[part]) / mini.num_tokens
            mask = mini.data["mask"][part]
            part_sums = {"loss/policy": loss.detach(), "entropy_sum": (entropy * mask).sum(), **metrics}
            for name, value in part_sums.items():  # sums (*_sum) add up; per-token means by their weight
                value = value if name == "loss/policy" or name.endswith("_sum") else value * weight
                sums[name] = sums.get(name, zero) + value
        parallel.reduce_gradients(self.passes.forward.model)
        grad_norm = self.optimization.clip_gradients()
        mismatch = {}
        if mini.measure:
            order = parallel.in_order
            mismatch = batch_mismatch_values(batch, rows, order(measured), order(used) or None)
        # one read back from the device for the whole step: whether every loss was finite, the gradient
        # norm (together they decide whether the step is taken), the step's figures and its mismatch
        read = host_floats({"learner:finite": finite, "learner:grad_norm": grad_norm, **sums, **mismatch})
        return self._take(read, list(sums), mini.num_tokens, version)

    def _take(self, read: dict[str, float], summed: list[str], num_tokens: float, version: int) -> dict:
        """The optimizer step from the step's figures read back, or its skip; the step's metrics."""
        finite_here = read.pop("learner:finite") >= 1.0
        if self.passes.parallel.any(not finite_here):
            what = "loss" if not finite_here else "another rank's loss"
            return self.optimization.skip(version, what, read["loss/policy"])
        grad_norm = read.pop("learner:grad_norm")
        if not math.isfinite(grad_norm):
            return self.optimization.skip(version, "gradient norm", grad_norm)
        self.optimization.step()
        stats = self.passes.parallel.sum({name: read[name] for name in summed})
        self.term.finish(stats, num_tokens)
        stats.update(finish_mismatch(read))
        return {  # the entropy's sum taken out before the rest is copied in: it is not a metric itself
            "actor/entropy": stats.pop("entropy_sum") / num_tokens,
            **stats,
            "actor/grad_norm": grad_norm,
            "actor/lr": self.optimization.lr,
            "actor/skipped_updates": 0.0,
        }

    def _micro_batch(self, batch: RolloutBatch, mini: MiniBatch, part: slice, used_routes: list | None):
        """One micro-batch's loss (divided by the whole mini-batch's counts), log-probs, entropies and
        the loss's metrics."""
        forward, data, rows = self.passes.forward, mini.data, mini.rows
        mask = data["mask"][part]  # [b, T]
        reference = forward.reference_logprobs(data, part)  # first: no replay of the policy's is in force
        scores = self.term.scores(forward, data, part, rows[part], batch)  # a teacher's, unreplayed
        logp, entropy = forward(data, part, True, used_routes, self.routes_key, mini.held)  # [b, T] each
        advantages = mini.advantages[part][:, None].expand_as(logp)  # [b, T]
        if batch.zvp_sign is not None:  # RL-ZVP: token advantages from the current policy's entropies
            sign = batch.zvp_sign[rows][part].to(self.passes.device)  # [b]
            token_advantages = zvp_token_advantages(entropy, mask, sign, self.zvp_alpha)
            advantages = torch.where((sign != 0)[:, None], token_advantages, advantages)
        # without old-policy values (recompute, one mini-batch) this forward *is* the old policy
        old_logp = data["old_logp"][part] if "old_logp" in data else logp.detach()
        old_entropy = data["old_entropy"][part] if "old_entropy" in data else entropy
        # the term's share (a teacher's), from the policy that sampled (the old one)
        advantages, added = self.term.advantages(scores, old_logp, advantages, mask)
        inputs = LossBatch(
            logp,
            old_logp,
            advantages,
            mask,
            entropy=old_entropy,
            ref_logp=reference.get("ref_logp"),
            rollout_logp=data["rollout_logp"][part],
            num_tokens=mini.num_tokens,
            num_sequences=len(rows),
        )
        loss, metrics = policy_loss(
            self.rl.loss, inputs, self.settings, host_metrics=False, **self.loss_options
        )
        return loss, logp, entropy, {**metrics, **added}
