"""Tokenizers built locally (no download), saved in Hugging Face's `tokenizer.json` format.

`build_char_tokenizer`: one token per printable ASCII character plus newline, and four special tokens
(the demo preset's). `build_chat_tokenizer`: a byte-level BPE trained in about a second on a given corpus,
with ChatML turn markers, a thinking block and a chat template in the style of Qwen3's (a system turn, an
`enable_thinking` switch): what a chat checkpoint brings, for tests and CPU-sized twins of real recipes.
Both load back with `AutoTokenizer.from_pretrained(directory)` like any other fast tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = ["\n"] + [chr(code) for code in range(32, 127)]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=4096,
    )


CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML turns; with add_generation_prompt and enable_thinking=false the assistant turn opens with an
# empty thinking block (as Qwen3's template does)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

# ChatML that writes a past assistant turn without its thinking, as reasoning models' templates do (Qwen3's):
# a conversation's renderings then do not extend each other, and its episodes train step-wise
# (envs/stepwise.py); what tests and benches of that path give `build_chat_tokenizer`'s tokenizer
DROPS_THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` tokens trained on `corpus`, with ChatML specials (EOS
    `<|im_end|>`, pad `<|endoftext|>`) and `CHAT_TEMPLATE`."""
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHAT_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
