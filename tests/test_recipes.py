"""Recipes by name (config/recipes.py): every config of configs/ ships in the package, `everyprompt
recipes` lists them, a bare name means the recipe for train/eval/sft/demo/sweep, and a config finds the
data files beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from everyprompt.cli import main
from everyprompt.config import ConfigError, load_config
from everyprompt.config.recipes import (
    anchor_data_files,
    find_config,
    recipe_names,
    recipe_summary,
    recipes_dir,
)
from everyprompt.data.rows import ConfigRows

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_every_config_of_the_repository_is_a_recipe_of_the_package_and_loads_by_name(tmp_path, monkeypatch):
    assert recipe_names() == sorted(p.stem for p in REPO_CONFIGS.glob("*.yaml"))
    monkeypatch.chdir(tmp_path)  # from an empty directory, as a user of the installed wheel
    for name in recipe_names():
        assert find_config(name) == recipes_dir() / f"{name}.yaml"
        assert find_config(f"{name}.yaml") == recipes_dir() / f"{name}.yaml"
        assert (recipes_dir() / f"{name}.yaml").read_text() == (REPO_CONFIGS / f"{name}.yaml").read_text()
        load_config(name)  # valid
        assert recipe_summary(name)  # each recipe opens with its one-line summary
    rows = ConfigRows(load_config("gsm8k-qwen3-moe-cpu")).rl()  # its data files, found beside it
    assert len(rows) == 400 and rows[0]["answer"]


def test_recipes_lists_each_with_its_line_and_a_wrong_name_lists_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    words = out.split()
    for name in recipe_names():
        assert name in words and all(word in words for word in recipe_summary(name).split())
    assert main(["train", "smollm3", "rl.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "config file not found: smollm3 (nor a recipe of that name: the recipes are demo, " in err
    assert "smollm2-tools" in err and not (tmp_path / "runs").exists()
    assert main(["train", "configs/smollm2.yaml"]) == 2  # a path is a path: never taken for a recipe
    assert "config file not found: configs/smollm2.yaml" in capsys.readouterr().err


def test_train_and_sweep_by_name(tmp_path, monkeypatch, capsys):
    from everyprompt.sweep import prepare
    from tests.conftest import TINY_OVERRIDES

    monkeypatch.chdir(tmp_path)
    argv = ["train", "demo", *TINY_OVERRIDES, "rl.steps=1", "sft.steps=1", "--run-dir", "run"]
    assert main(argv) == 0, capsys.readouterr().err
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["name"] == "demo"
    plan, _ = prepare("smollm2", [], "0,1", tmp_path / "sweep")
    assert plan.source == str(recipes_dir() / "smollm2.yaml") and plan.base["name"] == "smollm2"


def test_a_data_file_in_the_working_directory_comes_before_one_beside_the_config(tmp_path, monkeypatch):
    (tmp_path / "configs" / "data").mkdir(parents=True)
    (tmp_path / "configs" / "data" / "p.jsonl").write_text("")
    config = tmp_path / "configs" / "mine.yaml"
    tree = {"data": {"train_file": "data/p.jsonl", "eval_file": "data/q.jsonl"}}
    monkeypatch.chdir(tmp_path)
    anchored = anchor_data_files(yaml.safe_load(yaml.safe_dump(tree)), config)
    assert anchored["data"] == {
        "train_file": str(tmp_path / "configs" / "data" / "p.jsonl"),
        "eval_file": "data/q.jsonl",
    }
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.jsonl").write_text("")
    assert (
        anchor_data_files(yaml.safe_load(yaml.safe_dump(tree)), config)["data"]["train_file"]
        == "data/p.jsonl"
    )
    hub = {"data": {"train_file": "hf://datasets/org/name/main/p.jsonl"}}
    assert anchor_data_files(hub, config) == hub
    config.write_text(yaml.safe_dump(tree))
    override = load_config(
        config, ["data.eval_file=data/p.jsonl"]
    ).data  # an override: the working directory's
    assert override.eval_file == "data/p.jsonl"


def test_a_config_argument_that_is_neither_is_a_config_error():
    with pytest.raises(ConfigError, match="config file not found: elsewhere/demo.yaml"):
        find_config("elsewhere/demo.yaml")  # a name with a folder is a path, not a recipe


def test_each_recipe_summary_is_a_whole_line_not_a_sentence_cut_short():
    """`everyprompt recipes` shows each recipe's first comment line: the line after it starts anew."""
    for name in recipe_names():
        lines = (recipes_dir() / f"{name}.yaml").read_text().splitlines()
        second = lines[1]
        assert second.startswith("#   ") or (second.startswith("# ") and second[2].isupper()), (name, second)
