"""The chunked LM head (trainer/learner_side/head.py): the log-probs, entropies and gradients of the targets asked for
equal the full-logits path's, by the fused linear head and by the checkpointed one; no tensor as wide as
the vocabulary has more rows than a chunk; the fused head agrees with the checkpointed one under bf16
autocast and is used only for the heads it computes; a logit transform after the head is applied, and an
unknown one is caught by the once-a-run check."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from everyprompt.trainer.learner_side import head as head_module
from everyprompt.trainer.learner_side.head import HeadError, check_head
from everyprompt.trainer.learner_side.logprobs import pack_layout, token_logprobs
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


@pytest.fixture(params=["fused", "checkpointed"])
def head_path(request, monkeypatch):
    """Each test below runs through both implementations of the chunked head."""
    if request.param == "checkpointed":
        monkeypatch.setattr(head_module, "fused_head_fits", lambda *_: False)
    calls: list[int] = []
    original = head_module.LinearLogSoftmax.apply
    monkeypatch.setattr(
        head_module.LinearLogSoftmax, "apply", lambda *args: calls.append(1) or original(*args)
    )
    yield request.param
    assert bool(calls) == (request.param == "fused")  # the path named is the path taken


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("chunk", [3, 512])
def test_chunked_head_equals_the_full_logits(tiny_model, packed, chunk, head_path):
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


class _VocabularyRows(TorchDispatchMode):
    """Rows of every tensor an operator makes whose last dimension is the vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 1 and tensor.shape[-1] == self.vocab:
                self.rows.append(tensor.numel() // self.vocab)  # (weight-shaped ones filtered below)
        return out


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_no_vocabulary_wide_tensor_has_more_rows_than_a_chunk(tiny_model, head_path, temperature):
    model, tokenizer = tiny_model
    input_ids, lengths = _ragged_batch(tokenizer, TEXTS)
    model(input_ids=input_ids[:1, :2])  # (a first call's lazy set-up is not the pass measured)
    with _VocabularyRows(model.config.vocab_size) as seen:
        _run(model, input_ids, lengths, packed=True, chunk=4, temperature=temperature)
    packed_rows = pack_layout(lengths, input_ids.shape[1]).num_rows
    hidden = model.config.hidden_size  # the head's weight and its gradient, [H, V] seen transposed
    rows = [n for n in seen.rows if n != hidden]
    # the model's own head call makes [packed rows, 1, V]; everything else at most a chunk of 4 rows
    assert packed_rows in rows and all(n <= 4 for n in rows if n != packed_rows)
    assert rows.count(4) >= 2  # the chunks were seen (forward and backward)


def test_the_fused_head_agrees_with_the_checkpointed_one_under_bf16_autocast(tiny_model, monkeypatch):
    model, tokenizer = tiny_model
    input_ids, lengths = _ragged_batch(tokenizer, TEXTS)
    exact = _run(model, input_ids, lengths, packed=True, chunk=5)  # fp32 throughout
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _run(model, input_ids, lengths, packed=True, chunk=5)
        monkeypatch.setattr(head_module, "fused_head_fits", lambda *_: False)
        checkpointed = _run(model, input_ids, lengths, packed=True, chunk=5)
    mask = fused[2]
    # the same bf16 products, the same fp32 softmax: equal up to the order of fp32 sums
    torch.testing.assert_close(fused[0] * mask, checkpointed[0] * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused[1] * mask, checkpointed[1] * mask, atol=1e-5, rtol=0)
    head = "lm_head.weight"
    for name, grad in checkpointed[3].items():
        if name != head:
            torch.testing.assert_close(fused[3][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # the head's weight gradient: the fused head sums its chunks' bf16 products in fp32, autograd sums
    # them in bf16 (autocast casts the weight once, and its gradient accumulates in that dtype)
    error = (fused[3][head] - exact[3][head]).abs().max()
    assert error <= (checkpointed[3][head] - exact[3][head]).abs().max()
    assert error < 0.02 * exact[3][head].abs().max()


def test_the_fused_head_takes_only_plain_linear_heads():
    hidden = torch.zeros(2, 8)
    assert head_module.fused_head_fits(torch.nn.Linear(8, 16, bias=False), hidden)
    assert not head_module.fused_head_fits(torch.nn.Linear(8, 16, bias=True), hidden)

    class Wrapped(torch.nn.Linear):  # e.g. a LoRA layer: its forward is not weight @ h
        pass

    assert not head_module.fused_head_fits(Wrapped(8, 16, bias=False), hidden)
    hooked = torch.nn.Linear(8, 16, bias=False)
    hooked.register_forward_hook(lambda *_: None)
    assert not head_module.fused_head_fits(hooked, hidden)


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
