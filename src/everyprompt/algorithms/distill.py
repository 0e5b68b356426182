"""On-policy distillation's per-token advantage (docs/algorithms.md, "On-policy distillation").

The student samples; a teacher scores each sampled token. With s_t = log pi_student(y_t | y_<t) under the
policy that sampled and q_t = log pi_teacher(y_t | y_<t), the single-sample estimate of the reverse KL
KL(pi_student || pi_teacher) at token t is s_t - q_t, and its negation, scaled by `coef`, is the token's
advantage:

    A_t = -coef * (s_t - q_t)

given to the policy loss like any other advantage (alone, or added to the reward's). Its policy gradient is
that of the per-token reverse KL (Agarwal et al. 2024, arXiv 2306.13649, "GKD"; Lu and Thinking Machines Lab
2025, "On-policy distillation"). The student's log-probs are the old policy's (detached): the advantage is a
constant of the update, as a reward's is.
"""

from __future__ import annotations

import torch


def distillation_advantages(
    student_logp: torch.Tensor,  # [B, T] the sampling policy's log-probs of the sampled tokens
    teacher_logp: torch.Tensor,  # [B, T] the teacher's log-probs of the same tokens
    covered: torch.Tensor,  # [B] bool: the rows that have a teacher
    coef: float,
) -> torch.Tensor:  # [B, T]
    """-coef * (student_logp - teacher_logp) on the rows that have a teacher, 0 on the others (detached)."""
    gap = (student_logp - teacher_logp).detach()
    return torch.where(covered[:, None], -coef * gap, torch.zeros_like(gap))


def distillation_sums(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    covered: torch.Tensor,
    mask: torch.Tensor,  # [B, T] 1 on the trained tokens
    distilled: torch.Tensor,  # [B, T] the distillation advantage
    estimated: torch.Tensor,  # [B, T] the estimator's advantage beside it
    teachers: dict[str, torch.Tensor] | None = None,  # several teachers: name -> [B] bool, its rows
) -> dict[str, torch.Tensor]:
    """Sums over the trained tokens (detached, on their device) from which `distillation_metrics` makes the
    step's figures once every micro-batch's are added up (and reduced across ranks); with several
    `teachers`, each one's KL and token sums too (present for every teacher, 0 where it has no rows)."""
    with torch.no_grad():
        gap = student_logp - teacher_logp
        taught = mask * covered[:, None].to(mask.dtype)
        sums = {
            "distill/kl_sum": (gap * taught).sum(),
            "distill/tokens_sum": taught.sum(),
            "distill/abs_sum": (distilled.abs() * mask).sum(),
            "distill/estimator_abs_sum": (estimated.abs() * mask).sum(),
        }
        for name, rows in (teachers or {}).items():
            mine = mask * rows[:, None].to(mask.dtype)
            sums[f"distill/{name}/kl_sum"] = (gap * mine).sum()
            sums[f"distill/{name}/tokens_sum"] = mine.sum()
        return sums


def distillation_metrics(sums: dict[str, float], trained_tokens: float) -> dict[str, float]:
    """`distill/reverse_kl`: the mean per-token reverse-KL estimate over the tokens that have a teacher;
    `distill/token_share`: their share of the trained tokens; `distill/advantage_share`: the distillation
    term's share of the summed absolute advantage (0 when both are 0); with several teachers,
    `distill/NAME/reverse_kl` and `distill/NAME/token_share` of each. Pops the sums from `sums`."""

    def kl_and_share(prefix: str) -> tuple[float, float]:
        kl, tokens = sums.pop(f"{prefix}/kl_sum"), sums.pop(f"{prefix}/tokens_sum")
        return (kl / tokens if tokens else 0.0), (tokens / trained_tokens if trained_tokens else 0.0)

    names = [  # several teachers' own sums: distill/NAME/kl_sum
        key[len("distill/") : -len("/kl_sum")]
        for key in sums
        if key.startswith("distill/") and key.endswith("/kl_sum") and key != "distill/kl_sum"
    ]
    distilled, estimated = sums.pop("distill/abs_sum"), sums.pop("distill/estimator_abs_sum")
    total = distilled + estimated
    kl, share = kl_and_share("distill")
    figures = {
        "distill/reverse_kl": kl,
        "distill/token_share": share,
        "distill/advantage_share": distilled / total if total else 0.0,
    }
    for name in names:
        figures[f"distill/{name}/reverse_kl"], figures[f"distill/{name}/token_share"] = kl_and_share(
            f"distill/{name}"
        )
    return figures
