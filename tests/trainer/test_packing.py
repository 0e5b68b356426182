"""Sequence packing in training forwards: the layout, equality with the padded path, and its guard."""

from __future__ import annotations

import pytest
import torch

from everyprompt.trainer.learner_side.logprobs import (
    PackingError,
    check_packing,
    pack,
    pack_layout,
    token_logprobs,
)


def test_pack_layout_is_first_fit_decreasing():
    # Sorted 5, 4, 3, 2 into rows of 6: 5 -> row 0; 4 -> row 1; 3 -> row 2 (no room in 0 or 1); 2 -> row 1.
    layout = pack_layout([5, 3, 4, 2], width=6)
    assert layout.row.tolist() == [0, 2, 1, 1]
    assert layout.offset.tolist() == [0, 0, 0, 4]
    assert layout.num_rows == 3


def test_pack_layout_rejects_a_sequence_wider_than_the_row():
    with pytest.raises(ValueError, match="7 tokens does not fit a packed row of 6"):
        pack_layout([3, 7], width=6)


def test_pack_restarts_positions_per_sequence():
    input_ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    packed, positions, _ = pack(input_ids, [3, 2, 4], pad_id=0)
    # 4 -> row 0; 3 -> row 1; 2 -> row 2 (a row of 4 has 1 column left after the 3-token sequence)
    assert packed.tolist() == [[6, 7, 8, 9], [1, 2, 3, 0], [4, 5, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    packed, positions, _ = pack(torch.tensor([[1, 2, 0, 0], [3, 4, 0, 0]]), [2, 2], pad_id=0)
    assert packed.tolist() == [[1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 0, 1]]
    # the packed rows' free columns hold the pad id asked for, not the input's own padding
    packed, _, _ = pack(torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 0, 0]]), [3, 1, 2], pad_id=99)
    assert packed.tolist() == [[1, 2, 3, 4], [5, 6, 99, 99]]


def _ragged_batch(tokenizer, texts):
    ids = [tokenizer(t).input_ids for t in texts]
    batch = torch.full((len(ids), max(map(len, ids))), tokenizer.pad_token_id, dtype=torch.long)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = torch.tensor(row)
    return batch, [len(row) for row in ids]


