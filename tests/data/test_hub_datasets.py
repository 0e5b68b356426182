"""Data files of Hub dataset repos (`hf://datasets/ORG/NAME[@REVISION]/PATH`), and a run's config recording
the commit of every Hub name it used; the Hub offline, the cache built in `huggingface_hub`'s layout."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from everyprompt.cli import main
from everyprompt.hub import HubError, dataset_file, resolve_data, resolve_model
from tests.conftest import TINY_OVERRIDES, cache_repo, make_tiny_model

COMMIT = "c" * 40
MODEL_COMMIT = "d" * 40
TRAIN = "hf://datasets/org/problems/main/train.parquet"


def _rows(n: int) -> list[dict]:
    return [{"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(n)]


@pytest.fixture
def hub(offline_cache, tmp_path):
    """The cache with a dataset repo (GSM8K's layout: main/train.parquet, main/test.parquet, column names
    question / answer) and a tiny model repo."""
    files = tmp_path / "dataset"
    (files / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(_rows(12)), files / "main" / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(4)), files / "main" / "test.parquet")
    cache_repo(offline_cache, "org/problems", files, COMMIT, kind="dataset")
    model, tokenizer = make_tiny_model()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    cache_repo(offline_cache, "org/tiny", tmp_path / "model", MODEL_COMMIT)
    return offline_cache


def test_a_dataset_file_resolves_into_the_cache_at_a_branch_or_a_commit(hub):
    path = resolve_data(TRAIN)
    assert path.parts[-4:] == ("snapshots", COMMIT, "main", "train.parquet") and path.is_file()
    assert resolve_data(f"hf://datasets/org/problems@{COMMIT}/main/train.parquet") == path
    assert resolve_data("local.jsonl").name == "local.jsonl"  # anything else is a path, as before
    assert dataset_file("hf://datasets/org/problems@v1.0/main/train.parquet") == (
        "org/problems",
        "v1.0",
        "main/train.parquet",
    )


def test_a_one_step_run_reads_hub_data_and_records_every_commit(hub, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [
        "train",
        *TINY_OVERRIDES,
        "model.path=org/tiny",
        f"data.train_file={TRAIN}",
        "data.eval_file=hf://datasets/org/problems@main/main/test.parquet",
        "data.columns.prompt=question",
        "sft.steps=0",
        "rl.steps=1",
        "--run-dir",
        str(run),
    ]
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert f"model.path: org/tiny -> org/tiny@{MODEL_COMMIT}" in err
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["path"] == f"org/tiny@{MODEL_COMMIT}"
    assert saved["data"]["train_file"] == f"hf://datasets/org/problems@{COMMIT}/main/train.parquet"
    assert saved["data"]["eval_file"] == f"hf://datasets/org/problems@{COMMIT}/main/test.parquet"
    assert (run / "metrics.jsonl").read_text().count("\n") == 1
    assert "What is" in err  # the file's `question` column was the prompt the model saw
    assert json.loads((run / "eval.json").read_text())["num_prompts"] == 4  # the rows of main/test.parquet
    assert main(["train", "--resume", str(run), "rl.steps=1"]) == 0  # the pinned names resolve again


def test_eval_takes_hub_data_and_an_id_the_cache_lacks_exits_2(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tiny = ["data.columns.prompt=question", "eval.num_samples=0", "rollout.max_new_tokens=4"]
    assert main(["eval", "org/tiny", "--data", TRAIN, *tiny, "--run-dir", "ev"]) == 0
    assert (tmp_path / "ev" / "eval.json").is_file()
    capsys.readouterr()
    missing = "hf://datasets/org/absent/main/train.parquet"
    run = tmp_path / "never"
    assert main(["train", f"data.train_file={missing}", "rl.steps=1", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"data.train_file={missing}: not in the Hugging Face cache ({hub})" in err
    assert "`hf download org/absent --repo-type dataset main/train.parquet`" in err
    assert "Traceback" not in err and not run.exists()


@pytest.mark.parametrize(
    "path, expected",
    [
        ("hf://models/org/tiny/config.json", "not a dataset file on the Hub"),
        ("hf://org/problems/main/train.parquet", "not a dataset file on the Hub"),
        ("hf://datasets/org/problems", "names no file in the repo org/problems"),
        ("hf://datasets/org/problems@/main/train.parquet", "an empty revision after '@'"),
    ],
)
def test_a_hub_path_outside_dataset_files_exits_2_naming_the_key(hub, tmp_path, capsys, path, expected):
    run = tmp_path / "run"
    assert main(["train", f"data.eval_file={path}", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"data.eval_file={path}: {expected}" in err
    assert "expected hf://datasets/ORG/NAME/PATH" in err and not run.exists()


def test_a_snapshot_a_broken_download_left_is_refused_saying_so(hub, tmp_path):
    source = tmp_path / "half"
    source.mkdir()
    (source / "config.json").write_text("{}")  # the weights never arrived
    cache_repo(hub, "org/half", source, COMMIT)
    with pytest.raises(HubError, match=r"model.path=org/half: its snapshot .* has no model.safetensors"):
        resolve_model("org/half", "model.path")
    blobs = hub / "models--org--gone" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "0123.incomplete").write_bytes(b"half")
    with pytest.raises(
        HubError, match="A download of it broke off before: fetch it with `hf download org/gone`"
    ):
        resolve_model("org/gone")
