"""Router replay: the engine's routes reproduce its log-probs in the trainer, and gradients reach routers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from everyprompt.models.replay import ReplayError, RouterReplay
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from tests.conftest import TINY_LAYERS


def _completion(model, tokenizer, prompt="123+456+789=", seed=3):
    engine = NativeEngine.from_model(model, tokenizer)
    request = GenerationRequest(0, tokenizer(prompt).input_ids, seed)
    return next(iter(engine.generate([request], SamplingParams(10, record_routes=True))))


def _logprobs(model, ids):
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def _padded_routes(completion):
    routes = completion.routed_experts.long()
    return torch.cat([routes, torch.full((1, *routes.shape[1:]), -1)])  # the last token: own choice


def test_replaying_the_engines_routes_reproduces_its_log_probs(tiny_model):
    model, tokenizer = tiny_model
    completion = _completion(model, tokenizer)
    ids = completion.prompt_ids + completion.token_ids
    replay = RouterReplay(model)
    with torch.no_grad(), replay.replay(_padded_routes(completion)), replay.record() as seen:
        logp = _logprobs(model, ids)
    start = len(completion.prompt_ids) - 1
    torch.testing.assert_close(logp[start:], completion.logprobs, atol=1e-5, rtol=0)
    used = torch.stack(seen, dim=1)[:-1]  # [T - 1, L, k] as the replayed routers used them
    agreement = (
        (used.sort(-1).values == completion.routed_experts.long().sort(-1).values).all(-1).float().mean()
    )
    assert agreement == 1.0


def test_replay_takes_effect_and_minus_one_keeps_the_routers_choice(tiny_model):
    model, tokenizer = tiny_model
    completion = _completion(model, tokenizer)
    ids = completion.prompt_ids + completion.token_ids
    replay = RouterReplay(model)
    with torch.no_grad():
        own = _logprobs(model, ids)
        with replay.replay(torch.full((len(ids), 2, 2), -1)):
            assert torch.equal(_logprobs(model, ids), own)
        forced = torch.tensor([0, 1]).expand(len(ids), 2, 2)  # every token to experts 0 and 1
        with replay.replay(forced):
            assert (_logprobs(model, ids) - own).abs().max() > 1e-3


def test_gradients_reach_the_router_weights_under_replay(tiny_model):
    model, tokenizer = tiny_model
    completion = _completion(model, tokenizer)
    ids = completion.prompt_ids + completion.token_ids
    replay = RouterReplay(model)
    model.zero_grad()
    with replay.replay(_padded_routes(completion)):
        _logprobs(model, ids).sum().backward()
    for router in replay.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_bad_replay_indices_and_dense_models_are_clear_errors(tiny_model):
    model, _ = tiny_model
    replay = RouterReplay(model)
    with pytest.raises(ReplayError, match=r"must be \[tokens, 2 MoE layers, top-2\], got \[5, 3, 2\]"):
        with replay.replay(torch.zeros(5, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(ReplayError, match=r"expert ids in \[0, 4\) or -1, got values 0..7"):
        with replay.replay(torch.tensor([[[0, 7], [1, 2]]])):
            pass
    with pytest.raises(ReplayError, match="cover 3 tokens, the forward has 4"):
        with torch.no_grad(), replay.replay(torch.zeros(3, 2, 2, dtype=torch.long)):
            model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=16, intermediate_size=32, **TINY_LAYERS))
    with pytest.raises(ReplayError, match="LlamaForCausalLM: no mixture-of-experts router"):
        RouterReplay(dense)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "olmoe", "gpt_oss"])
def test_replay_fits_mixtral_qwen2_moe_olmoe_and_gpt_oss_routers(kind):
    from tests.families import family_model

    model, _ = family_model(kind)
    ids = [3, 7, 1, 30, 12, 5, 9, 2]
    replay = RouterReplay(model)
    assert len(replay.routers) == 2
    with torch.no_grad(), replay.record() as seen:
        own = _logprobs(model, ids)
    routes = torch.stack(seen, dim=1)  # [T, L, k] as the model chose
    with torch.no_grad(), replay.replay(routes):
        torch.testing.assert_close(_logprobs(model, ids), own, atol=1e-6, rtol=0)
    other = (routes + 1) % 4  # every expert id shifted: a different pair for each token
    with torch.no_grad(), replay.replay(other):
        assert (_logprobs(model, ids) - own).abs().max() > 1e-4
    model.zero_grad()
    with replay.replay(routes):
        _logprobs(model, ids).sum().backward()
    for router in replay.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_gate_functions_hand_computed():
    import math
    from types import SimpleNamespace

    from everyprompt.models.replay import chosen_softmax_gates, sigmoid_gates, softmax_gates

    logits = torch.tensor([[0.0, 0.0, math.log(2.0)]])  # softmax: 0.25, 0.25, 0.5
    chosen = torch.tensor([[2, 0]])
    plain = softmax_gates(SimpleNamespace(norm_topk_prob=False), logits, chosen)
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.25]]))
    torch.testing.assert_close(
        softmax_gates(SimpleNamespace(), logits, chosen), torch.tensor([[2 / 3, 1 / 3]])
    )
    deepseek = SimpleNamespace(norm_topk_prob=True, routed_scaling_factor=2.5)
    sigmoid = sigmoid_gates(deepseek, torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[0, 1]]))
    torch.testing.assert_close(sigmoid, torch.tensor([[1.0, 1.5]]))  # (0.5, 0.75) / 1.25 * 2.5
    oss = chosen_softmax_gates(None, torch.tensor([[1.0, 0.0, math.log(3.0)]]), torch.tensor([[0, 2]]))
    torch.testing.assert_close(oss, torch.tensor([[math.e / (math.e + 3), 3 / (math.e + 3)]]))
