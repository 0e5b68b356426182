"""A character-level tokenizer saved in Hugging Face's `tokenizer.json` format.

One token per printable ASCII character plus newline, and four special tokens. It loads back with
`AutoTokenizer.from_pretrained(directory)` like any other fast tokenizer.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
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
