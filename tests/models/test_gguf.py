"""GGUF files as models (models/gguf.py): a tiny Llama written here as llama.cpp would, loaded, converted,
trained and evaluated; bad files refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from everyprompt.cli import main
from everyprompt.models.io import load_pretrained
from everyprompt.run.layout import eval_dir
from tests.conftest import TINY_OVERRIDES
from tests.models.gguf_files import CHATML, bpe_tokenizer, llama_model, write_llama_gguf

PROMPT = "What is 12 + 7?"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(the GGUF file, the model it was written from, its tokenizers.Tokenizer)."""
    tokenizer = bpe_tokenizer()
    model = llama_model(tokenizer.get_vocab_size())
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tokenizer)
    return path, model, tokenizer


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_a_gguf_file_loads_as_the_model_it_was_written_from(tiny_gguf):
    path, original, bpe = tiny_gguf
    model, tokenizer = load_pretrained(path)
    ids = bpe.encode(PROMPT).ids
    assert tokenizer(PROMPT, add_special_tokens=False).input_ids == ids
    assert model.dtype == torch.float32
    # float32 tensors, and q / k rows put back in the Hugging Face order: the same numbers exactly
    assert torch.equal(_logits(model, ids), _logits(original, ids))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    assert chat == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.pad_token_id is not None


def test_convert_writes_a_checkpoint_with_the_same_logits_and_chat_template(tiny_gguf, tmp_path, capsys):
    path, _, bpe = tiny_gguf
    out = tmp_path / "checkpoint"
    assert main(["convert", str(path), str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    converted, tokenizer = load_pretrained(out)
    loaded, _ = load_pretrained(path)
    ids = bpe.encode(PROMPT).ids
    assert torch.equal(_logits(converted, ids), _logits(loaded, ids))
    assert tokenizer.chat_template == CHATML
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]  # no temporary directory left


def test_a_quantised_gguf_is_dequantised_to_float32(tmp_path):
    import gguf

    bpe = bpe_tokenizer()
    original = llama_model(bpe.get_vocab_size(), seed=1)
    path = write_llama_gguf(tmp_path / "q8.gguf", original, bpe, quantization=gguf.GGMLQuantizationType.Q8_0)
    model, _ = load_pretrained(path)
    down = original.model.layers[0].mlp.down_proj.weight.detach().numpy()
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(down, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    loaded = model.model.layers[0].mlp.down_proj.weight
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded, torch.from_numpy(expected))  # the file's numbers, dequantised
    assert not torch.equal(loaded, original.model.layers[0].mlp.down_proj.weight)  # Q8_0 is lossy
    ids = bpe.encode(PROMPT).ids
    torch.testing.assert_close(_logits(model, ids), _logits(original, ids), atol=2e-2, rtol=0)


def _bad_files(tmp_path, good):
    """(file, what the error says) for each kind of bad model file."""
    import shutil

    import gguf

    text = tmp_path / "notes.gguf"
    text.write_text("these are notes, not a model\n")
    truncated = tmp_path / "truncated.gguf"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    foreign = tmp_path / "foreign.gguf"
    shutil.copy(good, foreign)
    bpe = bpe_tokenizer()
    write_llama_gguf(foreign, llama_model(bpe.get_vocab_size()), bpe, architecture="notanarch")
    unsupported = tmp_path / "q8_1.gguf"  # a quantisation the gguf package cannot dequantise
    q8_1 = gguf.GGMLQuantizationType.Q8_1  # llama.cpp's type for intermediate results
    write_llama_gguf(unsupported, llama_model(bpe.get_vocab_size()), bpe, quantization=q8_1)
    return [
        (tmp_path / "missing.gguf", "no such GGUF file"),
        (text, "not a GGUF file"),
        (truncated, "truncated or damaged"),
        (foreign, "architecture 'notanarch' is not one transformers reads from GGUF"),
        (unsupported, "a quantisation type this gguf package cannot dequantise"),
    ]


def test_a_bad_model_file_exits_2_naming_it_and_convert_writes_nothing(tiny_gguf, tmp_path, capsys):
    path = tiny_gguf[0]
    for bad, reason in _bad_files(tmp_path, path):
        out = tmp_path / f"out-{bad.stem}"
        assert main(["convert", str(bad), str(out)]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert str(bad) in err[0] and reason in err[0], err
        assert not out.exists() and not list(tmp_path.glob(f".out-{bad.stem}*"))
        assert main(["eval", str(bad), "--run-dir", str(tmp_path / "ev")]) == 2
        assert reason in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("a user's file")
    assert main(["convert", str(path), str(busy)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_eval_and_train_take_a_gguf_file(tiny_gguf, tmp_path, capsys):
    path = tiny_gguf[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a} + {a}?", "answer": str(2 * a)}) + "\n" for a in range(4))
    )
    assert eval_dir(path) == path.parent / "tiny-eval"  # the default, beside the file
    common = [*TINY_OVERRIDES, "rl.router_replay=off", "rewards.function=math", f"data.train_file={prompts}"]
    argv = ["eval", str(path), "--data", str(prompts), *common, "eval.num_samples=0", "--run-dir"]
    assert main([*argv, str(tmp_path / "ev")]) == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert results["num_prompts"] == 4.0 and not [k for k in results if k.startswith("pass@")]  # greedy only
    records = [json.loads(line) for line in (tmp_path / "ev" / "completions.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in records] == ["0", "2", "4", "6"]
    # auto chose the chat format from the file's template, with no model.path set
    assert records[0]["prompt"] == "<|im_start|>user\n0 + 0?<|im_end|>\n<|im_start|>assistant\n"
    assert all(set(r) == {"prompt", "completion", "extracted_answer", "answer", "reward"} for r in records)
    err = capsys.readouterr().err
    assert "prompt 1 as the model saw it" in err and "'<|im_start|>user\\n0 + 0?<|im_end|>" in err
    run = tmp_path / "run"
    code = main(["train", *common, f"model.path={path}", "sft.steps=0", "rl.steps=1", "--run-dir", str(run)])
    assert code == 0, capsys.readouterr().err
    assert "data.format=chat" in capsys.readouterr().err  # the file's chat template is used
    checkpoint = run / "checkpoints" / "step_1"
    assert (checkpoint / "model.safetensors").is_file()  # a GGUF-loaded model saves (no quantizer left)
    trained, _ = load_pretrained(checkpoint)
    assert trained.config.model_type == "llama"
