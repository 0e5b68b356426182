from functools import partial

import pytest
import torch

from everyprompt.rollout.sampling import nucleus_filter, sample_tokens, uniform_noise, vocab_hashes


def test_noise_is_uniform_and_deterministic():
    seeds, positions = torch.arange(2000), torch.zeros(2000, dtype=torch.long)
    noise = uniform_noise(seeds, positions, 64)
    assert noise.min() > 0 and noise.max() < 1
    assert abs(float(noise.mean()) - 0.5) < 0.005
    assert abs(float(noise.var()) - 1 / 12) < 0.002
    assert torch.equal(noise, uniform_noise(seeds, positions, 64))
    assert not torch.equal(noise, uniform_noise(seeds, positions + 1, 64))


def test_samples_follow_the_distribution():
    n = 40000
    logits = torch.tensor([0.0, 1.0, 2.0]).repeat(n, 1)
    tokens, logprobs, _ = sample_tokens(
        logits, torch.arange(n), torch.zeros(n, dtype=torch.long), 1.0, 1.0, False
    )
    frequencies = torch.bincount(tokens, minlength=3) / n
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), -1)  # 0.090, 0.245, 0.665
    torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logprobs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(nucleus_filter(logprobs, 0.7))
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the first two tokens are kept
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(nucleus_filter(logprobs, 1.0)).all()


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    tokens, _, _ = sample_tokens(logits, torch.arange(2), torch.zeros(2, dtype=torch.long), 1.0, 1.0, True)
    assert tokens.tolist() == [1, 0]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": 0.0}, "use greedy=True"),
        ({"temperature": -1.0}, "temperature must be > 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_sampling_params_are_clear_errors(kwargs, needle):
    from everyprompt.rollout import SamplingParams

    with pytest.raises(ValueError, match=needle):
        SamplingParams(**{"max_new_tokens": 8, **kwargs})
    SamplingParams(8, temperature=0.0, greedy=True)  # greedy ignores the temperature


@pytest.mark.parametrize("vocab", [100, 2047, 2048, 2049, 4097, 49152])
def test_blockwise_gumbel_argmax_draws_the_tokens_of_the_whole_row_noise(vocab):
    """The CPU's block-by-block sampler against the plain formula: argmax(log-probs + Gumbel(noise of
    the whole [B, V] row)), the same tokens bit for bit (temperature and nucleus included)."""
    generator = torch.Generator().manual_seed(vocab)
    for top_p in (1.0, 0.8):
        logits = torch.randn(6, vocab, generator=generator) * 4
        seeds = torch.randint(0, 2**62, (6,), generator=generator)
        positions = torch.randint(0, 1000, (6,), generator=generator)
        logprobs = torch.log_softmax(logits / 0.7, dim=-1)
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))
        expected = (nucleus_filter(logprobs, top_p).double() + gumbel).argmax(dim=-1)
        tokens, _, _ = sample_tokens(logits, seeds, positions, 0.7, top_p, greedy=False)
        assert torch.equal(tokens, expected)


def test_the_noise_stream_is_pinned():
    """Runs resume and reproduce through this stream: its top-24-bit values for two (seed, position)
    rows, as the first implementation (commit 18a7143) drew them, must never change."""
    noise = uniform_noise(torch.tensor([1, 2**40 + 7]), torch.tensor([0, 5]), 3)
    integers = (noise * 2**24 - 0.5).round().long().tolist()
    assert integers == [[3877810, 5025935, 13442832], [4515954, 8640188, 16430149]]


def test_the_vocabularys_hashes_made_once_sample_what_the_sampler_makes_itself():
    vocab = 3000  # more than one of the CPU's noise blocks
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    seeds, positions = torch.tensor([1, 2, 3, 2**40, 5, 6]), torch.tensor([0, 4, 9, 1, 0, 2])
    per_row = (torch.full((6, 1), 0.8), torch.full((6, 1), 0.9), torch.tensor([0, 1, 0, 0, 1, 0]).bool())
    for settings in ((0.7, 1.0, False), (1.0, 0.9, False), per_row):
        made_here = sample_tokens(logits, seeds, positions, *settings)
        kept = sample_tokens(logits, seeds, positions, *settings, vocab=vocab_hashes(vocab))
        for a, b in zip(made_here, kept):
            assert torch.equal(a, b)


def test_the_compiled_sampler_holds_no_index_sequence_when_given_the_vocabularys_hashes():
    """On CUDA, Inductor turned `arange(V) + <64-bit constant>` (the vocabulary's hash) into index
    arithmetic Triton cannot compile (H200, torch 2.11: the compiled decode step was given up). With the
    hashes made once outside, the graph torch.compile hands its backend has no `arange` left."""

    def graph_ops(**kwargs) -> set[str]:
        seen: set[str] = set()

        def backend(gm, example_inputs):
            seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(partial(sample_tokens, **kwargs), backend=backend, fullgraph=True)
        logits = torch.randn(4, 100)
        compiled(logits, torch.arange(4), torch.arange(4), 0.7, 1.0, False)
        return seen

    assert any("arange" in op for op in graph_ops())  # the check sees the sequence where it is made
    assert not any("arange" in op for op in graph_ops(vocab=vocab_hashes(100)))
