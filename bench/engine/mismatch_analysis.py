"""The per-token analysis of bench/engine/mismatch.py: the router perturbation between the engine's and the
trainer's router logits, how a route flip compounds through later layers, and flipped tokens against
unflipped ones matched on entropy, log-prob and perturbation (with bootstrap intervals)."""

from __future__ import annotations

from contextlib import nullcontext


def downstream_ratio(perturbation, flipped) -> float:
    """How a route flip compounds through the later layers: over tokens whose first flip is at MoE layer
    f < L - 1, the mean router perturbation at layers f+1..L-1, divided by the unflipped tokens' mean at
    those same layers. perturbation [N, L] float, flipped [N, L] bool. Without replay a flip sends the
    token through other experts and the later layers' inputs drift apart (ratio above 1); with replay
    the later layers see only the precision error (ratio 1)."""
    import torch

    layers = flipped.shape[1]
    any_flip = flipped.any(-1)
    first = torch.where(
        any_flip, flipped.float().argmax(-1), torch.full_like(any_flip, layers, dtype=torch.long)
    )
    later = torch.arange(layers)[None, :] > first[:, None]  # [N, L]: layers after the first flip
    chosen = any_flip & (first < layers - 1)
    if not chosen.any() or any_flip.all():
        return float("nan")
    control = perturbation[~any_flip].mean(0)  # [L]: unflipped tokens' mean per layer
    weight = later[chosen].float()
    return float((perturbation[chosen] * weight).sum() / (control[None, :] * weight).sum())


def record_router_logits(engine) -> dict:
    """Make every `engine.generate` call also record the router logits of each token it feeds (as the
    decode steps that sampled it computed them); returns the dict they land in, keyed by (prompt ids,
    completion ids)."""
    from dataclasses import replace

    store: dict = {}
    generate = engine.generate

    def recording(requests, params):
        for completion in generate(requests, replace(params, record_router_logits=True)):
            store[(tuple(completion.prompt_ids), tuple(completion.token_ids))] = completion.router_logits
            yield completion

    engine.generate = recording
    return store


def router_perturbation(trainer, batch, engine_logits: dict, replayed: bool = True):
    """Per completion token and MoE layer [N, L_moe]: how far the engine's router logits are from the
    trainer's at that token's position (L2 distance). With the engine's routes replayed (`replayed`)
    both compute the same network, and the distance is the precision error at the routers' input, what
    makes a top-k choice flip and what replay cannot remove; without, it also holds the drift that
    earlier flips caused. The engine's logits are those its decode steps computed while
    sampling (`record_router_logits`), so the distance is exactly the one the sampled routes saw."""
    import torch

    from everyprompt.models.replay import RouterReplay

    model = trainer.model
    replay, out = RouterReplay(model), []
    trainer_logits: list = []
    hooks = [
        r.register_forward_hook(lambda _m, _i, o: trainer_logits.append(o[0].float().cpu()))
        for r in replay.routers
    ]
    try:
        for prompt, completion, routes in zip(batch.prompt_ids, batch.completion_ids, batch.routed_experts):
            ids = prompt + completion
            engine = engine_logits[(tuple(prompt), tuple(completion))]  # [len(ids) - 1, L_moe, E]
            trainer_logits.clear()
            with torch.no_grad(), replay.replay(routes) if replayed else nullcontext():
                model(input_ids=torch.tensor([ids[:-1]], device=model.device))
            distance = torch.stack(
                [
                    (engine[:, layer] - t.reshape(engine[:, layer].shape)).norm(dim=-1)
                    for layer, t in enumerate(trainer_logits)
                ],
                dim=1,
            )  # [len(ids) - 1, L_moe]
            out.append(distance[len(prompt) - 1 :])
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(out)


def _ranks(values, reference):
    """Each value's empirical CDF position within `reference` (0..1)."""
    import torch

    ordered = torch.sort(reference).values.contiguous()
    return torch.searchsorted(ordered, values.contiguous()).float() / len(ordered)


def _matched_control(mask, features, control_diff, neighbours: int):
    """Per flipped token (`mask`), the mean |dlogp| of the `neighbours` unflipped tokens nearest to it in
    `features` (per-token tensors, each as its rank among the unflipped tokens' values)."""
    import torch

    flipped_features = torch.stack([_ranks(f[mask], f[~mask]) for f in features], dim=1)
    control_features = torch.stack([_ranks(f[~mask], f[~mask]) for f in features], dim=1)
    means = []
    for chunk in torch.split(flipped_features, 256):
        nearest = torch.cdist(chunk, control_features).topk(neighbours, largest=False).indices
        means.append(control_diff[nearest].mean(-1))
    return torch.cat(means)


