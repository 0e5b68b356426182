"""The chunked LM head (trainer/head.py): the log-probs, entropies and gradients of the targets asked for
equal the full-logits path's; no head call sees more than a chunk of positions; a logit transform after
the head is applied, and an unknown one is caught by the once-a-run check."""

from __future__ import annotations

import pytest
import torch

from everyprompt.trainer import head as head_module
from everyprompt.trainer.head import HeadError, check_head
from everyprompt.trainer.logprobs import token_logprobs
from tests.families import family_model
from tests.trainer.test_packing import _ragged_batch

TEXTS = ["12+34=46", "987+654+3=1644", "5+5=10", "1+2+3+4=10", "7=7", "31+4=35"]
PROMPT = [4, 6, 3, 5, 2, 4]  # tokens of each row before its first trained target


def _run(model, input_ids, lengths, packed: bool, chunk: int, temperature=0.7):
    model.zero_grad()
    logp, entropy = token_logprobs(
        model,
        input_ids,
        temperature,
        with_entropy=True,
        lengths=lengths if packed else None,
        pad_id=0,
        chunk=chunk,
        first_targets=[n - 1 for n in PROMPT],
    )
    mask = torch.zeros_like(logp)
    for i, n in enumerate(lengths):
        mask[i, PROMPT[i] - 1 : n - 1] = 1.0
    (logp * mask * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logp, entropy, mask, grads


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("chunk", [3, 512])
def test_chunked_head_equals_the_full_logits(tiny_model, packed, chunk):
    model, tokenizer = tiny_model
    input_ids, lengths = _ragged_batch(tokenizer, TEXTS)
    full_logp, full_entropy, mask, full_grads = _run(model, input_ids, lengths, packed, chunk=0)
    logp, entropy, _, grads = _run(model, input_ids, lengths, packed, chunk=chunk)
    torch.testing.assert_close(logp * mask, full_logp * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy * mask, full_entropy * mask, atol=1e-5, rtol=0)
    for i, n in enumerate(lengths):  # targets not asked for are never computed (the prompt's; packed
        assert torch.all(logp[i, : PROMPT[i] - 1] == 0)  # rows know their lengths, padded ones do not)
        assert not packed or torch.all(logp[i, n - 1 :] == 0)
    assert grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_no_head_call_sees_more_than_a_chunk(tiny_model):
    model, tokenizer = tiny_model
    input_ids, lengths = _ragged_batch(tokenizer, TEXTS)
    rows: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    )
    try:
        _run(model, input_ids, lengths, packed=True, chunk=4)
    finally:
        handle.remove()
    asked = sum(n - p for n, p in zip(lengths, PROMPT))  # the completion targets
    # the model's own head call sees one position per packed row; then only chunks of at most 4, each
    # target's logits made twice (forward, and again in the backward) and never more
    assert rows[0] < len(TEXTS) and all(n <= 4 for n in rows[1:])
    assert sum(rows[1:]) == 2 * asked


def _softcapped_gemma2():
    model, _ = family_model("gemma2", intermediate_size=64, head_dim=8, final_logit_softcapping=2.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits well beyond the small cap, so it changes log-probs a lot
    return model


def test_a_logit_transform_after_the_head_is_applied_and_an_unknown_one_caught(monkeypatch):
    model = _softcapped_gemma2()
    tokens = [3, 9, 27, 1, 40, 12]
    assert check_head(model, tokens, chunk=2) < 1e-5
    monkeypatch.delitem(head_module.HEAD_TRANSFORMS, "final_logit_softcapping")
    with pytest.raises(HeadError, match=r"Gemma2ForCausalLM: .* differ .* set model.logprob_chunk=0"):
        check_head(model, tokens, chunk=2)