def test_packed_logprobs_and_gradients_equal_the_padded_ones(tiny_model):
    model, tokenizer = tiny_model
    texts = ["12+34=", "987+654+3=1644", "5+5=10", "1+2+3+4=10", "7=", "31+4=35"]
    input_ids, lengths = _ragged_batch(tokenizer, texts)
    mask = torch.zeros(len(texts), input_ids.shape[1] - 1)
    for i, n in enumerate(lengths):
        mask[i, : n - 1] = 1.0

    def run(packed: bool):
        model.zero_grad()
        logp, entropy = token_logprobs(
            model,
            input_ids,
            with_entropy=True,
            lengths=lengths if packed else None,
            pad_id=tokenizer.pad_token_id,
        )
        (logp * mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return logp.detach(), entropy, grads

    logp_ref, entropy_ref, grads_ref = run(packed=False)
    logp, entropy, grads = run(packed=True)
    assert pack_layout(lengths, input_ids.shape[1]).num_rows < len(texts)  # packing did happen
    torch.testing.assert_close(logp * mask, logp_ref * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy * mask, entropy_ref * mask, atol=1e-5, rtol=0)
    assert float((logp * (1 - mask)).abs().max()) == 0.0  # nothing leaks into padded targets
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class _IgnoresPositions(torch.nn.Module):
    """A model whose attention cannot see sequence boundaries: position_ids are dropped."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, position_ids=None, use_cache=False):
        return self.inner(input_ids=input_ids, use_cache=use_cache)


def test_check_packing_passes_a_qwen3_moe_and_names_a_leaking_model(tiny_model):
    model, tokenizer = tiny_model
    tokens = [tokenizer("12+34=").input_ids, tokenizer("56+7=").input_ids]
    assert check_packing(model, tokens, tokenizer.pad_token_id) < 1e-5
    with pytest.raises(PackingError, match="model.pack_sequences=false"):
        check_packing(_IgnoresPositions(model), tokens, tokenizer.pad_token_id)


def test_sft_losses_do_not_depend_on_packing(tmp_path):
    from everyprompt.config import LoggingConfig, SFTConfig
    from everyprompt.models import load_model_and_tokenizer
    from everyprompt.pipeline import Run
    from everyprompt.trainer.sft import run_sft
    from tests.conftest import tiny_config

    config = tiny_config()
    rows = Run(config, tmp_path).rows.sft()
    losses = {}
    for packed in (False, True):
        model, tokenizer = load_model_and_tokenizer(config.model, seed=0)
        history = run_sft(
            model,
            tokenizer,
            rows,
            SFTConfig(steps=3, batch_size=8),
            0,
            tmp_path / str(packed),
            logging=LoggingConfig(progress=False, tensorboard=False),
            pack_sequences=packed,
        )
        losses[packed] = [h["sft/loss"] for h in history]
    assert losses[True] == pytest.approx(losses[False], abs=1e-4)


def test_rl_old_logprobs_do_not_depend_on_packing(tmp_path):
    from everyprompt.pipeline import Run
    from tests.conftest import tiny_config

    values = {}
    for packed in (False, True):  # micro_batch_size 2 (the tiny default) never packs: use 16 rows in one
        trainer = Run(
            tiny_config(
                f"model.pack_sequences={str(packed).lower()}",
                "rl.loss=espo",
                "sft.steps=0",
                "rl.prompts_per_step=8",
                "rl.levels=[1,5]",
                "rollout.max_new_tokens=4",
                "rl.micro_batch_size=16",
            ),
            tmp_path / str(packed),
        ).trainer()
        batch = trainer.rollout.next_batch(0)
        trainer.learner.old_logprobs(batch)
        values[packed] = (torch.cat(batch.old_logprobs), torch.cat(batch.old_entropies))
        # one micro-batch of all 16 rows: packing must actually merge rows, or this test compares nothing
        data = batch.padded(list(range(len(batch))), trainer.tokenizer.pad_token_id)
        assert len(batch) <= trainer.rl.micro_batch_size
        assert pack_layout(data["lengths"].tolist(), data["input_ids"].shape[1]).num_rows < len(batch)
    torch.testing.assert_close(values[True][0], values[False][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(values[True][1], values[False][1], atol=1e-5, rtol=0)


def test_the_packed_mask_made_on_the_host_gives_transformers_own_log_probs(tiny_model, monkeypatch):
    """`packed_mask` stands for the mask transformers derives from restarting position ids: the log-probs
    of packed rows are the same bit for bit with either; a model with sliding-window layers or another
    attention gets none (transformers builds its own)."""
    from everyprompt.trainer.learner_side import logprobs as logprobs_module

    model, tokenizer = tiny_model
    texts = ["12+34=46", "5+6=11", "100+200=300", "7=7", "1+1+1=3"]
    tokens = [tokenizer(t).input_ids for t in texts]
    width = max(map(len, tokens))
    ids = torch.full((len(tokens), width), tokenizer.pad_token_id)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = torch.tensor(t)
    lengths = [len(t) for t in tokens]
    made = logprobs_module.packed_mask
    masks: list = []
    monkeypatch.setattr(logprobs_module, "packed_mask", lambda *args: masks.append(made(*args)) or masks[-1])
    with torch.no_grad():
        ours, _ = token_logprobs(model, ids, lengths=lengths, pad_id=tokenizer.pad_token_id)
        assert masks and masks[-1] is not None  # some row holds two sequences: the mask was made here
        monkeypatch.setattr(logprobs_module, "packed_mask", lambda *args: None)
        theirs, _ = token_logprobs(model, ids, lengths=lengths, pad_id=tokenizer.pad_token_id)
    assert torch.equal(ours, theirs)
    monkeypatch.undo()
    positions = torch.tensor([[0, 1, 2, 0, 1, 5]])  # two segments, then a tail that continues the row
    mask = logprobs_module.packed_mask(model, positions, "cpu")[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]  # sees its own segment, causally
    assert mask[5].tolist() == [False] * 5 + [True]  # the tail: a segment of its own
    # every row one sequence (its tail continuing it): no mask, transformers attends causally without one
    assert logprobs_module.packed_mask(model, torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]), "cpu") is None
    model.config.use_sliding_window = True
    try:
        assert logprobs_module.packed_mask(model, positions, "cpu") is None
    finally:
        model.config.use_sliding_window = False