def _ratio_ci(flipped_diff, control, resamples: int) -> list[float]:
    """95% bootstrap interval of mean(flipped) / mean(matched control), resampling the flipped tokens."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(resamples):
        pick = torch.randint(len(flipped_diff), (len(flipped_diff),), generator=generator)
        ratios.append(float(flipped_diff[pick].mean() / control[pick].mean()))
    return torch.quantile(torch.tensor(ratios), torch.tensor([0.025, 0.975])).tolist()


def flipped_token_analysis(
    diff,
    mask,
    entropy,
    perturbation=None,
    logprob=None,
    neighbours: int = 10,
    resamples: int = 2000,
    cap_quantile: float = 0.999,
) -> dict:
    """r3's |dlogp| on the tokens whose routing flipped without replay, against unflipped tokens.

    Raw means first. |dlogp| grows steeply with the token's entropy and flips are not spread evenly over
    entropies, so each flipped token is also compared with the `neighbours` unflipped tokens nearest to it
    in engine entropy; and, with `perturbation` (see `router_perturbation`), nearest in entropy and router
    perturbation together (both as ranks): flips happen where the precision error is largest, and a
    token with a larger precision error has a larger |dlogp| whatever its routing. With `logprob` too (the
    engine's log-prob of the sampled token), nearest in all three: how far a given logit error moves a
    token's log-prob depends on that token's probability (the rare samples carry most of the mean). Each
    is a property of the token fixed before any trainer pass. That last ratio is also given with every
    |dlogp| capped at its `cap_quantile` quantile over all tokens, flipped or not. The ratios' 95%
    intervals come from resampling the flipped tokens."""
    import torch

    flipped_diff, flipped_entropy = diff[mask], entropy[mask]
    control_entropy, control_diff = entropy[~mask], diff[~mask]
    # entropy alone: the `neighbours` unflipped tokens around each flipped one in entropy order
    order = torch.argsort(control_entropy)
    start = (
        torch.searchsorted(control_entropy[order].contiguous(), flipped_entropy.contiguous())
        - neighbours // 2
    )
    start = start.clamp(0, len(order) - neighbours)
    sorted_diff = control_diff[order]
    by_entropy = torch.stack([sorted_diff[start + i] for i in range(neighbours)]).mean(0)
    result = {
        "flipped_tokens": int(mask.sum()),
        "tokens": len(mask),
        "logp_abs_diff_on_off_flipped_tokens": float(flipped_diff.mean()),
        "logp_abs_diff_on_off_unflipped_tokens": float(control_diff.mean()),
        "logp_abs_diff_entropy_matched_unflipped": float(by_entropy.mean()),
        "flipped_over_matched_ratio": float(flipped_diff.mean() / by_entropy.mean()),
        "flipped_over_matched_ratio_ci95": _ratio_ci(flipped_diff, by_entropy, resamples),
        "median_logp_abs_diff_on_off_flipped_tokens": float(flipped_diff.median()),
        "median_logp_abs_diff_on_off_unflipped_tokens": float(control_diff.median()),
        "entropy_flipped": float(flipped_entropy.mean()),
        "entropy_unflipped": float(control_entropy.mean()),
    }
    if perturbation is not None:
        flipped_p, control_p = perturbation[mask], perturbation[~mask]
        both = _matched_control(mask, (entropy, perturbation), control_diff, neighbours)
        result.update(
            {
                "router_perturbation_flipped": float(flipped_p.mean()),
                "router_perturbation_unflipped": float(control_p.mean()),
                "logp_abs_diff_perturbation_matched_unflipped": float(both.mean()),
                "flipped_over_perturbation_matched_ratio": float(flipped_diff.mean() / both.mean()),
                "flipped_over_perturbation_matched_ratio_ci95": _ratio_ci(flipped_diff, both, resamples),
            }
        )
        if logprob is not None:
            features = (entropy, logprob, perturbation)
            full = _matched_control(mask, features, control_diff, neighbours)
            # the same with every |dlogp| capped at the sample's 99.9th percentile: a single token can
            # move the mean (a rare sample at a position the model never trained on can differ by ~10
            # nats between fp8 and fp32 weights), the cap keeps the comparison about the typical token
            cap = float(torch.quantile(diff, cap_quantile))
            capped_full = _matched_control(mask, features, control_diff.clamp(max=cap), neighbours)
            capped_flipped = flipped_diff.clamp(max=cap)
            result.update(
                {
                    "logp_abs_diff_fully_matched_unflipped": float(full.mean()),
                    "flipped_over_fully_matched_ratio": float(flipped_diff.mean() / full.mean()),
                    "flipped_over_fully_matched_ratio_ci95": _ratio_ci(flipped_diff, full, resamples),
                    "logp_abs_diff_cap": cap,
                    "flipped_over_fully_matched_ratio_capped": float(
                        capped_flipped.mean() / capped_full.mean()
                    ),
                    "flipped_over_fully_matched_ratio_capped_ci95": _ratio_ci(
                        capped_flipped, capped_full, resamples
                    ),
                }
            )
    return result
