"""Models by their Hugging Face Hub ids (everyprompt/hub.py), with the Hub offline and a cache built in the
layout `huggingface_hub` writes (tests/conftest.py: `cache_repo`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from everyprompt.hub import HubError, hub_id, resolve_model
from everyprompt.models.io import load_pretrained
from everyprompt.models.presets import tiny_dense_config
from tests.conftest import cache_repo, make_tiny_model

COMMIT = "a" * 40
OLDER = "b" * 40


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two tiny checkpoints on disk: the model, and a changed copy (an older commit's weights)."""
    model, tokenizer = make_tiny_model()
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder / "now")
    tokenizer.save_pretrained(folder / "now")
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    model.save_pretrained(folder / "older")
    tokenizer.save_pretrained(folder / "older")
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    dense = LlamaForCausalLM(tiny_dense_config(len(tokenizer), *ids))  # upcycle takes a dense model
    dense.save_pretrained(folder / "dense")
    tokenizer.save_pretrained(folder / "dense")
    return folder


def test_ids_are_parsed_and_bad_ones_refused():
    assert hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert hub_id("org/name@" + COMMIT) == ("org/name", COMMIT)
    assert hub_id("a/b/c") is None and hub_id("name") is None and hub_id("/abs/path") is None
    with pytest.raises(HubError, match="an empty revision after '@'"):
        hub_id("org/name@")


def test_a_cached_id_loads_its_snapshot_and_a_pinned_commit_its_own(offline_cache, saved):
    cache_repo(offline_cache, "org/tiny", saved / "now", COMMIT)
    cache_repo(offline_cache, "org/tiny", saved / "older", OLDER, branch=None)
    path = resolve_model("org/tiny")
    assert path.name == COMMIT and (path / "config.json").is_file()
    model, tokenizer = load_pretrained("org/tiny")
    expected, _ = load_pretrained(saved / "now")
    assert torch.equal(model.model.embed_tokens.weight, expected.model.embed_tokens.weight)
    older, _ = load_pretrained(f"org/tiny@{OLDER}")
    assert torch.equal(older.model.embed_tokens.weight, expected.model.embed_tokens.weight + 1.0)


def test_an_id_the_cache_lacks_names_the_id_the_cache_and_the_command(offline_cache):
    with pytest.raises(HubError) as raised:
        resolve_model("org/missing", "model.path")
    message = str(raised.value)
    assert message.startswith("model.path=org/missing: not in the Hugging Face cache")
    assert str(offline_cache) in message and "`hf download org/missing`" in message
    with pytest.raises(HubError, match=r"`hf download org/missing --revision v2`"):
        resolve_model("org/missing@v2")


def test_a_name_neither_local_nor_an_id_is_refused_by_name(offline_cache, tmp_path, capsys):
    from everyprompt.cli import main
    from everyprompt.models.io import ModelError

    assert resolve_model("a/b/c") == Path("a/b/c")  # a path: its loader names what is wrong with it
    with pytest.raises(ModelError, match=r"a/b/c: .*no such path, and a Hugging Face Hub id is ORG/NAME"):
        load_pretrained("a/b/c")
    for setting, expected in [
        ("model.path=a/b/c", "model.path=a/b/c: no such path, and not a Hugging Face Hub id (expected a"),
        (
            "model.path=org/name@",
            "model.path=org/name@: an empty revision after '@' (expected ORG/NAME@BRANCH",
        ),
        ("rewards.genrm.model=x/y/z", "rewards.genrm.model=x/y/z: no such path, and not a Hugging Face"),
    ]:
        run = tmp_path / setting.partition("=")[0]
        assert main(["train", setting, "rl.steps=1", "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err
        # a missing local model fails in its run directory (a sweep's report lists the failed cell)
        assert not (run / "checkpoints").exists()


def test_a_local_directory_wins_over_an_id_of_the_same_name(offline_cache, saved, tmp_path, monkeypatch):
    cache_repo(offline_cache, "org/tiny", saved / "older", COMMIT)
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "org" / "tiny"
    local.parent.mkdir()
    local.symlink_to(saved / "now")
    assert resolve_model("org/tiny") == Path("org/tiny")
    model, _ = load_pretrained("org/tiny")
    expected, _ = load_pretrained(saved / "now")
    assert torch.equal(model.model.embed_tokens.weight, expected.model.embed_tokens.weight)


def test_a_one_step_run_trains_a_model_named_by_its_id(offline_cache, saved, tmp_path, monkeypatch):
    import huggingface_hub

    from everyprompt.pipeline import train
    from tests.conftest import tiny_config

    cache_repo(offline_cache, "org/tiny", saved / "now", COMMIT)
    looked_up: list[str] = []
    snapshot = huggingface_hub.snapshot_download
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda repo, **kw: looked_up.append(repo) or snapshot(repo, **kw),
    )
    config = tiny_config(
        "model.path=org/tiny", "sft.steps=0", "rl.steps=1", "eval.every=0", "data.num_eval=2"
    )
    train(config, run_dir=tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    assert looked_up == ["org/tiny"]  # checked before the run directory, then loaded: one lookup


@pytest.mark.long  # 6 s on 2 cores: `make test-long`
def test_eval_upcycle_filter_and_serve_take_an_id_and_write_nothing_into_the_cache(
    offline_cache, saved, tmp_path, monkeypatch
):
    from everyprompt.cli import main
    from everyprompt.serve.protocol import Limits
    from everyprompt.serve.server import build

    cache_repo(offline_cache, "org/tiny", saved / "now", COMMIT)
    cache_repo(offline_cache, "org/dense", saved / "dense", COMMIT)
    before = sorted(str(p) for p in offline_cache.rglob("*"))
    monkeypatch.chdir(tmp_path)
    tiny = ["data.num_eval=4", "eval.num_samples=0", "rollout.max_new_tokens=8"]
    assert main(["eval", "org/tiny", *tiny]) == 0
    assert (tmp_path / "org--tiny-eval" / "eval.json").is_file()  # in the working directory
    assert main(["eval", f"org/tiny@{COMMIT}", *tiny, "--run-dir", str(tmp_path / "pinned")]) == 0
    assert (tmp_path / "pinned" / "eval.json").is_file()
    assert main(["upcycle", "org/dense", str(tmp_path / "moe"), "--experts", "2", "--top-k", "1"]) == 0
    assert (tmp_path / "moe" / "config.json").is_file()
    assert main(["filter", "builtin", "--model", "org/tiny", "--samples", "2", "data.num_train=4",
                 "--out", str(tmp_path / "filtered")]) == 0  # fmt: skip
    serving, _ = build("org/tiny", 2, "fp32", "cpu", Limits(max_tokens=8, max_prompt_tokens=16, max_n=1))
    assert serving.engine.config.model_type == "qwen3_moe"  # `everyprompt serve org/tiny` loads it so
    assert sorted(str(p) for p in offline_cache.rglob("*")) == before  # the cache is only read


def test_a_missing_id_exits_2_naming_it_and_writes_nothing(offline_cache, tmp_path, monkeypatch, capsys):
    from everyprompt.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["eval", "org/missing"]) == 2
    error = capsys.readouterr().err
    assert (
        "CHECKPOINT=org/missing: not in the Hugging Face cache" in error
        and "hf download org/missing" in error
    )
    assert "Traceback" not in error and list(tmp_path.iterdir()) == [offline_cache]
    assert main(["train", "model.path=org/missing", "rl.steps=1", "--run-dir", str(tmp_path / "run")]) == 2
    assert "model.path=org/missing: not in the Hugging Face cache" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_a_fetch_shows_the_hubs_progress_bars_and_leaves_them_as_they_were(offline_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    from everyprompt import hub

    seen: list[bool] = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as online; the download itself is replaced
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda repo, **kw: seen.append(are_progress_bars_disabled()) or str(offline_cache / "x" / repo),
    )
    before = are_progress_bars_disabled()
    disable_progress_bars()  # as a run leaves them (logs.quiet_libraries)
    try:
        hub._download("model", "org/online", None, None, str(offline_cache))
        assert seen == [False] and are_progress_bars_disabled()  # on while it ran, off again after
    finally:
        (disable_progress_bars if before else enable_progress_bars)()


def test_teachers_named_by_id_are_pinned_in_config_yaml(offline_cache, saved, tmp_path):
    """rl.teacher.model and each of rl.teacher.models' values resolve and are written with their commit."""
    import yaml

    from everyprompt.pipeline import train
    from tests.conftest import tiny_config

    cache_repo(offline_cache, "org/tiny", saved / "now", COMMIT)
    cache_repo(offline_cache, "org/teacher", saved / "older", OLDER)
    base = ("model.path=org/tiny", "sft.steps=0", "rl.steps=1", "eval.num_samples=0", "data.num_eval=2")
    train(tiny_config(*base, "rl.teacher.model=org/teacher"), run_dir=tmp_path / "one")
    written = yaml.safe_load((tmp_path / "one" / "config.yaml").read_text())
    assert written["rl"]["teacher"]["model"] == f"org/teacher@{OLDER}"
    several = ("rl.teacher.by=level", "rl.teacher.models={4: org/teacher, 5: org/tiny}")
    train(tiny_config(*base, *several), run_dir=tmp_path / "several")
    written = yaml.safe_load((tmp_path / "several" / "config.yaml").read_text())
    assert written["rl"]["teacher"]["models"] == {"4": f"org/teacher@{OLDER}", "5": f"org/tiny@{COMMIT}"}
    metrics = (tmp_path / "several" / "metrics.jsonl").read_text()
    assert '"distill/reverse_kl"' in metrics
